/* Copying bytes while taking their CRC-32C, so a byte goes through the core once: loaded,
 * folded into the checksum, stored. The receiver's ingest (kv_ingest.c) and the
 * shared-memory sender (`pdserve::copy_crc32c`, crc_copy.py) both use it.
 *
 * CRC-32C is Castagnoli, reflected, init and final xor ~0: what the `crc32c` package and the
 * wire format use. Three implementations, the best one compiled in chosen by default (the
 * others stay selectable for the tests):
 *
 * - VPCLMULQDQ (AVX-512): carry-less-multiply folding. The message is a polynomial over
 *   GF(2) and its raw CRC is M(x) x^32 mod P; a 128-bit block A that sits F bits before
 *   another block B may be replaced by anything congruent to A x^F mod P and xored into B.
 *   Split A = A1 x^64 + A0 (A1 the first 8 bytes): A x^F = A1 x^(F+64) + A0 x^F, and each
 *   half times a 32-bit constant x^k mod P is a product of fewer than 128 bits, which
 *   `vpclmulqdq` makes for four 128-bit lanes of a zmm register at once. In the reflected
 *   bit order a 64 x 64-bit carry-less product lands one bit off (it is 127 bits wide) and
 *   a 32-bit constant in the low half of a 64-bit operand counts as x^32 higher, so the
 *   constants are x^(F+31) mod P for A1 and x^(F-33) mod P for A0 (fold_constant() below,
 *   computed at load time; a Python model checked the derivation against the `crc32c`
 *   package). Four zmm accumulators take 256 bytes a round, each folded 2048 bits forward
 *   into the next round's loads; at the end the 16 lanes are folded onto the last and the
 *   remaining 128 bits go through the crc32 instruction (128 bits x^32 mod P is exactly
 *   what it computes from a zero register), then the tail through the SSE4.2 path.
 * - SSE4.2: the crc32 instruction 8 bytes at a time. Its 3-cycle latency would leave it at
 *   a third of its throughput on one dependency chain, so a span is cut into three lanes
 *   run side by side and joined after: crc(A || B) = zeros(crc(A), |B|) ^ crc(B) on the raw
 *   register, where zeros() appends |B| zero bytes, a linear map on 32 bits applied with
 *   four byte tables built once per lane length.
 * - Portable: slicing-by-8 tables in plain C (another architecture, an x86-64-v1 build).
 */
#include <stdint.h>
#include <string.h>

#include "common.h"
#include "crc_copy.h"

#if defined(__x86_64__) && defined(__SSE4_2__)
#include <nmmintrin.h>
#define HAVE_SSE42 1
#else
#define HAVE_SSE42 0
#endif
#if HAVE_SSE42 && defined(__VPCLMULQDQ__) && defined(__AVX512F__)
#include <immintrin.h>
#define HAVE_VPCLMUL 1
#else
#define HAVE_VPCLMUL 0
#endif

#define POLY 0x82f63b78u /* CRC-32C, reflected */
#define LANE_LONG 4096   /* bytes per lane in the SSE4.2 long stride: 12 KiB per three lanes */
#define LANE_SHORT 256   /* its short stride, for what is left of a span */
#define ROUND 256        /* bytes per VPCLMULQDQ round: 4 zmm accumulators */

static uint32_t slice8[8][256]; /* software CRC: slicing-by-8 (and single bytes) */

/* dst = src for n bytes, one at a time; returns the raw CRC continued over them. */
static uint32_t copy_crc_bytes(uint32_t crc, uint8_t *dst, const uint8_t *src, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        crc = (crc >> 8) ^ slice8[0][(crc ^ src[i]) & 0xff];
        dst[i] = src[i];
    }
    return crc;
}

