/* Session 16's AMX experiment: y = x @ W^T over 141 MB of packed bfloat16 weights (40
 * matrices 3072 x 576, streamed from memory) or over one 1.2 MB matrix kept in L2 (hot), on
 * two OpenMP threads, with the 2x2 tile blocking of pdserve's amx_linear.c and variants.
 *
 *   gcc -O2 -fopenmp -mamx-tile -mamx-bf16 -mavx512f -o amx_stream amx_stream.c
 *   ./amx_stream M VAR PFD HINT [GROUP [HOT [L1D [SPLIT]]]]
 *
 * M rows; VAR 0 = amx_linear's loop (column pairs outer, row pairs inner), 1 = the same with
 * stream loads for the weights, 2 = row pair outer within GROUP column pairs, 3 = as 2 with
 * x packed tile-contiguous; PFD = column pairs ahead the weights are prefetched (0: none);
 * HINT 0/1/2 = prefetcht0/t1/t2; HOT 1 = the hot case; L1D = k-steps ahead the next tiles
 * are prefetched into L1; SPLIT 1 = the prefetch spread over both row passes. Prints the
 * best of 6 passes (ms, GB/s of weights, TFLOP/s). Results: docs/benchmarks.md, session 16.
 */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <time.h>
struct cfg { uint8_t palette, start_row, reserved[14]; uint16_t colsb[16]; uint8_t rows[16]; };
static double now(void){struct timespec t; clock_gettime(CLOCK_MONOTONIC,&t); return t.tv_sec+t.tv_nsec*1e-9;}
static int L1D = 0; static int SPLIT = 0; static __thread int SPLITOFF = 0; static int VAR, PFD, HINT, GRP = 4; static char *XP;
static void conf(void){struct cfg c; memset(&c,0,sizeof c); c.palette=1; for(int t=0;t<8;t++){c.rows[t]=16;c.colsb[t]=64;} _tile_loadconfig(&c);}
#define PF(p) do { if (HINT==0) _mm_prefetch((const char*)(p), _MM_HINT_T0); else if (HINT==1) _mm_prefetch((const char*)(p), _MM_HINT_T1); else _mm_prefetch((const char*)(p), _MM_HINT_T2);} while(0)
static void blk(const char *a0, const char *a1, int64_t lda, const char *w0, const char *w1, const char *next, int64_t ks, int MB, float *out){
  _tile_zero(0);_tile_zero(1);_tile_zero(2);_tile_zero(3);
  for (int64_t kb=0; kb<ks; kb++){
    if (next && SPLIT) { for (int c=0;c<1024;c+=64) PF(next + kb*2048 + SPLITOFF + c); }
    else if (next) for (int c=0;c<2048;c+=64) PF(next + kb*2048 + c);
    if (L1D && kb + L1D < ks) {
      const int64_t k2 = kb + L1D;
      for (int r=0;r<16;r++) { _mm_prefetch(a0 + k2*64 + r*lda, _MM_HINT_T0); if (MB>1) _mm_prefetch(a1 + k2*64 + r*lda, _MM_HINT_T0); }
      for (int c=0;c<1024;c+=64) { _mm_prefetch(w0 + k2*1024 + c, _MM_HINT_T0); _mm_prefetch(w1 + k2*1024 + c, _MM_HINT_T0); }
    }
    if (VAR==1) { _tile_stream_loadd(6, w0+kb*1024, 64);} else _tile_loadd(6, w0+kb*1024, 64);
    _tile_loadd(4, a0+kb*64, lda); _tile_dpbf16ps(0,4,6);
    if (VAR==1) _tile_stream_loadd(7, w1+kb*1024, 64); else _tile_loadd(7, w1+kb*1024, 64);
    _tile_dpbf16ps(1,4,7);
    if (MB>1){ _tile_loadd(5, a1+kb*64, lda); _tile_dpbf16ps(2,5,6); _tile_dpbf16ps(3,5,7);}
  }
  _tile_stored(0,out,64);_tile_stored(1,out+256,64); if(MB>1){_tile_stored(2,out+512,64);_tile_stored(3,out+768,64);}
}
static void blk2(const char *a0, const char *a1, const char *w0, const char *w1, const char *next, int64_t ks, int MB, float *out){
  _tile_zero(0);_tile_zero(1);_tile_zero(2);_tile_zero(3);
  for (int64_t kb=0; kb<ks; kb++){
    if (next) for (int c=0;c<2048;c+=64) PF(next + kb*2048 + c);
    _tile_loadd(6, w0+kb*1024, 64);
    _tile_loadd(4, a0+kb*1024, 64); _tile_dpbf16ps(0,4,6);
    _tile_loadd(7, w1+kb*1024, 64);
    _tile_dpbf16ps(1,4,7);
    if (MB>1){ _tile_loadd(5, a1+kb*1024, 64); _tile_dpbf16ps(2,5,6); _tile_dpbf16ps(3,5,7);}
  }
  _tile_stored(0,out,64);_tile_stored(1,out+256,64); if(MB>1){_tile_stored(2,out+512,64);_tile_stored(3,out+768,64);}
}
int main(int argc, char **argv){
  int M = atoi(argv[1]); VAR = atoi(argv[2]); PFD = atoi(argv[3]); HINT = atoi(argv[4]);
  int64_t K = 576, N = 3072; int mats = 40; int hot = argc > 6 && atoi(argv[6]); if (hot) { N = 1024; } /* 40 x 3.5 MB = 141 MB */
  syscall(SYS_arch_prctl, 0x1023, 18);
  size_t wbytes = (size_t)N*K*2; int reps = hot ? 120 : mats; if (hot) mats = 1; char *W = aligned_alloc(4096, wbytes*mats); memset(W, 1, wbytes*mats);
  char *X = aligned_alloc(64, (size_t)64*K*2); memset(X, 0, 64*K*2); XP = aligned_alloc(64, (size_t)64*K*2); memset(XP, 0, 64*K*2); if (argc > 5) GRP = atoi(argv[5]); if (argc > 7) L1D = atoi(argv[7]); if (argc > 8) SPLIT = atoi(argv[8]);
  int64_t ks = K/32, pairbytes = ks*2048, npairs = N/32;
  double best = 1e9;
  for (int rep=0; rep<6; rep++){
    double t0=now();
#pragma omp parallel num_threads(2)
    {
      conf(); float out[1024] __attribute__((aligned(64)));
      int t = omp_get_thread_num();
      for (int mm=0;mm<reps;mm++){ int m = mm % mats;
        const char *Wm = W + m*wbytes;
        int64_t p0 = npairs*t/2, p1 = npairs*(t+1)/2;
        if (VAR < 2) {
        for (int64_t p=p0;p<p1;p++){
          const char *w0 = Wm + p*pairbytes, *w1 = w0 + ks*1024;
          const char *next = PFD ? (p+PFD<p1 ? Wm+(p+PFD)*pairbytes : (m+1<mats? W+(m+1)*wbytes + (p0 + (p+PFD-p1))*pairbytes : NULL)) : NULL;
          for (int m0=0;m0<M;m0+=32){
            int MB = M-m0>16 ? 2 : 1;
            SPLITOFF = m0 ? 1024 : 0;
            blk(X + m0*K*2, X + (m0+16)*K*2, K*2, w0, w1, (m0 && !SPLIT) ? NULL: next, ks, MB, out);
          }
        }
        } else {
          /* VAR 2: groups of G pairs; row pair outer within a group. VAR 3: same with A packed (tile-contiguous) */
          int G = GRP;
          const char *A = VAR == 3 ? XP : X; int64_t lda = VAR == 3 ? 64 : K*2; int64_t rowpair_stride = VAR == 3 ? 2*ks*1024 : 32*K*2; int64_t a1off = VAR == 3 ? ks*1024 : 16*K*2;
          for (int64_t g=p0; g<p1; g+=G){
            int64_t ge = g+G<p1? g+G : p1;
            for (int m0=0;m0<M;m0+=32){
              int MB = M-m0>16 ? 2 : 1;
              for (int64_t p=g;p<ge;p++){
                const char *w0 = Wm + p*pairbytes, *w1 = w0 + ks*1024;
                const char *next = (PFD && m0==0) ? (p+PFD*G<p1 ? Wm+(p+PFD*G)*pairbytes : NULL) : NULL;
                const char *a0 = A + (m0/32)*rowpair_stride;
                if (VAR == 3) blk2(a0, a0 + a1off, w0, w1, next, ks, MB, out);
                else blk(a0, a0 + a1off, lda, w0, w1, next, ks, MB, out);
              }
            }
          }
        }
      }
      _tile_release();
    }
    double dt = now()-t0; if (dt<best) best=dt;
  }
  printf("M=%d var=%d pfd=%d hint=%d: %.2f ms, %.1f GB/s, %.2f TFLOP/s\n", M, VAR, PFD, HINT, best*1e3, (double)wbytes*reps/best/1e9, 2.0*M*N*K*reps/best/1e12);
  return 0;
}
