#include <immintrin.h>
#include <stdio.h>
#include <stdlib.h>
#include <stdint.h>
#include <string.h>
#include <time.h>
#include <omp.h>
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
#define K 576
#define DEF(U) static float dotb_##U(const uint16_t*w,const uint16_t*x){ __m512 a[U]; for(int u=0;u<U;u++)a[u]=_mm512_setzero_ps(); int k=0; \
 for(;k+32*U<=K;k+=32*U) for(int u=0;u<U;u++) a[u]=_mm512_dpbf16_ps(a[u],(__m512bh)_mm512_loadu_si512(w+k+32*u),(__m512bh)_mm512_loadu_si512(x+k+32*u)); \
 for(;k<K;k+=32) a[0]=_mm512_dpbf16_ps(a[0],(__m512bh)_mm512_loadu_si512(w+k),(__m512bh)_mm512_loadu_si512(x+k)); \
 for(int u=1;u<U;u++)a[0]=_mm512_add_ps(a[0],a[u]); return _mm512_reduce_add_ps(a[0]);}
DEF(1) DEF(2) DEF(4)
#define DEFF(U) static float dotf_##U(const float*w,const float*x){ __m512 a[U]; for(int u=0;u<U;u++)a[u]=_mm512_setzero_ps(); int k=0; \
 for(;k+16*U<=K;k+=16*U) for(int u=0;u<U;u++) a[u]=_mm512_fmadd_ps(_mm512_loadu_ps(w+k+16*u),_mm512_loadu_ps(x+k+16*u),a[u]); \
 for(;k<K;k+=16) a[0]=_mm512_fmadd_ps(_mm512_loadu_ps(w+k),_mm512_loadu_ps(x+k),a[0]); \
 for(int u=1;u<U;u++)a[0]=_mm512_add_ps(a[0],a[u]); return _mm512_reduce_add_ps(a[0]);}
DEFF(1) DEFF(2) DEFF(4)
int main(){
  long NR = 135000000L / K; /* rows: a model's worth of weights */
  uint16_t *wb = aligned_alloc(64, NR*K*2); float *wf = aligned_alloc(64, NR*K*4);
  for(long i=0;i<NR*K;i++){ wb[i]=0x3f80; wf[i]=1.0f; }
  uint16_t xb[K] __attribute__((aligned(64))); float xf[K] __attribute__((aligned(64)));
  for(int i=0;i<K;i++){xb[i]=0x3f80; xf[i]=1.f;}
  float *y = malloc(NR*4);
  double best[6]={1e9,1e9,1e9,1e9,1e9,1e9}, sum[6]={0};
  int reps=12;
  for(int r=0;r<reps;r++) for(int v=0;v<6;v++){
    double t=now();
    #pragma omp parallel for schedule(static)
    for(long n=0;n<NR;n++){
      switch(v){case 0: y[n]=dotb_1(wb+n*K,xb);break; case 1: y[n]=dotb_2(wb+n*K,xb);break; case 2: y[n]=dotb_4(wb+n*K,xb);break;
      case 3: y[n]=dotf_1(wf+n*K,xf);break; case 4: y[n]=dotf_2(wf+n*K,xf);break; default: y[n]=dotf_4(wf+n*K,xf);}
    }
    t=now()-t; if(t<best[v])best[v]=t; sum[v]+=t;
  }
  const char*nm[6]={"bf16 U1","bf16 U2","bf16 U4","f32 U1","f32 U2","f32 U4"};
  for(int v=0;v<6;v++) printf("%s: best %.2f ms (%.1f GB/s) mean %.2f ms\n", nm[v], best[v]*1e3, NR*K*(v<3?2:4)/best[v]/1e9, sum[v]/reps*1e3);
  printf("%f\n", y[5]);
}