static uint32_t copy_crc_portable(uint32_t crc, uint8_t *dst, const uint8_t *src, size_t n)
{
    for (; n >= 8; n -= 8, src += 8, dst += 8) {
        uint64_t a;
        memcpy(&a, src, 8);
        memcpy(dst, &a, 8);
        a ^= crc; /* little-endian: the low 4 bytes take the register */
        crc = slice8[7][a & 0xff] ^ slice8[6][(a >> 8) & 0xff] ^
              slice8[5][(a >> 16) & 0xff] ^ slice8[4][(a >> 24) & 0xff] ^
              slice8[3][(a >> 32) & 0xff] ^ slice8[2][(a >> 40) & 0xff] ^
              slice8[1][(a >> 48) & 0xff] ^ slice8[0][a >> 56];
    }
    return copy_crc_bytes(crc, dst, src, n);
}

#if HAVE_SSE42
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

static uint32_t copy_crc_sse42(uint32_t crc, uint8_t *dst, const uint8_t *src, size_t n)
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
#endif

#if HAVE_VPCLMUL
/* Per 128-bit lane, (low qword, high qword) = (x^(F+31), x^(F-33)) mod P, reflected:
 * fold_round folds every lane ROUND bytes forward; fold_tail[j] folds lane l of accumulator
 * j onto the last lane (F = (15 - 4j - l) * 128 bits), the last lane's own pair left 0. */
static uint64_t fold_round[8] __attribute__((aligned(64)));
static uint64_t fold_tail[4][8] __attribute__((aligned(64)));

/* x^k mod P in the reflected order (bit 31 is x^0): k multiplications by x. */
static uint32_t xpow_mod(uint32_t k)
{
    uint32_t v = 0x80000000u;
    while (k--)
        v = (v >> 1) ^ (v & 1 ? POLY : 0);
    return v;
}

static void fold_constant(uint64_t pair[2], uint32_t bits)
{
    pair[0] = xpow_mod(bits + 31);
    pair[1] = xpow_mod(bits - 33);
}

/* acc's lanes, each folded by its own constants (one vpclmulqdq per qword half). */
INLINE __m512i fold(__m512i acc, __m512i k)
{
    return _mm512_xor_si512(_mm512_clmulepi64_epi128(acc, k, 0x00),
                            _mm512_clmulepi64_epi128(acc, k, 0x11));
}

