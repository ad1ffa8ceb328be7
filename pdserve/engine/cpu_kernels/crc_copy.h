/* The fused copy + CRC-32C that kv_ingest.c and the sender's op (crc_copy.c) share. */
#ifndef PDSERVE_CPU_KERNELS_CRC_COPY_H
#define PDSERVE_CPU_KERNELS_CRC_COPY_H

#include <stddef.h>
#include <stdint.h>

/* Which implementation runs; crc_copy.py's PATHS holds the same numbers. */
#define CC_BEST 0     /* the fastest one compiled in */
#define CC_PORTABLE 1 /* slicing-by-8 tables, any target */
#define CC_SSE42 2    /* the crc32 instruction on three interleaved lanes */
#define CC_VPCLMUL 3  /* AVX-512 VPCLMULQDQ folding of 16 x 128-bit lanes */

/* dst = src for n bytes (the two must not overlap); returns the raw CRC-32C register (no
 * pre- or post-inversion) continued from `raw` over those bytes. `path` must be CC_BEST or
 * one whose bit is set in cc_paths(). */
uint32_t crc_copy_raw(uint32_t raw, uint8_t *dst, const uint8_t *src, size_t n, int path);

#endif
