/* Received KV into the paged cache in one pass: copy a chunk's payload into its blocks
 * while taking the payload's CRC-32C, so the receiver reads the bytes once instead of twice
 * (a checksum pass, then the copy). The copy + CRC-32C itself is crc_copy.c's (the fastest
 * path compiled in: AVX-512 VPCLMULQDQ folding, SSE4.2 crc32 lanes, or portable tables).
 */
#include <stdint.h>

#include "crc_copy.h"

/* One layer of a chunk into the cache: k and v are n blocks of block_bytes each
 * (contiguous); block i goes to row block_ids[i] of k_cache and of v_cache (rows of
 * block_bytes, contiguous). Returns the CRC-32C of k's bytes then v's continued from `crc`
 * (0 to start one; a chunk of several layers passes each layer the previous one's), taken
 * by crc_copy.c's `path` (CC_BEST but in the tests). The caller has checked every id
 * against the caches' rows, and the path against cc_paths(). */
uint32_t ki_ingest_blocks(const void *k, const void *v, void *k_cache, void *v_cache,
                          const int64_t *block_ids, int64_t n, int64_t block_bytes,
                          int32_t path, uint32_t crc_in)
{
    uint32_t crc = ~crc_in;
    for (int half = 0; half < 2; half++) {
        const uint8_t *src = (const uint8_t *)(half ? v : k);
        uint8_t *cache = (uint8_t *)(half ? v_cache : k_cache);
        for (int64_t i = 0; i < n; i++, src += block_bytes)
            crc = crc_copy_raw(crc, cache + block_ids[i] * block_bytes, src, (size_t)block_bytes,
                               path);
    }
    return ~crc;
}
