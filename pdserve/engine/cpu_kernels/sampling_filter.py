"""The Python side of sampling_filter.c: the typed op `pdserve::filtered_race`, sampled rows
drawn on the CPU through temperature, top-k, top-p and min-p in one call (device_sampler's
torch path, `_top_k_top_p_sorted`, `min_p_filter` and the race, is its reference in the
tests).

The op checks every tensor's device, dtype, shape and layout before the ctypes call and
allocates the output and the kernel's scratch itself; the kernel refuses a sampled row's
out-of-range parameters (ValueError here)."""

from __future__ import annotations

import torch

from pdserve.engine.cpu_kernels.library import load, register_fake, require, typed_op


def _check(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
           top_p: torch.Tensor, min_p: torch.Tensor, greedy: torch.Tensor, keys: torch.Tensor
           ) -> None:
    require(logits=logits, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
            greedy=greedy, keys=keys)
    if (logits.device.type != "cpu" or logits.dtype != torch.float32 or logits.dim() != 2
            or not logits.is_contiguous() or (logits.shape[0] and not logits.shape[1])):
        raise ValueError(f"logits must be a contiguous float32 CPU [B, V] with V >= 1, got "
                         f"{logits.dtype} {tuple(logits.shape)} on {logits.device}")
    rows = logits.shape[0]
    for name, t, dtype in (("temperature", temperature, torch.float32),
                           ("top_k", top_k, torch.int64), ("top_p", top_p, torch.float32),
                           ("min_p", min_p, torch.float32), ("greedy", greedy, torch.float32),
                           ("keys", keys, torch.int64)):
        if (t.device.type != "cpu" or t.dtype != dtype or tuple(t.shape) != (rows,)
                or not t.is_contiguous()):
            raise ValueError(f"{name} must be a contiguous {dtype} CPU [{rows}], got "
                             f"{t.dtype} {tuple(t.shape)} on {t.device}")


@typed_op("filtered_race")
def filtered_race(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                  top_p: torch.Tensor, min_p: torch.Tensor, greedy: torch.Tensor,
                  keys: torch.Tensor) -> torch.Tensor:
    """[B, V] float32 logits and per-row parameters -> [B] int64 tokens: for each row whose
    greedy flag is 0, the exponential race (keys: `sampling_noise.row_keys`) over the row /
    temperature after its top-k (V: off; ties at the k-th value kept), its top-p (1: off)
    and its min-p (0: off; device_sampler.min_p_filter's rule). Greedy rows' entries are 0:
    the caller takes their argmax."""
    _check(logits, temperature, top_k, top_p, min_p, greedy, keys)
    rows, vocab = logits.shape
    out = torch.zeros(rows, dtype=torch.int64)
    if rows:
        lib, threads = load(), torch.get_num_threads()
        work = torch.empty(threads * lib.sf_work_per_thread(vocab), dtype=torch.uint8)
        rc = lib.sf_filtered_race(logits.data_ptr(), rows, vocab, temperature.data_ptr(),
                                  top_k.data_ptr(), top_p.data_ptr(), min_p.data_ptr(),
                                  greedy.data_ptr(), keys.data_ptr(), out.data_ptr(),
                                  work.data_ptr(), threads)
        if rc:
            raise ValueError(f"a sampled row's parameters are out of range: top_k must be in "
                             f"[1, {vocab}], temperature > 0, top_p in (0, 1], min_p in "
                             f"[0, 1], keys in [0, 2**32)")
    return out


@register_fake("filtered_race")
def _(logits, temperature, top_k, top_p, min_p, greedy, keys):
    _check(logits, temperature, top_k, top_p, min_p, greedy, keys)
    return logits.new_empty(logits.shape[0], dtype=torch.int64)