static uint32_t copy_crc_vpclmul(uint32_t crc, uint8_t *dst, const uint8_t *src, size_t n)
{
    if (n < 2 * ROUND) /* setup and the final fold cost more than they save */
        return copy_crc_sse42(crc, dst, src, n);
    __m512i a0 = _mm512_loadu_si512(src), a1 = _mm512_loadu_si512(src + 64);
    __m512i a2 = _mm512_loadu_si512(src + 128), a3 = _mm512_loadu_si512(src + 192);
    _mm512_storeu_si512(dst, a0);
    _mm512_storeu_si512(dst + 64, a1);
    _mm512_storeu_si512(dst + 128, a2);
    _mm512_storeu_si512(dst + 192, a3);
    /* the register so far is xored into the first 32 bits: crc x^(8n) + M x^32 */
    a0 = _mm512_xor_si512(a0, _mm512_set_epi64(0, 0, 0, 0, 0, 0, 0, crc));
    const __m512i k = _mm512_load_si512(fold_round);
    size_t i = ROUND;
    for (; i + ROUND <= n; i += ROUND) {
        const __m512i d0 = _mm512_loadu_si512(src + i);
        const __m512i d1 = _mm512_loadu_si512(src + i + 64);
        const __m512i d2 = _mm512_loadu_si512(src + i + 128);
        const __m512i d3 = _mm512_loadu_si512(src + i + 192);
        _mm512_storeu_si512(dst + i, d0);
        _mm512_storeu_si512(dst + i + 64, d1);
        _mm512_storeu_si512(dst + i + 128, d2);
        _mm512_storeu_si512(dst + i + 192, d3);
        /* 0x96: the three-way xor */
        a0 = _mm512_ternarylogic_epi64(_mm512_clmulepi64_epi128(a0, k, 0x00),
                                       _mm512_clmulepi64_epi128(a0, k, 0x11), d0, 0x96);
        a1 = _mm512_ternarylogic_epi64(_mm512_clmulepi64_epi128(a1, k, 0x00),
                                       _mm512_clmulepi64_epi128(a1, k, 0x11), d1, 0x96);
        a2 = _mm512_ternarylogic_epi64(_mm512_clmulepi64_epi128(a2, k, 0x00),
                                       _mm512_clmulepi64_epi128(a2, k, 0x11), d2, 0x96);
        a3 = _mm512_ternarylogic_epi64(_mm512_clmulepi64_epi128(a3, k, 0x00),
                                       _mm512_clmulepi64_epi128(a3, k, 0x11), d3, 0x96);
    }
    /* every lane onto the last one (which keeps its own bits), then the four lanes xored */
    __m512i s = _mm512_ternarylogic_epi64(fold(a0, _mm512_load_si512(fold_tail[0])),
                                          fold(a1, _mm512_load_si512(fold_tail[1])),
                                          fold(a2, _mm512_load_si512(fold_tail[2])), 0x96);
    s = _mm512_ternarylogic_epi64(s, fold(a3, _mm512_load_si512(fold_tail[3])),
                                  _mm512_maskz_mov_epi64(0xc0, a3), 0x96);
    __m128i t = _mm_xor_si128(
        _mm_xor_si128(_mm512_extracti32x4_epi32(s, 0), _mm512_extracti32x4_epi32(s, 1)),
        _mm_xor_si128(_mm512_extracti32x4_epi32(s, 2), _mm512_extracti32x4_epi32(s, 3)));
    uint64_t c = _mm_crc32_u64(0, (uint64_t)_mm_cvtsi128_si64(t));
    c = _mm_crc32_u64(c, (uint64_t)_mm_extract_epi64(t, 1));
    return copy_crc_sse42((uint32_t)c, dst + i, src + i, n - i);
}
#endif

__attribute__((constructor)) static void cc_init(void)
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
#if HAVE_SSE42
    build_zeros(zeros_long, LANE_LONG);
    build_zeros(zeros_short, LANE_SHORT);
#endif
#if HAVE_VPCLMUL
    for (int l = 0; l < 4; l++)
        fold_constant(fold_round + 2 * l, 8 * ROUND);
    for (int j = 0; j < 4; j++)
        for (int l = 0; l < 4; l++)
            if (4 * j + l < 15)
                fold_constant(fold_tail[j] + 2 * l, (uint32_t)(15 - 4 * j - l) * 128);
#endif
}

uint32_t crc_copy_raw(uint32_t raw, uint8_t *dst, const uint8_t *src, size_t n, int path)
{
    switch (path) {
#if HAVE_VPCLMUL
    case CC_BEST:
    case CC_VPCLMUL:
        return copy_crc_vpclmul(raw, dst, src, n);
#endif
#if HAVE_SSE42
#if !HAVE_VPCLMUL
    case CC_BEST:
#endif
    case CC_SSE42:
        return copy_crc_sse42(raw, dst, src, n);
#endif
    default:
        return copy_crc_portable(raw, dst, src, n);
    }
}

/* The paths compiled in: bit p set for each path number p (CC_PORTABLE ...). */
int32_t cc_paths(void)
{
    return 1 << CC_PORTABLE | HAVE_SSE42 << CC_SSE42 | HAVE_VPCLMUL << CC_VPCLMUL;
}

/* dst = src for n bytes; returns the CRC-32C of those bytes continued from `crc` (the
 * finished CRC of what came before them, 0 for none: the `crc32c` package's `value`). */
uint32_t cc_copy_crc32c(void *dst, const void *src, int64_t n, uint32_t crc, int32_t path)
{
    return ~crc_copy_raw(~crc, (uint8_t *)dst, (const uint8_t *)src, (size_t)n, path);
}
