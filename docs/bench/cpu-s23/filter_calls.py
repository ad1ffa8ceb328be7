"""One sampling call, the C filter (`pdserve::filtered_race`) against the torch stages it
replaces (temperature, `_top_k_top_p`, the race), on random logits of the default model's
vocabulary at two spreads (scale 2.5: a nucleus of hundreds to thousands; 1.0: flat, tens of
thousands), 1 and 64 rows, median ms; and whether the C draws equal the definition's
(`_top_k_top_p_sorted`, the whole row sorted, and the race's torch formula).

    OMP_WAIT_POLICY=PASSIVE GOMP_SPINCOUNT=10000 python docs/bench/cpu-s23/filter_calls.py
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


def torch_stages(x, t, k, p, seeds, pos):
    y = x / t[:, None]
    if bool((k < V).any() or (p < 1).any()):
        y = ds._top_k_top_p(y, k, p)
    return exponential_race(y, seeds, pos)


for scale in (2.5, 1.0):
    for rows in (1, 64):
        x = torch.randn(rows, V, generator=torch.Generator().manual_seed(rows)) * scale
        seeds, pos = torch.arange(rows) + 3, torch.arange(rows)
        keys, greedy = row_keys(seeds, pos), torch.zeros(rows)
        for name, t, k, p in (("T1", 1.0, V, 1.0), ("T.7 p.9", 0.7, V, 0.9),
                              ("T1 p.95", 1.0, V, 0.95), ("k40", 0.8, 40, 1.0)):
            tt, kt, pt = torch.full((rows,), t), torch.full((rows,), k), torch.full((rows,), p)
            no_min_p = torch.zeros(rows)  # the op took min_p from session 24
            c = median_ms(30, filtered_race, x, tt, kt, pt, no_min_p, greedy, keys)
            o = median_ms(5 if rows == 64 else 20, torch_stages, x, tt, kt, pt, seeds, pos)
            same = torch.equal(filtered_race(x, tt, kt, pt, no_min_p, greedy, keys), race_from_keys(
                ds._top_k_top_p_sorted(x / tt[:, None], kt, pt), keys))
            print(f"scale {scale} rows {rows:2} {name:8}: C {c:7.3f} ms  torch {o:8.3f} ms  "
                  f"same as the definition: {same}")
