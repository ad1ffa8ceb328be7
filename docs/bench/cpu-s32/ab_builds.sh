#!/bin/bash
# Session 32's kernel changes, each against the commit before it, alternated in one process
# by the earlier sessions' harnesses (docs/benchmarks.md section 6, session 32). Run from the
# repository root; prints to stdout (ab_builds.txt: one run).
set -e
K=pdserve/engine/cpu_kernels
F="-O3 -march=native -mprefer-vector-width=512 -ffast-math -fopenmp -std=c11 -I$K"
d=/tmp/ab_builds; mkdir -p $d

# 1. paged decode: the next block in address order (a462350) and whole-row items below
#    four sequences a thread (9ec1173), against 30d0a76 (session 31's last)
R="-Dpd_validate=pd_validate_X -Dpd_decode_team_redo=pd_decode_team_redo_X -Dpd_decode_team=pd_decode_team_X"
git show 30d0a76:$K/paged_decode.c > $d/pd_old.c
git show 9ec1173:$K/paged_decode.c > $d/pd_new.c
gcc $F ${R//X/a} -Dpd_decode=pd_decode_a -c $d/pd_old.c -o $d/pd_a.o
gcc $F ${R//X/b} -Dpd_decode=pd_decode_b -c $d/pd_new.c -o $d/pd_b.o
gcc $F docs/bench/cpu-s31/attn_ab.c $d/pd_a.o $d/pd_b.o -lm -o $d/attn
echo "## paged decode, 9ec1173 (b) against 30d0a76 (a)"
$d/attn 32 1000 6; $d/attn 16 256 8; LAYERS=30 $d/attn 8 256 10; LAYERS=30 $d/attn 5 256 10
LAYERS=30 $d/attn 3 256 10; LAYERS=30 $d/attn 1 1000 10; HQ=8 HKV=1 $d/attn 32 1000 4
HQ=32 HKV=8 $d/attn 16 500 4; LAYERS=1 $d/attn 8 300 2000

# 2. GGUF blocks: two chains a row at 3-4 rows (e401b23) against the commit before
R="-Dblocks_rows=blocks_rows_X -Dblocks_fast=blocks_fast_X -Dblocks_dequant=blocks_dequant_X -Dblocks_row_bytes=blocks_row_bytes_X"
git show e401b23~1:$K/q4_blocks.c > $d/bl_old.c
git show e401b23:$K/q4_blocks.c > $d/bl_new.c
gcc $F ${R//X/a} -Dblocks_linear=blocks_linear_a -c $d/bl_old.c -o $d/bl_a.o
gcc $F ${R//X/b} -Dblocks_linear=blocks_linear_b -c $d/bl_new.c -o $d/bl_b.o
gcc $F docs/bench/cpu-s31/blocks_ab.c $d/bl_a.o $d/bl_b.o -lm -o $d/blocks
echo "## GGUF blocks, e401b23 (b) against e401b23~1 (a)"
$d/blocks 8

# 3. float32 panels: the streaming pass asks for the next panel too (1ed27a7)
F2="-O3 -march=native -ffast-math -fopenmp -std=c11 -I$K"
git show 1ed27a7~1:$K/f32_panels.c > $d/fp_old.c
gcc $F2 -Dfp_blocks=fp_blocks_old -Dfp_linear=fp_linear_old -Dfp_pack=fp_pack_old \
    -Dfp_available=fp_available_old -c $d/fp_old.c -o $d/fp_old.o
git show 1ed27a7:$K/f32_panels.c > $d/fp_new.c
gcc $F2 -c $d/fp_new.c -o $d/fp_new.o
gcc $F2 docs/bench/cpu-s30/panels_ab.c $d/fp_old.o $d/fp_new.o -o $d/panels
echo "## float32 panels, 1ed27a7 (new) against 1ed27a7~1 (old)"
$d/panels
