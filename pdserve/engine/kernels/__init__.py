"""Triton kernels over the paged KV cache and the fused element-wise layer ops, one concern
per module. Nothing is imported here: a launcher is imported from its own module, and only
when chosen (pdserve.engine.layers.registry), so importing the package compiles nothing.

    common.py                  interpreter switch, argument checks, paged-offset helpers
    store_kv.py                K/V of new tokens -> cache slots (slot_mapping)
    paged_decode_attention.py  one query per sequence over its block table (+ split-K)
    prefill_attention.py       varlen chunks over their cached prefix, causal over themselves
    rms_norm.py                residual add + RMSNorm, fused (`add_rms_norm`)
    rotary.py                  RoPE in place on the Q/K heads of a qkv row (`rotary_embedding`)
    silu_mul.py                SiLU(gate) * up over a fused gate_up row (`silu_mul`)

References: the attention kernels' live in `pdserve.engine.attention.torch_backend`, the
element-wise ops' in their layer files (`pdserve.engine.layers.norm`, `.rotary`,
`.activation`); kernels import them from there, never from the model. tests/test_kernels.py
and tests/test_kernels_fused.py hold each kernel against its reference.
"""
