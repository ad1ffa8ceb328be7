#define _POSIX_C_SOURCE 200809L
/* Session 32: does the order in which a paged decode kernel reads (and prefetches) its KV
 * blocks change the bandwidth DRAM gives it? K and V arrays of 12 KiB blocks (16 tokens x
 * 3 KV heads x 64 float32, SmolLM2's rows), shuffled as a block table scatters them; two
 * threads; per line read, an add (and `extra` dependent FMAs of made-up work). Prints GB/s
 * of K+V read, the best of 7 passes.
 *
 *   gcc -O2 -march=native -fopenmp access_order.c -o access_order
 *   ./access_order MIB MODE ORDER EXTRA     (MIB 512: from DRAM; 8: from L3)
 *
 * MODE 0: no software prefetch; 1: each line read asks for the same line of the next
 * block; 2: the next block's lines asked for in address order, K's then V's, one per line
 * read.
 * ORDER 0: the kernel's before session 32: per head, K's 4-line part of every row, then V's;
 * 1: each block's K in address order, then its V; 2: as 0 with V in two halves (lines 0-1
 * of every row, then 2-3); 3: K four tokens at a time (per head within them), V in
 * address order; 4-6: K as 3, V in windows of 4/8/2 tokens, per head and half; 7-8: K as 3,
 * V in windows of 4/8 tokens, per head, each window's lines read three times (one per query
 * head); 9: K in address order, V as 7.
 *
 * What it showed (docs/benchmarks.md section 6, session 32), from DRAM at EXTRA 0: ORDER 0
 * 17.8-19.3 GB/s, 1 19.8-24.8, 3 22.6-23.7; with MODE 2 order 2 rose from 12.6 to 16.7
 * GB/s (EXTRA 8). The kernel itself then moved its prefetch to address order
 * (paged_decode.c, struct ahead). */
