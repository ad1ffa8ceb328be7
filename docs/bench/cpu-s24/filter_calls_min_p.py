"""Min-p rows in one sampling call, the C filter (`pdserve::filtered_race`) against the torch
stages it replaces (temperature, `_top_k_top_p` where top-p is on, min-p, the race), on
random logits of the default model's vocabulary at two spreads (scale 2.5: a nucleus of
hundreds to thousands; 1.0: flat, tens of thousands), 1 and 64 rows, median ms. Min-p in
torch both as `min_p_filter` (y - max < log(min_p), what sample_on_device runs now) and as
the softmax formula it replaced; and whether the C draws equal the definition's
(`_top_k_top_p_sorted`, `min_p_filter` and the race's torch formula).

    OMP_WAIT_POLICY=PASSIVE GOMP_SPINCOUNT=10000 python docs/bench/cpu-s24/filter_calls_min_p.py
"""

import time

import torch

import pdserve.engine.device_sampler as ds
from pdserve.engine.cpu_kernels.sampling_filter import filtered_race
from pdserve.engine.sampling_noise import exponential_race, race_from_keys, row_keys

torch.set_num_threads(2)
V = 49152


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


def torch_stages(x, t, k, p, min_p, thr, seeds, pos, min_p_stage):
    y = x / t[:, None]
    if bool((k < V).any() or (p < 1).any()):
        y = ds._top_k_top_p(y, k, p)
    y = min_p_stage(y, min_p, thr)
    return exponential_race(y, seeds, pos)


def exact_min_p(y, min_p, thr):
    return ds.min_p_filter(y, thr)


for scale in (2.5, 1.0):
    for rows in (1, 64):
        x = torch.randn(rows, V, generator=torch.Generator().manual_seed(rows)) * scale
        seeds, pos = torch.arange(rows) + 3, torch.arange(rows)
        keys, greedy = row_keys(seeds, pos), torch.zeros(rows)
        for name, t, k, p, m in (("T1 min_p.05", 1.0, V, 1.0, 0.05),
                                 ("T1 p.9 min_p.1", 1.0, V, 0.9, 0.1)):
            tt, kt, pt = torch.full((rows,), t), torch.full((rows,), k), torch.full((rows,), p)
            mt = torch.full((rows,), m)
            thr = torch.full((rows,), ds.min_p_threshold(m))
            c = median_ms(30, filtered_race, x, tt, kt, pt, mt, greedy, keys)
            reps = 5 if rows == 64 else 20
            o = median_ms(reps, torch_stages, x, tt, kt, pt, mt, thr, seeds, pos, exact_min_p)
            s = median_ms(reps, torch_stages, x, tt, kt, pt, mt, thr, seeds, pos,
                          softmax_min_p)
            got = filtered_race(x, tt, kt, pt, mt, greedy, keys)
            same = torch.equal(got, race_from_keys(ds.min_p_filter(
                ds._top_k_top_p_sorted(x / tt[:, None], kt, pt), thr), keys))
            kept = int((~ds.min_p_filter(ds._top_k_top_p_sorted(x / tt[:, None], kt, pt),
                                         thr).isinf()).sum(-1).float().median())
            print(f"scale {scale} rows {rows:2} {name:15}: C {c:7.3f} ms  torch {o:8.3f} ms "
                  f"(softmax min-p {s:8.3f} ms)  kept/row {kept:5}  "
                  f"same as the definition: {same}")
