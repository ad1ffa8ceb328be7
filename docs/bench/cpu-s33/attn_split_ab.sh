#!/bin/sh
# The paged decode kernel of two commits, alternated in one process (cpu-s31/attn_ab.c, with
# the thread count from NT): session 33's token ranges and longest-first claims (4fef2b6)
# against 6f349a1, SmolLM2's heads, float32 cache, from DRAM, two threads; three runs a case.
# From the repository root: sh docs/bench/cpu-s33/attn_split_ab.sh [OLD [NEW]]
set -e
old=${1:-6f349a1} new=${2:-HEAD}
d=$(mktemp -d)
K=pdserve/engine/cpu_kernels
F="-O3 -march=native -mprefer-vector-width=512 -ffast-math -fopenmp -std=c11 -I$K"
# every exported symbol renamed per build, so both link into one program
S="pd_validate pd_decode_team_redo pd_decode_team_merge pd_decode_team pd_max_items"
S="$S pd_partials_floats pd_splits pd_range_tokens pd_decode"
for v in a b; do
    c=$old; [ $v = b ] && c=$new
    git show "$c:$K/paged_decode.c" > "$d/$v.c"
    R=""; for s in $S; do R="$R -D$s=${s}_$v"; done
    gcc $F $R -c "$d/$v.c" -o "$d/$v.o"
done
sed 's/0.125f, 0, 0, 2);/0.125f, 0, 0, getenv("NT") ? atoi(getenv("NT")) : 2);/' \
    docs/bench/cpu-s31/attn_ab.c > "$d/ab.c"
gcc $F "$d/ab.c" "$d/a.o" "$d/b.o" -lm -o "$d/ab"
echo "b = $new, a = $old: b/a mean per layer call, three runs"
for c in "1 400" "1 1000" "1 4000" "2 300" "2 1000" "2 2000" "3 1000" "3 2000" "4 500" \
         "5 600" "8 300" "16 256" "32 1000"; do
    printf '%s:' "$c"
    for r in 1 2 3; do "$d/ab" $c 15 | tail -1 | awk '{printf " %s", $NF}'; done
    echo
done
rm -rf "$d"
