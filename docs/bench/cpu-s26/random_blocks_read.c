/* Read bandwidth of one core over 12 KB K and V blocks in shuffled order (paged decode
 * attention's pattern on SmolLM2: 16 tokens x 3 KV heads x 64 float32), one FMA a line.
 * gcc -O2 -march=native random_blocks_read.c -o rb && ./rb MODE [DIST]
 * MODE 0: no software prefetch; 1: each line's counterpart DIST blocks on (prefetcht1);
 * 2: all of block +DIST at once. -DBS=n: n tokens a block; env SEQ=1: blocks in order. */
#include <immintrin.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <stdint.h>
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
#ifndef BS
#define BS 16
#endif
#define BLK (BS*3*64*4) /* 12 KB */
int main(int argc,char**argv){
  size_t nblk=(size_t)(512<<20)/BLK/2; int mode=atoi(argv[1]); int dist=argc>2?atoi(argv[2]):1;
  char*K=aligned_alloc(4096,nblk*BLK),*V=aligned_alloc(4096,nblk*BLK);
  memset(K,1,nblk*BLK);memset(V,1,nblk*BLK);
  int*perm=malloc(nblk*sizeof(int));for(size_t i=0;i<nblk;i++)perm[i]=i;
  if(!getenv("SEQ"))for(size_t i=nblk-1;i>0;i--){size_t j=rand()%(i+1);int t=perm[i];perm[i]=perm[j];perm[j]=t;}
  __m512 acc[8];for(int i=0;i<8;i++)acc[i]=_mm512_setzero_ps();
  double best=1e9;
  for(int rep=0;rep<5;rep++){double t0=now();
    for(size_t b=0;b<nblk;b++){
      const char*k=K+(size_t)perm[b]*BLK,*v=V+(size_t)perm[b]*BLK;
      ptrdiff_t pk= b+dist<nblk? (K+(size_t)perm[b+dist]*BLK)-k:0;
      ptrdiff_t pv= b+dist<nblk? (V+(size_t)perm[b+dist]*BLK)-v:0;
      if(mode==2 && pk){for(int c=0;c<BLK;c+=64){__builtin_prefetch(k+pk+c,0,2);__builtin_prefetch(v+pv+c,0,2);}}
      /* address order: K then V, prefetch each line's counterpart */
      for(int c=0;c<BLK;c+=64){ if(mode==1&&pk)__builtin_prefetch(k+pk+c,0,2);
        acc[(c>>6)&7]=_mm512_fmadd_ps(_mm512_load_ps((const float*)(k+c)),acc[(c>>6)&7],acc[(c>>6)&7]);}
      for(int c=0;c<BLK;c+=64){ if(mode==1&&pv)__builtin_prefetch(v+pv+c,0,2);
        acc[(c>>6)&7]=_mm512_fmadd_ps(_mm512_load_ps((const float*)(v+c)),acc[(c>>6)&7],acc[(c>>6)&7]);}
    }
    double dt=now()-t0; if(dt<best)best=dt;}
  float s=0;for(int i=0;i<8;i++)s+=_mm512_reduce_add_ps(acc[i]);
  printf("mode %d dist %d: %.1f GB/s (%g)\n",mode,dist,2.0*nblk*BLK/best/1e9,s);
}
