"""One sampling call, the C filter (`pdserve::filtered_race`) against the torch stages it
replaces (temperature, `_top_k_top_p` where top-k or top-p is on, min-p, the race), on random
logits of the default model's vocabulary at two spreads (scale 2.5: a nucleus of hundreds to
thousands; 1.0: flat, tens of thousands), 1 and 64 rows, median ms; and whether the C draws
equal the definition's (`_top_k_top_p_sorted`, the whole row sorted, `min_p_filter` and the
race's torch formula). For min-p rows also the softmax formula min-p had in torch before
session 24 (probs < min_p * max(probs)).

    SET=s23|min_p|all OMP_WAIT_POLICY=PASSIVE GOMP_SPINCOUNT=10000 \\
        python docs/bench/cpu-s24/filter_calls.py

SET=s23 runs session 23's settings (docs/bench/cpu-s23/filter_calls.txt, then through a
version of this script without min-p), SET=min_p session 24's (filter_calls_min_p.txt).
"""

import os
import time

import torch

import pdserve.engine.device_sampler as ds
from pdserve.engine.cpu_kernels.sampling_filter import filtered_race
from pdserve.engine.sampling_noise import exponential_race, race_from_keys, row_keys

torch.set_num_threads(2)
V = 49152
# name: temperature, top_k, top_p, min_p
SETTINGS = {
    "s23": {"T1": (1.0, V, 1.0, 0.0), "T.7 p.9": (0.7, V, 0.9, 0.0),
            "T1 p.95": (1.0, V, 0.95, 0.0), "k40": (0.8, 40, 1.0, 0.0)},
    "min_p": {"T1 min_p.05": (1.0, V, 1.0, 0.05), "T1 p.9 min_p.1": (1.0, V, 0.9, 0.1)},
}
SET = os.environ.get("SET", "all")
CHOSEN = {k: v for s, group in SETTINGS.items() if SET in (s, "all") for k, v in group.items()}


def median_ms(n, fn, *args):
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn(*args)
        ts.append(time.perf_counter() - t0)
    return sorted(ts)[n // 2] * 1e3


def softmax_min_p(y, min_p, thr):
    probs = y.softmax(-1)
    return y.masked_fill(probs < min_p[:, None] * probs.amax(-1, keepdim=True), float("-inf"))


def exact_min_p(y, min_p, thr):
    return ds.min_p_filter(y, thr)


def torch_stages(x, t, k, p, min_p, thr, seeds, pos, min_p_stage):
    y = x / t[:, None]
    if bool((k < V).any() or (p < 1).any()):
        y = ds._top_k_top_p(y, k, p)
    if bool((min_p > 0).any()):
        y = min_p_stage(y, min_p, thr)
    return exponential_race(y, seeds, pos)


for scale in (2.5, 1.0):
    for rows in (1, 64):
        x = torch.randn(rows, V, generator=torch.Generator().manual_seed(rows)) * scale
        seeds, pos = torch.arange(rows) + 3, torch.arange(rows)
        keys, greedy = row_keys(seeds, pos), torch.zeros(rows)
        for name, (t, k, p, m) in CHOSEN.items():
            tt, kt, pt = torch.full((rows,), t), torch.full((rows,), k), torch.full((rows,), p)
            mt = torch.full((rows,), m)
            thr = torch.full((rows,), ds.min_p_threshold(m))
            c = median_ms(30, filtered_race, x, tt, kt, pt, mt, greedy, keys)
            reps = 5 if rows == 64 else 20
            o = median_ms(reps, torch_stages, x, tt, kt, pt, mt, thr, seeds, pos, exact_min_p)
            line = f"scale {scale} rows {rows:2} {name:15}: C {c:7.3f} ms  torch {o:8.3f} ms "
            if m > 0:
                s = median_ms(reps, torch_stages, x, tt, kt, pt, mt, thr, seeds, pos,
                              softmax_min_p)
                line += f"(softmax min-p {s:8.3f} ms) "
            want = ds.min_p_filter(ds._top_k_top_p_sorted(x / tt[:, None], kt, pt), thr)
            same = torch.equal(filtered_race(x, tt, kt, pt, mt, greedy, keys),
                               race_from_keys(want, keys))
            kept = int((~want.isinf()).sum(-1).float().median())
            print(f"{line} kept/row {kept:5}  same as the definition: {same}", flush=True)
