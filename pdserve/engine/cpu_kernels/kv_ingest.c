/* Received KV into the paged cache in one pass: copy a chunk's payload into its blocks
 * while taking the payload's CRC-32C, so the receiver reads the bytes once instead of twice
 * (a checksum pass, then the copy).
 *
 * CRC-32C (Castagnoli, reflected, init and final xor ~0: what the `crc32c` package and
 * the wire format use). With SSE4.2 the crc32 instruction does 8 bytes at a time, but its
 * 3-cycle latency would leave it at a third of its throughput on one dependency chain, so
 * a span is cut into three lanes run side by side, and the lanes' CRCs are joined after:
 * crc(A || B) = zeros(crc(A), |B|) ^ crc(B) on the raw (unconditioned) register, where
 * zeros() appends |B| zero bytes, a linear map on 32 bits applied with four byte tables
 * built once per lane length. Without SSE4.2 (another architecture, an x86-64-v1 build),
 * slicing-by-8 tables in portable C.
 *
 * Copy and checksum share each 8-byte load, so a byte goes through the core once: loaded,
 * folded into its lane's CRC, stored into the cache block.
 */
#include <stdint.h>
#include <string.h>

#include "common.h"

#if defined(__x86_64__) && defined(__SSE4_2__)
#include <nmmintrin.h>
#define KI_HW 1
#else
#define KI_HW 0
#endif

#define POLY 0x82f63b78u /* CRC-32C, reflected */
#define LANE_LONG 4096   /* bytes per lane in the long stride: 12 KiB per three lanes */
#define LANE_SHORT 256   /* the short stride, for what is left of a span */

static uint32_t slice8[8][256]; /* software CRC: slicing-by-8 (bytes and tails on SSE4.2) */
#if KI_HW
static uint32_t zeros_long[4][256];  /* append LANE_LONG zero bytes to a raw CRC */
static uint32_t zeros_short[4][256]; /* append LANE_SHORT zero bytes */

static uint32_t gf2_apply(const uint32_t *mat, uint32_t vec)
{
    uint32_t sum = 0;
    for (int i = 0; vec; i++, vec >>= 1)
        if (vec & 1)
            sum ^= mat[i];
    return sum;
}

static void gf2_square(uint32_t *square, const uint32_t *mat)
{
    for (int i = 0; i < 32; i++)
        square[i] = gf2_apply(mat, mat[i]);
}

/* tables[k][b] = zeros(b << 8k) for zeros() = "append len zero bytes"; len a power of 2. */
static void build_zeros(uint32_t tables[4][256], uint32_t len)
{
    uint32_t op[32], sq[32];
    op[0] = POLY; /* one zero bit: the operator's columns */
    for (int i = 1; i < 32; i++)
        op[i] = 1u << (i - 1);
    gf2_square(sq, op); /* two bits */
    gf2_square(op, sq); /* four */
    gf2_square(sq, op); /* one byte */
    memcpy(op, sq, sizeof op);
    for (uint32_t n = 1; n < len; n <<= 1) {
        gf2_square(sq, op);
        memcpy(op, sq, sizeof op);
    }
    for (int k = 0; k < 4; k++)
        for (uint32_t b = 0; b < 256; b++)
            tables[k][b] = gf2_apply(op, b << (8 * k));
}

static uint32_t zeros(const uint32_t tables[4][256], uint32_t crc)
{
    return tables[0][crc & 0xff] ^ tables[1][(crc >> 8) & 0xff] ^
           tables[2][(crc >> 16) & 0xff] ^ tables[3][crc >> 24];
}
#endif

__attribute__((constructor)) static void ki_init(void)
{
    for (uint32_t b = 0; b < 256; b++) {
        uint32_t c = b;
        for (int j = 0; j < 8; j++)
            c = c & 1 ? (c >> 1) ^ POLY : c >> 1;
        slice8[0][b] = c;
    }
    for (uint32_t b = 0; b < 256; b++)
        for (int k = 1; k < 8; k++)
            slice8[k][b] = (slice8[k - 1][b] >> 8) ^ slice8[0][slice8[k - 1][b] & 0xff];
#if KI_HW
    build_zeros(zeros_long, LANE_LONG);
    build_zeros(zeros_short, LANE_SHORT);
#endif
}

