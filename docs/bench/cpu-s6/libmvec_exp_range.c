/* glibc libmvec exp2f / expf: ns per element when one lane in 16 is outside the fast
 * range. gcc -O3 -march=native -mprefer-vector-width=512 -ffast-math -fopenmp
 * libmvec_exp_range.c -lm && ./a.out */
#include <math.h>
#include <stdio.h>
#include <time.h>
#define N 4096
float a[N], b[N];
static double now(){struct timespec t; clock_gettime(CLOCK_MONOTONIC,&t); return t.tv_sec+t.tv_nsec*1e-9;}
void run(float v, int which) {
  for (int i=0;i<N;i++) a[i] = (i%16==0) ? v : -1.f;
  double t0=now();
  for (int r=0;r<2000;r++) {
    if (which==0) {
#pragma omp simd
    for (int i=0;i<N;i++) b[i]=exp2f(a[i]);
    } else {
#pragma omp simd
    for (int i=0;i<N;i++) b[i]=expf(a[i]);
    }
    __asm__ volatile("" ::: "memory");
  }
  printf("%s(%g in 1 of 16 lanes): %.2f ns/elem\n", which?"expf":"exp2f", v, (now()-t0)/2000/N*1e9);
}
int main(){ float vs[]={-1,-60,-87,-100,-125,-127,-140,-1e30f, 60, 87, 89, 127, 129}; for(int w=0;w<2;w++) for(int i=0;i<13;i++) run(vs[i],w); }
