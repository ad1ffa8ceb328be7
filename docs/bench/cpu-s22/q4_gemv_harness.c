#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <omp.h>
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
/* q4_1 block: f16 d, f16 m, 16 bytes of nibbles */
static inline float h2f(uint16_t h){ return _cvtsh_ss(h); }
static float dot_q41(const uint8_t *w, const float *x, int64_t K, int bf16) {
  __m512 a0=_mm512_setzero_ps(), a1=_mm512_setzero_ps();
  const __m128i mask=_mm_set1_epi8(0x0f);
  for (int64_t b=0;b<K/32;b++){
    const uint8_t *p=w+b*20; uint16_t dh,mh; memcpy(&dh,p,2); memcpy(&mh,p+2,2);
    __m512 d=_mm512_set1_ps(h2f(dh)), m=_mm512_set1_ps(h2f(mh));
    __m128i qs=_mm_loadu_si128((const __m128i*)(p+4));
    __m128i lo=_mm_and_si128(qs,mask), hi=_mm_and_si128(_mm_srli_epi16(qs,4),mask);
    __m512 w0=_mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(lo)),d,m);
    __m512 w1=_mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(hi)),d,m);
    if (bf16){ w0=_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(w0)),16));
               w1=_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(w1)),16)); }
    a0=_mm512_fmadd_ps(w0,_mm512_loadu_ps(x+b*32),a0);
    a1=_mm512_fmadd_ps(w1,_mm512_loadu_ps(x+b*32+16),a1);
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(a0,a1));
}

static float dot_q41t(const uint8_t *w, const float *x, int64_t K, int bf16) {
  __m512 a0=_mm512_setzero_ps(), a1=_mm512_setzero_ps();
  const __m512 iota=_mm512_setr_ps(0,1,2,3,4,5,6,7,8,9,10,11,12,13,14,15);
  const __m512i spread=_mm512_set_epi8(
     0,0,0,15, 0,0,0,14, 0,0,0,13, 0,0,0,12, 0,0,0,11, 0,0,0,10, 0,0,0,9, 0,0,0,8,
     0,0,0,7, 0,0,0,6, 0,0,0,5, 0,0,0,4, 0,0,0,3, 0,0,0,2, 0,0,0,1, 0,0,0,0);
  for (int64_t b=0;b<K/32;b++){
    const uint8_t *p=w+b*20;
    __m128 dm=_mm_cvtph_ps(_mm_cvtsi32_si128(*(const int*)p));
    __m512 d=_mm512_broadcastss_ps(dm), m=_mm512_broadcastss_ps(_mm_movehdup_ps(dm));
    __m512 table=_mm512_fmadd_ps(iota,d,m);
    if (bf16) table=_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(table)),16));
    __m512i v=_mm512_permutexvar_epi8(spread,_mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i*)(p+4))));
    __m512 w0=_mm512_permutexvar_ps(v,table);
    __m512 w1=_mm512_permutexvar_ps(_mm512_srli_epi32(v,4),table);
    a0=_mm512_fmadd_ps(w0,_mm512_loadu_ps(x+b*32),a0);
    a1=_mm512_fmadd_ps(w1,_mm512_loadu_ps(x+b*32+16),a1);
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(a0,a1));
}
static float dot_f32(const float *w, const float *x, int64_t K){
  __m512 a0=_mm512_setzero_ps(),a1=_mm512_setzero_ps();
  for(int64_t k=0;k<K;k+=32){a0=_mm512_fmadd_ps(_mm512_loadu_ps(w+k),_mm512_loadu_ps(x+k),a0);a1=_mm512_fmadd_ps(_mm512_loadu_ps(w+k+16),_mm512_loadu_ps(x+k+16),a1);}
  return _mm512_reduce_add_ps(_mm512_add_ps(a0,a1));
}
int main(){
  /* one model's layers: 30 x (qkv 960x576, o 576x576, gate_up 3072x576, down 576x1536) */
  int64_t shapes[4][2]={{960,576},{576,576},{3072,576},{576,1536}};
  int L=30; size_t nq=0,nf=0;
  for(int s=0;s<4;s++){nq+=shapes[s][0]*shapes[s][1]/32*20; nf+=shapes[s][0]*shapes[s][1];}
  uint8_t *Q=aligned_alloc(64,nq*L); float *F=aligned_alloc(64,nf*L*4);
  for(size_t i=0;i<nq*L;i++) Q[i]=rand(); for(size_t i=0;i<nq*L/20;i++){uint16_t h=0x2000+(rand()&0x3ff); memcpy(Q+i*20,&h,2); memcpy(Q+i*20+2,&h,2);}
  for(size_t i=0;i<nf*L;i++) F[i]=rand()/(float)RAND_MAX;
  float *x=aligned_alloc(64,1536*4), *y=aligned_alloc(64,3072*4); for(int i=0;i<1536;i++)x[i]=1e-3f*i;
  { float a=dot_q41(Q,x,576,0), b=dot_q41t(Q,x,576,0), c=dot_q41(Q,x,576,1), e=dot_q41t(Q,x,576,1); printf("check %g %g | %g %g\n",a,b,c,e);} 
  for(int mode=0;mode<5;mode++){
    double best=1e9;
    for(int rep=0;rep<15;rep++){
      double t0=now();
      size_t oq=0,of=0;
      for(int l=0;l<L;l++) for(int s=0;s<4;s++){
        int64_t N=shapes[s][0],K=shapes[s][1];
        #pragma omp parallel for schedule(static)
        for(int64_t n=0;n<N;n++) y[n]= mode==0? dot_f32(F+of+n*K,x,K) : mode<3 ? dot_q41(Q+oq+n*K/32*20,x,K,mode==2) : dot_q41t(Q+oq+n*K/32*20,x,K,mode==4);
        oq+=N*K/32*20; of+=N*K;
      }
      double dt=now()-t0; if(dt<best)best=dt;
    }
    printf("%s: %.2f ms per token's layers (%.1f GB/s)\n", mode==0?"f32":mode==1?"q4_1->f32":mode==2?"q4_1->bf16":mode==3?"table f32":"table bf16", best*1e3, (mode==0?nf*L*4.0:nq*L*1.0)/best/1e9);
  }
}
