"""The ops of a decoder layer, one op per file, each with its torch reference and the
factories of its fast paths (C on the CPU, Triton on CUDA):

    norm.py        RMSNorm and the fused residual-add + RMSNorm (the one RMSNorm reference)
    rotary.py      rotate-half RoPE, in place on the Q/K heads of the fused QKV rows
    activation.py  SiLU(gate) * up over the fused gate_up rows
    linear.py      x @ W.T (oneDNN on the CPU, where MKL re-packs the weight every call)
    attention.py   the attention-backend interface and the per-step metadata

`registry.py` chooses: `layer_ops(device)` returns the per-device `LayerOps` bundle the
model calls, `get_backend(name, device)` an attention backend. Both name their choices by
"module:attribute" strings, so a backend (C library, Triton) is imported only when chosen,
and no backend or kernel ever imports the registry or the model back.

Nothing is imported here: importing one layer file costs only torch.
"""