/* dst = src for n bytes, one at a time; returns the raw CRC continued over them. */
static uint32_t copy_crc_bytes(uint32_t crc, uint8_t *dst, const uint8_t *src, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        crc = (crc >> 8) ^ slice8[0][(crc ^ src[i]) & 0xff];
        dst[i] = src[i];
    }
    return crc;
}

#if KI_HW
/* dst = src for three lanes of `lane` bytes each (a multiple of 8); returns the raw CRC
 * of all 3 * lane bytes continued from crc. */
INLINE uint32_t copy_crc_lanes(uint32_t crc, uint8_t *dst, const uint8_t *src, size_t lane,
                          const uint32_t tables[4][256])
{
    uint64_t c0 = crc, c1 = 0, c2 = 0;
    const uint8_t *s1 = src + lane, *s2 = src + 2 * lane;
    for (size_t i = 0; i < lane; i += 8) {
        uint64_t a, b, c;
        memcpy(&a, src + i, 8);
        memcpy(&b, s1 + i, 8);
        memcpy(&c, s2 + i, 8);
        c0 = _mm_crc32_u64(c0, a);
        c1 = _mm_crc32_u64(c1, b);
        c2 = _mm_crc32_u64(c2, c);
        memcpy(dst + i, &a, 8);
        memcpy(dst + lane + i, &b, 8);
        memcpy(dst + 2 * lane + i, &c, 8);
    }
    uint32_t r = zeros(tables, (uint32_t)c0) ^ (uint32_t)c1;
    return zeros(tables, r) ^ (uint32_t)c2;
}

/* dst = src for n bytes; returns the raw CRC continued over them. */
static uint32_t copy_crc(uint32_t crc, uint8_t *dst, const uint8_t *src, size_t n)
{
    for (; n >= 3 * LANE_LONG; n -= 3 * LANE_LONG, src += 3 * LANE_LONG, dst += 3 * LANE_LONG)
        crc = copy_crc_lanes(crc, dst, src, LANE_LONG, zeros_long);
    for (; n >= 3 * LANE_SHORT; n -= 3 * LANE_SHORT, src += 3 * LANE_SHORT,
                                dst += 3 * LANE_SHORT)
        crc = copy_crc_lanes(crc, dst, src, LANE_SHORT, zeros_short);
    uint64_t c = crc;
    for (; n >= 8; n -= 8, src += 8, dst += 8) {
        uint64_t a;
        memcpy(&a, src, 8);
        c = _mm_crc32_u64(c, a);
        memcpy(dst, &a, 8);
    }
    return copy_crc_bytes((uint32_t)c, dst, src, n);
}
#else
static uint32_t copy_crc(uint32_t crc, uint8_t *dst, const uint8_t *src, size_t n)
{
    for (; n >= 8; n -= 8, src += 8, dst += 8) {
        uint64_t a;
        memcpy(&a, src, 8);
        a ^= crc; /* little-endian: the low 4 bytes take the register */
        crc = slice8[7][a & 0xff] ^ slice8[6][(a >> 8) & 0xff] ^
              slice8[5][(a >> 16) & 0xff] ^ slice8[4][(a >> 24) & 0xff] ^
              slice8[3][(a >> 32) & 0xff] ^ slice8[2][(a >> 40) & 0xff] ^
              slice8[1][(a >> 48) & 0xff] ^ slice8[0][a >> 56];
        memcpy(dst, src, 8);
    }
    return copy_crc_bytes(crc, dst, src, n);
}
#endif

/* One chunk into the cache: k and v are n blocks of block_bytes each (contiguous); block i
 * goes to row block_ids[i] of k_cache and of v_cache (rows of block_bytes, contiguous).
 * Returns the CRC-32C of k's bytes then v's (the wire payload's). The caller has checked
 * every id against the caches' rows. */
uint32_t ki_ingest_blocks(const void *k, const void *v, void *k_cache, void *v_cache,
                          const int64_t *block_ids, int64_t n, int64_t block_bytes)
{
    uint32_t crc = ~0u;
    for (int half = 0; half < 2; half++) {
        const uint8_t *src = (const uint8_t *)(half ? v : k);
        uint8_t *cache = (uint8_t *)(half ? v_cache : k_cache);
        for (int64_t i = 0; i < n; i++, src += block_bytes)
            crc = copy_crc(crc, cache + block_ids[i] * block_bytes, src, (size_t)block_bytes);
    }
    return ~crc;
}
