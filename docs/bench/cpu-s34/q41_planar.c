/* Session 34, tried and not kept: a Q4_1 row laid out planar (its blocks' float16 (d, m) pairs,
 * then their codes) against the GGUF's interleaved blocks, one thread, in cache: ns per block
 * at one row of x, float32 and bfloat16 (bfloat16 also with two blocks' tables rounded in one
 * vcvtne2ps2bf16, "pair"). The planar rows' (d, m) are widened 16 at a time before the row.
 * The gain here (float32 0.88x, bfloat16 0.77-0.80x) did not survive the whole model on two
 * threads (docs/benchmarks.md section 6, session 34).
 *
 *   gcc -O3 -march=native -ffast-math -fopenmp q41_planar.c -o /tmp/q41 && /tmp/q41 1536 40
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <stdlib.h>
#include <omp.h>
static const float IOTA[16] = {0,1,2,3,4,5,6,7,8,9,10,11,12,13,14,15};
/* mode 0: GGUF interleaved (20 B/block); mode 4: planar row [nb dm pairs f16][nb x 16 codes] */
static float dot0(const uint8_t *row, const float *x, int nb) {
  const __m512 iota = _mm512_loadu_ps(IOTA);
  const __m512i spread = _mm512_set_epi32(15,14,13,12,11,10,9,8,7,6,5,4,3,2,1,0);
  __m512 a[4] = {_mm512_setzero_ps(),_mm512_setzero_ps(),_mm512_setzero_ps(),_mm512_setzero_ps()};
  for (int b = 0; b < nb; b += 2) for (int j = 0; j < 2; j++) { const uint8_t *p = row + (b+j)*20;
    int32_t dm32; memcpy(&dm32, p, 4);
    const __m128 dm = _mm_cvtph_ps(_mm_cvtsi32_si128(dm32));
    __m512 table = _mm512_fmadd_ps(iota, _mm512_broadcastss_ps(dm), _mm512_broadcastss_ps(_mm_movehdup_ps(dm)));
    const __m512i codes = _mm512_permutexvar_epi8(spread, _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)(p + 4))));
    a[2*j] = _mm512_fmadd_ps(_mm512_permutexvar_ps(codes, table), _mm512_loadu_ps(x + (b+j)*32), a[2*j]);
    a[2*j+1] = _mm512_fmadd_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(codes, 4), table), _mm512_loadu_ps(x + (b+j)*32 + 16), a[2*j+1]); }
  return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a[0],a[1]),_mm512_add_ps(a[2],a[3])));
}
static float dot4(const uint8_t *row, const float *x, int nb) {
  const __m512 iota = _mm512_loadu_ps(IOTA);
  const __m512i spread = _mm512_set_epi32(15,14,13,12,11,10,9,8,7,6,5,4,3,2,1,0);
  float dmf[2*64] __attribute__((aligned(64)));
  const uint16_t *dmh = (const uint16_t *)row;
  for (int b = 0; b < 2*nb; b += 16)
    _mm512_store_ps(dmf + b, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(dmh + b))));
  const uint8_t *codes_base = row + 4*nb;
  __m512 a[4] = {_mm512_setzero_ps(),_mm512_setzero_ps(),_mm512_setzero_ps(),_mm512_setzero_ps()};
  for (int b = 0; b < nb; b += 2) for (int j = 0; j < 2; j++) {
    __m512 table = _mm512_fmadd_ps(iota, _mm512_set1_ps(dmf[2*(b+j)]), _mm512_set1_ps(dmf[2*(b+j)+1]));
    const __m512i codes = _mm512_permutexvar_epi8(spread, _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)(codes_base + 16*(b+j)))));
    a[2*j] = _mm512_fmadd_ps(_mm512_permutexvar_ps(codes, table), _mm512_loadu_ps(x + (b+j)*32), a[2*j]);
    a[2*j+1] = _mm512_fmadd_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(codes, 4), table), _mm512_loadu_ps(x + (b+j)*32 + 16), a[2*j+1]); }
  return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a[0],a[1]),_mm512_add_ps(a[2],a[3])));
}
/* bf16: mode 0 as main's q41_weights_bf16 path; mode 4 planar */
static float dotb0(const uint8_t *row, const uint16_t *x, int nb) {
  const __m512 iota = _mm512_loadu_ps(IOTA);
  const __m512i spread = _mm512_set_epi16(15,14,13,12,11,10,9,8,7,6,5,4,3,2,1,0,15,14,13,12,11,10,9,8,7,6,5,4,3,2,1,0);
  const __m512i shift = _mm512_set_epi16(4,4,4,4,4,4,4,4,4,4,4,4,4,4,4,4,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0);
  __m512 a[4] = {_mm512_setzero_ps(),_mm512_setzero_ps(),_mm512_setzero_ps(),_mm512_setzero_ps()};
  for (int b = 0; b < nb; b += 4) for (int j = 0; j < 4; j++) { const uint8_t *p = row + (b+j)*20;
    int32_t dm32; memcpy(&dm32, p, 4);
    const __m128 dm = _mm_cvtph_ps(_mm_cvtsi32_si128(dm32));
    const __m512 table = _mm512_fmadd_ps(iota, _mm512_broadcastss_ps(dm), _mm512_broadcastss_ps(_mm_movehdup_ps(dm)));
    const __m512i table16 = _mm512_broadcast_i64x4((__m256i)_mm512_cvtneps_pbh(table));
    const __m512i codes = _mm512_permutexvar_epi8(spread, _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)(p + 4))));
    __m512bh w = (__m512bh)_mm512_permutexvar_epi16(_mm512_srlv_epi16(codes, shift), table16);
    a[j] = _mm512_dpbf16_ps(a[j], w, (__m512bh)_mm512_loadu_si512(x + (b+j)*32)); }
  return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a[0],a[1]),_mm512_add_ps(a[2],a[3])));
}
static float dotb4(const uint8_t *row, const uint16_t *x, int nb) {
  const __m512 iota2 = _mm512_setr_ps(0,1,2,3,4,5,6,7,8,9,10,11,12,13,14,15);
  const __m512i spread = _mm512_set_epi16(15,14,13,12,11,10,9,8,7,6,5,4,3,2,1,0,15,14,13,12,11,10,9,8,7,6,5,4,3,2,1,0);
  const __m512i shift = _mm512_set_epi16(4,4,4,4,4,4,4,4,4,4,4,4,4,4,4,4,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0);
  float dmf[2*64] __attribute__((aligned(64)));
  const uint16_t *dmh = (const uint16_t *)row;
  for (int b = 0; b < 2*nb; b += 16)
    _mm512_store_ps(dmf + b, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(dmh + b))));
  const uint8_t *cb = row + 4*nb;
  __m512 a[4] = {_mm512_setzero_ps(),_mm512_setzero_ps(),_mm512_setzero_ps(),_mm512_setzero_ps()};
  for (int b = 0; b < nb; b += 4) for (int j = 0; j < 4; j += 2) {
    /* two blocks' tables in one register: block b+j in words 0-15, b+j+1 in 16-31 */
    const __m512 t0 = _mm512_fmadd_ps(iota2, _mm512_set1_ps(dmf[2*(b+j)]), _mm512_set1_ps(dmf[2*(b+j)+1]));
    const __m512 t1 = _mm512_fmadd_ps(iota2, _mm512_set1_ps(dmf[2*(b+j)+2]), _mm512_set1_ps(dmf[2*(b+j)+3]));
    const __m512i t16 = (__m512i)_mm512_cvtne2ps_pbh(t1, t0);
    for (int h = 0; h < 2; h++) {
      const __m512i codes = _mm512_permutexvar_epi8(spread, _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)(cb + 16*(b+j+h)))));
      const __m512i idx = _mm512_ternarylogic_epi32(_mm512_srlv_epi16(codes, shift), _mm512_set1_epi16(15), _mm512_set1_epi16(h ? 16 : 0), 0xEA); /* (A & B) | C */
      __m512bh w = (__m512bh)_mm512_permutexvar_epi16(idx, t16);
      a[j+h] = _mm512_dpbf16_ps(a[j+h], w, (__m512bh)_mm512_loadu_si512(x + (b+j+h)*32)); }
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a[0],a[1]),_mm512_add_ps(a[2],a[3])));
}
static float dotb5(const uint8_t *row, const uint16_t *x, int nb) {
  const __m512 iota2 = _mm512_setr_ps(0,1,2,3,4,5,6,7,8,9,10,11,12,13,14,15);
  const __m512i spread = _mm512_set_epi16(15,14,13,12,11,10,9,8,7,6,5,4,3,2,1,0,15,14,13,12,11,10,9,8,7,6,5,4,3,2,1,0);
  const __m512i shift = _mm512_set_epi16(4,4,4,4,4,4,4,4,4,4,4,4,4,4,4,4,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0);
  
  __m512 a[4] = {_mm512_setzero_ps(),_mm512_setzero_ps(),_mm512_setzero_ps(),_mm512_setzero_ps()};
  for (int b = 0; b < nb; b += 4) for (int j = 0; j < 4; j += 2) {
    /* two blocks' tables in one register: block b+j in words 0-15, b+j+1 in 16-31 */
    int32_t d0, d1; memcpy(&d0, row + 20*(b+j), 4); memcpy(&d1, row + 20*(b+j+1), 4);
    const __m128 dm0 = _mm_cvtph_ps(_mm_cvtsi32_si128(d0)), dm1 = _mm_cvtph_ps(_mm_cvtsi32_si128(d1));
    const __m512 t0 = _mm512_fmadd_ps(iota2, _mm512_broadcastss_ps(dm0), _mm512_broadcastss_ps(_mm_movehdup_ps(dm0)));
    const __m512 t1 = _mm512_fmadd_ps(iota2, _mm512_broadcastss_ps(dm1), _mm512_broadcastss_ps(_mm_movehdup_ps(dm1)));
    const __m512i t16 = (__m512i)_mm512_cvtne2ps_pbh(t1, t0);
    for (int h = 0; h < 2; h++) {
      const __m512i codes = _mm512_permutexvar_epi8(spread, _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)(row + 20*(b+j+h) + 4))));
      const __m512i idx = _mm512_ternarylogic_epi32(_mm512_srlv_epi16(codes, shift), _mm512_set1_epi16(15), _mm512_set1_epi16(h ? 16 : 0), 0xEA); /* (A & B) | C */
      __m512bh w = (__m512bh)_mm512_permutexvar_epi16(idx, t16);
      a[j+h] = _mm512_dpbf16_ps(a[j+h], w, (__m512bh)_mm512_loadu_si512(x + (b+j+h)*32)); }
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a[0],a[1]),_mm512_add_ps(a[2],a[3])));
}
int main(int argc, char **argv) {
  int K = argc > 1 ? atoi(argv[1]) : 576, N = 576, nb = K/32; int reps = 2000;
  int nmat = argc > 2 ? atoi(argv[2]) : 1;
  size_t mb = (size_t)N*nb*20;
  uint8_t *w = aligned_alloc(64, mb*nmat), *wp = aligned_alloc(64, mb*nmat);
  for (size_t i = 0; i < mb*nmat; i++) w[i] = (i*7)%13+16;
  for (size_t m = 0; m < (size_t)nmat*N; m++) { /* planar copy of each row */
    const uint8_t *r = w + m*nb*20; uint8_t *o = wp + m*nb*20;
    for (int b = 0; b < nb; b++) { memcpy(o + 4*b, r + 20*b, 4); memcpy(o + 4*nb + 16*b, r + 20*b + 4, 16); } }
  float *x = aligned_alloc(64, K*4); for (int i=0;i<K;i++) x[i]=(i%17)*0.01f;
  uint16_t *xb = aligned_alloc(64, K*2); for (int i=0;i<K;i++) { float f=x[i]; uint32_t u; memcpy(&u,&f,4); xb[i]=u>>16; }
  volatile float y;
  for (int r = 0; r < 3; r++) for (int mode = 0; mode < 5; mode++) {
    double t = omp_get_wtime(); float s = 0;
    for (int k = 0; k < reps; k++) { size_t o = (size_t)(k % nmat)*N*nb*20; for (int n = 0; n < N; n++) {
      const size_t ro = o + (size_t)n*nb*20;
      s += mode==0 ? dot0(w+ro, x, nb) : mode==1 ? dot4(wp+ro, x, nb) : mode==2 ? dotb0(w+ro, xb, nb) : mode==3 ? dotb4(wp+ro, xb, nb) : dotb5(w+ro, xb, nb); } }
    t = omp_get_wtime() - t; y = s;
    printf("%s: %.2f ns/block (sum %g)\n", (const char*[]){"f32 gguf ","f32 planar","bf16 gguf ","bf16 planar","bf16 gguf pair"}[mode], t/((double)reps*N*nb)*1e9, s);
  }
}
