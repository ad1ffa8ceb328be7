#!/bin/bash
# Session 31's look at the float32 paged decode kernel on AVX2 (docs/benchmarks.md, session
# 31): pd_decode as of BASE (default 3c7c506, before session 31's change) against one-line
# variants of it, alternated in one process by attn_ab.c. Run from the repository root;
# writes to stdout.
set -e
d=/tmp/attn_ab; mkdir -p $d; K=pdserve/engine/cpu_kernels
F="-O3 -march=native -mprefer-vector-width=512 -ffast-math -fopenmp -std=c11 -I$K"
R="-Dpd_validate=pd_validate_X -Dpd_decode_team_redo=pd_decode_team_redo_X -Dpd_decode_team=pd_decode_team_X"
git show ${BASE:-3c7c506}:$K/paged_decode.c > $d/base.c
gcc $F ${R//X/a} -Dpd_decode=pd_decode_a -c $d/base.c -o $d/a.o
variant() {  # name, python expression turning source s into the variant
    python3 -c "s = open('$d/base.c').read(); t = $2; assert t != s; open('$d/$1.c', 'w').write(t)"
    gcc $F ${R//X/b} -Dpd_decode=pd_decode_b -c $d/$1.c -o $d/b.o
    gcc $F docs/bench/cpu-s31/attn_ab.c $d/a.o $d/b.o -lm -o $d/ab_$1
}
gcc $F ${R//X/b} -Dpd_decode=pd_decode_b -c $d/base.c -o $d/b.o
gcc $F docs/bench/cpu-s31/attn_ab.c $d/a.o $d/b.o -lm -o $d/ab_same
variant nopf "s.replace('const ptrdiff_t pf =\n', 'const ptrdiff_t pf = 0 &&\n')"
variant pf2 "s.replace('start + bs < len\n', 'start + 2 * bs < len\n').replace('table[start / bs + 1]', 'table[start / bs + 2]')"
variant noscore "s.replace('score_tile_avx2(qh, krows, nt, G, NV, dt, s, pf);', '')"
variant nosoftmax "s.replace('softmax_tile(s, nt, G, first, mh, lh, ch);\n                    accum_tile_avx2', 'accum_tile_avx2')"
variant noaccum "s.replace('accum_tile_avx2(ah, ch, vrows, nt, G, NV, dt, s, pf);', '')"
echo "## main against itself: from DRAM (blocks shuffled, then in order), then in L3 (LAYERS=1)"
$d/ab_same 32 1000 8; SEQ=1 $d/ab_same 32 1000 8; LAYERS=1 $d/ab_same 8 300 3000
for v in nopf pf2 noscore nosoftmax noaccum; do
    echo "## b = $v"
    $d/ab_$v 32 1000 8; $d/ab_$v 16 400 8; LAYERS=1 $d/ab_$v 8 300 3000
done