#include <time.h>
// The paged decode kernel's access pattern with synthetic compute: K and V arrays of blocks
// (16 tokens x 3 heads x 64 floats), shuffled; per block, per head: K sub-rows (4 lines at
// stride 12 lines), then V sub-rows; prefetch of the next block's same lines (mode 1) or not.
// order 0: head-wise strided (kernel); 1: whole K block then whole V block sequentially.
#include <immintrin.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <stdint.h>
#include <string.h>
static double now(void){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
#define CH 12288
static const char*seqk,*seqv; static int seqi;
#pragma omp threadprivate(seqk,seqv,seqi)
static inline __m256 work(const char*p,const char*q,int mode,int extra,__m256 a){
  if(q&&mode==1) _mm_prefetch(q,_MM_HINT_T1);
  if(mode==2&&seqk){ const char*t= seqi<192? seqk+seqi*64 : seqv+(seqi-192)*64; _mm_prefetch(t,_MM_HINT_T1); seqi++; }
  __m256 x0=_mm256_load_ps((const float*)p), x1=_mm256_load_ps((const float*)(p+32));
  a=_mm256_add_ps(a,_mm256_add_ps(x0,x1));
  for(int e=0;e<extra;e++){a=_mm256_fmadd_ps(x0,x1,a);}
  return a;
}
int main(int argc,char**argv){
  size_t total=(size_t)atol(argv[1])<<20; int mode=atoi(argv[2]); int order=atoi(argv[3]); int extra=atoi(argv[4]);
  size_t n=total/2/CH; char*K=aligned_alloc(4096,total/2),*V=aligned_alloc(4096,total/2); memset(K,1,total/2); memset(V,1,total/2);
  int32_t*perm=malloc(n*4); for(size_t i=0;i<n;i++)perm[i]=i; srand(1);
  for(size_t i=n-1;i>0;i--){size_t j=rand()%(i+1);int t=perm[i];perm[i]=perm[j];perm[j]=t;}
  float sink=0; double best=1e9;
  for(int r=0;r<7;r++){
    double t0=now();
    #pragma omp parallel num_threads(2) reduction(+:sink)
    {
      int id=omp_get_thread_num(), nt=omp_get_num_threads();
      size_t a=n*id/nt, b=n*(id+1)/nt;
      __m256 acc[8]; for(int i=0;i<8;i++)acc[i]=_mm256_setzero_ps();
      for(size_t i=a;i<b;i++){
        size_t off=(size_t)perm[i]*CH; ptrdiff_t pf= i+1<b ? (ptrdiff_t)((size_t)perm[i+1]*CH)-(ptrdiff_t)off : 0;
        const char*kb=K+off,*vb=V+off; if(pf){seqk=K+off+pf; seqv=V+off+pf;} else seqk=0; seqi=0;
        if(order==0){
          for(int h=0;h<3;h++){
            for(int t=0;t<16;t++) for(int l=0;l<4;l++){const char*p=kb+t*768+h*256+l*64; acc[l]=work(p,pf?p+pf:0,mode,extra,acc[l]);}
            for(int t=0;t<16;t++) for(int l=0;l<4;l++){const char*p=vb+t*768+h*256+l*64; acc[4+l]=work(p,pf?p+pf:0,mode,extra,acc[4+l]);}
          }
        } else if(order==2){
          for(int h=0;h<3;h++){
            for(int t=0;t<16;t++) for(int l=0;l<4;l++){const char*p=kb+t*768+h*256+l*64; acc[l]=work(p,pf?p+pf:0,mode,extra,acc[l]);}
            for(int c=0;c<2;c++) for(int t=0;t<16;t++) for(int l=0;l<2;l++){const char*p=vb+t*768+h*256+(2*c+l)*64; acc[4+l]=work(p,pf?p+pf:0,mode,extra,acc[4+l]);}
          }
        } else if(order==3){
          for(int t0=0;t0<16;t0+=4) for(int h=0;h<3;h++) for(int t=t0;t<t0+4;t++) for(int l=0;l<4;l++){const char*p=kb+t*768+h*256+l*64; acc[l]=work(p,pf?p+pf:0,mode,extra,acc[l]);}
          for(int t=0;t<16;t++) for(int h=0;h<3;h++) for(int l=0;l<4;l++){const char*p=vb+t*768+h*256+l*64; acc[4+l]=work(p,pf?p+pf:0,mode,extra,acc[4+l]);}
        } else if(order==9){
          for(int o=0;o<CH;o+=64){const char*p=kb+o; acc[(o>>6)&3]=work(p,pf?p+pf:0,mode,extra,acc[(o>>6)&3]);}
          for(int t0=0;t0<16;t0+=4) for(int h=0;h<3;h++) for(int g=0;g<3;g++) for(int t=t0;t<t0+4;t++) for(int l=0;l<4;l++){const char*p=vb+t*768+h*256+l*64; acc[4+l]=work(p,(pf&&!g)?p+pf:0,mode,g?0:extra,acc[4+l]);}
        } else if(order==7||order==8){
          for(int t0=0;t0<16;t0+=4) for(int h=0;h<3;h++) for(int t=t0;t<t0+4;t++) for(int l=0;l<4;l++){const char*p=kb+t*768+h*256+l*64; acc[l]=work(p,pf?p+pf:0,mode,extra,acc[l]);}
          int W=order==7?4:8;
          for(int t0=0;t0<16;t0+=W) for(int h=0;h<3;h++) for(int g=0;g<3;g++) for(int t=t0;t<t0+W;t++) for(int l=0;l<4;l++){const char*p=vb+t*768+h*256+l*64; acc[4+l]=work(p,(pf&&!g)?p+pf:0,mode,g?0:extra,acc[4+l]);}
        } else if(order>=4){
          int W=order==4?4:order==5?8:2;
          for(int t0=0;t0<16;t0+=4) for(int h=0;h<3;h++) for(int t=t0;t<t0+4;t++) for(int l=0;l<4;l++){const char*p=kb+t*768+h*256+l*64; acc[l]=work(p,pf?p+pf:0,mode,extra,acc[l]);}
          for(int t0=0;t0<16;t0+=W) for(int h=0;h<3;h++) for(int c=0;c<2;c++) for(int t=t0;t<t0+W;t++) for(int l=0;l<2;l++){const char*p=vb+t*768+h*256+(2*c+l)*64; acc[4+l]=work(p,pf?p+pf:0,mode,extra,acc[4+l]);}
        } else {
          for(int o=0;o<CH;o+=64){const char*p=kb+o; acc[(o>>6)&3]=work(p,pf?p+pf:0,mode,extra,acc[(o>>6)&3]);}
          for(int o=0;o<CH;o+=64){const char*p=vb+o; acc[4+((o>>6)&3)]=work(p,pf?p+pf:0,mode,extra,acc[4+((o>>6)&3)]);}
        }
      }
      __m256 s=acc[0]; for(int i=1;i<8;i++)s=_mm256_add_ps(s,acc[i]); float o[8]; _mm256_storeu_ps(o,s); sink+=o[0];
    }
    double t=now()-t0; if(t<best)best=t;
  }
  printf("mode %d order %d extra %d: %.1f GB/s\n",mode,order,extra,total/best/1e9);
}
