"""The fused elementwise kernels (engine/kernels/rms_norm.py, rotary.py, silu_mul.py)
against their references in pdserve.engine.layers (norm, rotary, activation), and the
`triton` layer-op bundle the model gets on CUDA against the `torch` one, under the Triton
interpreter on a CPU (scripts/gpu_check.py also runs this file compiled on a GPU).

Tolerances, by dtype. The norm kernel reproduces the eager ops' rounding to the model dtype
step by step; RoPE and SiLU*mul compute in float32 and round once. What is left:
- float32: summation order and rsqrt of the norm's statistics (~1e-7 relative); RoPE is
  exact under the interpreter (numpy rounds each fp32 op, as eager does), and within an ulp
  on a GPU, where ptxas may contract x*cos + y*sin into one FMA.
- 16-bit RoPE and SiLU*mul: the eager reference rounds each product and then the sum (the
  silu, then the product); the kernels round once. The two cannot be bit-equal (an H200
  showed it: max error 0.0156-0.031, one bf16 ulp at |x| in 2..8), so the check is a bound
  of two ulps of the terms' magnitude (_assert_rope_close), not torch.equal.
- float16 norm: one ulp off where its float32 rstd differs in the last bit.
- bfloat16 under the interpreter: its float32 -> bfloat16 cast truncates instead of
  rounding to nearest even, so each rounding step can be one bf16 ulp (2**-7 relative) away
  from torch's. The norm has three such steps (sum, normalised row, weight product), so the
  bounds below are a few ulps, not a guess.
"""


import pytest
import torch

from pdserve.engine.kernels.common import interpreted
from pdserve.engine.kernels.rms_norm import (
    MAX_HIDDEN,
    add_rms_norm,
    add_rms_norm_reference,
    rows_per_program,
)
from pdserve.engine.kernels.rotary import rope_reference, rotary_embedding, rotary_reference
from pdserve.engine.kernels.silu_mul import silu_mul
from pdserve.engine.layers.activation import silu_mul as silu_mul_reference
from pdserve.engine.layers.registry import build_layer_ops

pytestmark = pytest.mark.skipif(not interpreted() and not torch.cuda.is_available(),
                                reason="kernels were compiled for a GPU and there is none")

DEV = "cuda" if not interpreted() else "cpu"
F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
BF16_ULP = 2.0 ** -7  # bf16 keeps 8 significant bits: one ulp is at most 2**-7 of a value
ULP = {F16: 2.0 ** -10, BF16: BF16_ULP}
# Relative: every error source above is relative to the element (or its row's scale).
NORM_TOL = {
    F32: {"atol": 1e-5, "rtol": 1e-5},
    F16: {"atol": 1e-3, "rtol": 2 * 2.0 ** -10},  # one fp16 ulp, and one more after * w
    BF16: ({"atol": 1e-3, "rtol": 4 * BF16_ULP} if interpreted()  # three truncations
           else {"atol": 1e-3, "rtol": 2 * BF16_ULP}),
}


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _rows(t, h, dtype, gen, pad=0):
    """[t, h] values, as a view of a [t, h + pad] buffer when pad > 0 (row stride h + pad)."""
    buf = torch.randn(t, h + pad, generator=gen).to(dtype).to(DEV)
    return buf[:, :h] if pad else buf


# ---------------------------------------------------------------- RMSNorm


@pytest.mark.parametrize("residual", [True, False])
@pytest.mark.parametrize("dtype", [F32, BF16, F16])
@pytest.mark.parametrize("t", [1, 7, 64])
@pytest.mark.parametrize("hidden", [64, 576, 1000])
def test_add_rms_norm_matches_llama(hidden, t, dtype, residual):
    gen = _gen(hidden * 100 + t)
    # x strided (a slice of a wider buffer); the residual stream dense, as llama.py keeps it
    x = _rows(t, hidden, dtype, gen, pad=8)
    res = _rows(t, hidden, dtype, gen) if residual else None
    weight = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(dtype).to(DEV)
    ref_out, ref_res = add_rms_norm_reference(x, weight, 1e-5, res)
    x_before = x.clone()
    out = add_rms_norm(x=x, weight=weight, eps=1e-5, residual=res)
    assert out.dtype == dtype and out.shape == (t, hidden) and out.is_contiguous()
    torch.testing.assert_close(out, ref_out, **NORM_TOL[dtype])
    assert torch.equal(x, x_before)  # x is only read
    if residual:
        # A rounded add: exact, except the interpreter's bf16 truncation (one ulp).
        tol = {"atol": 0, "rtol": BF16_ULP} if dtype == BF16 and interpreted() \
            else {"atol": 0, "rtol": 0}
        torch.testing.assert_close(res, ref_res, **tol)


@pytest.mark.parametrize("hidden,t,rows", [(64, 7, 4), (64, 64, 16), (576, 64, 4),
                                           (1000, 7, 2)])
@pytest.mark.parametrize("dtype", [F32, BF16])
def test_add_rms_norm_several_rows_per_program(hidden, t, rows, dtype):
    # The heuristic packs rows only for long batches; forced here, with a partial last group.
    gen = _gen(7)
    x = _rows(t, hidden, dtype, gen, pad=3)
    res = _rows(t, hidden, dtype, gen, pad=5)  # a strided residual works too
    weight = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(dtype).to(DEV)
    ref_out, ref_res = add_rms_norm_reference(x, weight, 1e-6, res)
    out = add_rms_norm(x=x, weight=weight, eps=1e-6, residual=res, rows=rows)
    torch.testing.assert_close(out, ref_out, **NORM_TOL[dtype])
    torch.testing.assert_close(res, ref_res, atol=0, rtol=BF16_ULP if dtype == BF16 else 0)


@pytest.mark.parametrize("num_rows,hidden,rows", [
    (4096, 576, 4),  # SmolLM2 prefill: 1024-wide rows, four per program, 1024 programs
    (64, 576, 1),  # a decode batch: packing would leave the GPU idle
    (4096, 4096, 1),  # a full row is already 4096 elements
    (100_000, 64, 64),
    (1, 8192, 1),
])
def test_rows_per_program(num_rows, hidden, rows):
    assert rows_per_program(num_rows, hidden) == rows


def test_add_rms_norm_empty_batch():
    x = torch.zeros(0, 64, device=DEV)
    out = add_rms_norm(x=x, weight=torch.ones(64, device=DEV), eps=1e-5, residual=x.clone())
    assert out.shape == (0, 64)


def _norm_args():
    gen = _gen(11)
    return {"x": _rows(3, 64, F32, gen), "weight": torch.ones(64, device=DEV), "eps": 1e-5,
            "residual": _rows(3, 64, F32, gen)}


@pytest.mark.parametrize("change,match", [
    (lambda a: a.update(x=a["x"].int()), "x dtype"),
    (lambda a: a.update(x=a["x"].double()), "x dtype"),
    (lambda a: a.update(x=a["x"][None]), r"x must be a \[T, H\]"),
    (lambda a: a.update(x=torch.zeros(1, MAX_HIDDEN + 1, device=DEV), residual=None,
                        weight=torch.ones(MAX_HIDDEN + 1, device=DEV)), "hidden size"),
    (lambda a: a.update(weight=a["weight"][:32]), r"weight must be \[64\]"),
    (lambda a: a.update(weight=a["weight"].half()), "weight dtype"),
    (lambda a: a.update(residual=a["residual"][:2]), "residual shape"),
    (lambda a: a.update(residual=a["residual"].half()), "residual dtype"),
    (lambda a: a.update(x=a["x"].t().contiguous().t()), "x must have stride 1"),
    (lambda a: a.update(residual=a["residual"].t().contiguous().t()),
     "residual must have stride 1"),
    (lambda a: a.update(eps=-1.0), "eps"),
])
def test_add_rms_norm_rejects(change, match):
    args = _norm_args()
    change(args)
    before = args["residual"].clone() if args["residual"] is not None else None
    with pytest.raises(ValueError, match=match):
        add_rms_norm(**args)
    if before is not None and args["residual"].shape == before.shape:
        assert torch.equal(args["residual"], before)  # nothing written


# ---------------------------------------------------------------- RoPE


def _rope_tables(max_position, head_dim, dtype, theta=10000.0):
    # The shape of llama.py's tables (cos/sin of [freqs, freqs]); the values need not be a
    # particular model's, only realistic (|cos|, |sin| <= 1).
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype).to(DEV), emb.sin().to(dtype).to(DEV)


def _positions(t, max_position, gen):
    pos = torch.randint(0, max_position, (t,), generator=gen)
    pos[0] = max_position - 1 if t == 1 else 0  # the table's two ends
    if t > 1:
        pos[-1] = max_position - 1
    if t > 3:
        pos[1] = pos[2]  # two rows at one position (two sequences)
    return pos.to(DEV)


def _assert_rope_close(out, ref, qkv_in, cos, sin, positions, qk_width, dtype):
    if dtype == F32:
        if interpreted():
            assert torch.equal(out, ref), (out - ref).abs().max()
        else:  # ptxas may fuse a product into the sum's FMA: an ulp
            torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-6)
    else:
        # 16-bit: the kernel rounds x*cos +- y*sin once, eager each product and the sum,
        # so they differ by up to half an ulp of each product plus one of the sum (a whole
        # ulp under the interpreter's truncating bf16 cast): at most two ulps of
        # |x * cos| + |rotate_half(x) * sin|. 1e-6 absolute: fp16 subnormals.
        t = out.shape[0]
        x = qkv_in[:, :qk_width].float().reshape(t, -1, cos.shape[1])
        c, s = cos.float()[positions].unsqueeze(1), sin.float()[positions].unsqueeze(1)
        scale = (x * c).abs() + (rope_reference(x, torch.zeros_like(c), s)).abs()
        err = (out[:, :qk_width].float() - ref[:, :qk_width].float()).reshape(scale.shape)
        assert bool((err.abs() <= 2 * ULP[dtype] * scale + 1e-6).all()), err.abs().max()
        assert torch.equal(out[:, qk_width:], ref[:, qk_width:])  # V: untouched, exactly


@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("t", [1, 7, 64])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("hq,hkv", [(9, 3), (8, 8), (32, 4)])
def test_rotary_matches_llama(hq, hkv, head_dim, t, dtype):
    gen = _gen(hq * 1000 + head_dim + t)
    max_position = 2048
    width = (hq + 2 * hkv) * head_dim
    # A view with a padded row stride: columns past `width` must not be touched either.
    buf = torch.randn(t, width + 24, generator=gen).to(dtype).to(DEV)
    qkv = buf[:, :width]
    cos, sin = _rope_tables(max_position, head_dim, dtype)
    positions = _positions(t, max_position, gen)
    before = buf.clone()
    ref = rotary_reference(qkv, cos, sin, positions, hq, hkv, head_dim)
    rotary_embedding(qkv=qkv, cos=cos, sin=sin, positions=positions, num_q_heads=hq,
                     num_kv_heads=hkv, head_dim=head_dim)
    _assert_rope_close(qkv, ref, before[:, :width], cos, sin, positions,
                       (hq + hkv) * head_dim, dtype)
    v = slice((hq + hkv) * head_dim, width)
    assert torch.equal(qkv[:, v], before[:, v])  # V
    assert torch.equal(buf[:, width:], before[:, width:])  # the row padding


@pytest.mark.parametrize("hq,hkv,head_dim,t,block_heads", [
    (9, 3, 64, 7, None),
    (32, 4, 128, 5, 8),  # 36 heads in programs of 8: a partial last group
    (4, 2, 80, 3, None),  # head_dim 80: half 40 padded to 64 lanes
])
def test_rotary_float16_matches_llama(hq, hkv, head_dim, t, block_heads):
    gen = _gen(21)
    width = (hq + 2 * hkv) * head_dim
    qkv = torch.randn(t, width, generator=gen).to(F16).to(DEV)
    before = qkv.clone()
    cos, sin = _rope_tables(512, head_dim, F16)
    positions = _positions(t, 512, gen)
    ref = rotary_reference(qkv, cos, sin, positions, hq, hkv, head_dim)
    rotary_embedding(qkv=qkv, cos=cos, sin=sin, positions=positions, num_q_heads=hq,
                     num_kv_heads=hkv, head_dim=head_dim, block_heads=block_heads)
    _assert_rope_close(qkv, ref, before, cos, sin, positions, (hq + hkv) * head_dim, F16)


def test_rope_reference_is_transformers_convention():
    # The reference is the kernel's truth; it must be the Llama convention itself.
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    gen = _gen(5)
    hq, hkv, d, t = 4, 2, 64, 9
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=gen).to(BF16)
    cos, sin = (c.cpu() for c in _rope_tables(64, d, BF16))
    positions = torch.randint(0, 64, (t,), generator=gen)
    ours = rotary_reference(qkv, cos, sin, positions, hq, hkv, d)
    q = qkv[:, :hq * d].reshape(1, t, hq, d).transpose(1, 2)
    k = qkv[:, hq * d:(hq + hkv) * d].reshape(1, t, hkv, d).transpose(1, 2)
    hf_q, hf_k = apply_rotary_pos_emb(q, k, cos[positions][None], sin[positions][None])
    assert torch.equal(ours[:, :hq * d], hf_q.transpose(1, 2).reshape(t, hq * d))
    assert torch.equal(ours[:, hq * d:(hq + hkv) * d], hf_k.transpose(1, 2).reshape(t, hkv * d))


def test_rotary_unvalidated_bad_position_leaves_row():
    gen = _gen(8)
    hq, hkv, d = 2, 1, 64
    qkv = torch.randn(3, (hq + 2 * hkv) * d, generator=gen).to(DEV)
    cos, sin = _rope_tables(16, d, F32)
    positions = torch.tensor([1, 16, -1], device=DEV)
    before = qkv.clone()
    rotary_embedding(qkv=qkv, cos=cos, sin=sin, positions=positions, num_q_heads=hq,
                     num_kv_heads=hkv, head_dim=d, validate=False)
    ref = rotary_reference(before[:1], cos, sin, positions[:1], hq, hkv, d)
    torch.testing.assert_close(qkv[:1], ref, atol=1e-6, rtol=1e-6)
    assert torch.equal(qkv[1:], before[1:])


def _rope_args():
    gen = _gen(9)
    cos, sin = _rope_tables(32, 64, F32)
    return {"qkv": torch.randn(4, (4 + 2 * 2) * 64, generator=gen).to(DEV), "cos": cos,
            "sin": sin, "positions": torch.tensor([0, 5, 31, 2], device=DEV),
            "num_q_heads": 4, "num_kv_heads": 2, "head_dim": 64}


@pytest.mark.parametrize("change,match", [
    (lambda a: a.update(qkv=a["qkv"][:, :-64]), r"qkv must be \[T, 512\]"),
    (lambda a: a.update(qkv=a["qkv"].int()), "qkv dtype"),
    (lambda a: a.update(num_kv_heads=-1), "num_kv_heads must be an int >= 0"),
    (lambda a: a.update(num_q_heads=0), "num_q_heads must be an int >= 1"),
    (lambda a: a.update(head_dim=63), "head_dim must be even"),
    (lambda a: a.update(cos=a["cos"][:, :32]), r"cos must be \[max_position, 64\]"),
    (lambda a: a.update(sin=a["sin"][:16]), "sin shape"),
    (lambda a: a.update(cos=a["cos"].half(), sin=a["sin"].half()), "cos/sin dtypes"),
    (lambda a: a.update(positions=a["positions"].float()), "positions must be int32"),
    (lambda a: a.update(positions=a["positions"][:3]), r"positions must be \[4\]"),
    (lambda a: a.update(positions=torch.tensor([0, 5, 32, 2], device=DEV)),
     r"positions\[2\] = 32 is outside the rotary tables' \[0, 32\)"),
    (lambda a: a.update(positions=torch.tensor([0, -1, 3, 2], device=DEV)),
     r"positions\[1\] = -1"),
    (lambda a: a.update(cos=a["cos"].t().contiguous().t()), "cos must have stride 1"),
])
def test_rotary_rejects(change, match):
    args = _rope_args()
    change(args)
    before = args["qkv"].clone()
    with pytest.raises(ValueError, match=match):
        rotary_embedding(**args)
    assert torch.equal(args["qkv"], before)  # nothing written


# ---------------------------------------------------------------- SiLU * mul


@pytest.mark.parametrize("dtype", [F32, BF16, F16])
@pytest.mark.parametrize("t", [1, 7, 64])
@pytest.mark.parametrize("inter", [64, 1000, 1536])  # 1000: a partial block; 1536: two
def test_silu_mul_matches_reference(inter, t, dtype):
    gen = _gen(inter + t)
    buf = torch.randn(t, 2 * inter + 8, generator=gen).clamp(-6, 6).to(dtype).to(DEV)
    gate_up = buf[:, :2 * inter]  # a padded row stride
    out = silu_mul(gate_up)
    ref = silu_mul_reference(gate_up)
    assert out.shape == (t, inter) and out.dtype == dtype and out.is_contiguous()
    if dtype == F32:
        torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-6)  # exp's last bits
    else:
        # eager rounds silu(g) and then the product, the kernel once: within two ulps of
        # |silu(g) * u| (the interpreter's bf16 cast truncates: still inside)
        g, u = gate_up[:, :inter].float(), gate_up[:, inter:].float()
        scale = (torch.nn.functional.silu(g) * u).abs()
        err = (out.float() - ref.float()).abs()
        assert bool((err <= 2 * ULP[dtype] * scale + 1e-6).all()), err.max()


def test_silu_mul_empty_and_rejects():
    assert silu_mul(torch.empty(0, 128, device=DEV)).shape == (0, 64)
    with pytest.raises(ValueError, match=r"gate_up must be \[T, 2I\]"):
        silu_mul(torch.randn(3, 7, device=DEV))
    with pytest.raises(ValueError, match="gate_up dtype"):
        silu_mul(torch.zeros(3, 8, dtype=torch.int32, device=DEV))
    with pytest.raises(ValueError, match="gate_up must have stride 1"):
        silu_mul(torch.randn(8, 4, device=DEV).t())


# ---------------------------------------------------------------- the CUDA bundle


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_triton_layer_ops_match_torch_layer_ops(dtype):
    """The seam the model calls: the `triton` bundle (what CUDA devices get) against the
    eager `torch` one, on a fused QKV row with padded stride as llama.py builds it."""
    tri, ref = build_layer_ops("triton", torch.device(DEV)), build_layer_ops("torch", DEV)
    gen = _gen(3)
    t, hidden, hq, hkv, d, inter = 9, 96, 6, 2, 16, 80
    x = torch.randn(t, hidden, generator=gen).to(dtype).to(DEV)
    delta = torch.randn(t, hidden, generator=gen).to(dtype).to(DEV)
    w = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(dtype).to(DEV)
    x_tri, x_ref = x.clone(), x.clone()
    h_tri, h_ref = tri.add_rms_norm(x_tri, delta, w, 1e-5), ref.add_rms_norm(x_ref, delta, w,
                                                                              1e-5)
    if dtype == F32 or not interpreted():
        assert torch.equal(x_tri, x_ref)  # the residual stream: one rounding in both
    else:  # the interpreter's bf16 cast truncates where eager rounds: one ulp
        torch.testing.assert_close(x_tri, x_ref, atol=0, rtol=BF16_ULP)
    torch.testing.assert_close(h_tri, h_ref, **NORM_TOL[dtype])
    torch.testing.assert_close(tri.add_rms_norm(x.clone(), None, w, 1e-5),
                               ref.add_rms_norm(x.clone(), None, w, 1e-5), **NORM_TOL[dtype])

    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=gen).to(dtype).to(DEV)
    cos, sin = _rope_tables(64, d, dtype)
    positions = _positions(t, 64, gen)
    before = qkv.clone()
    qk_view = qkv[:, :(hq + hkv) * d].view(t, hq + hkv, d)
    got = tri.rope(qk_view, tri.rope_tables(positions, cos, sin))
    assert got.data_ptr() == qkv.data_ptr()  # in place, in the QKV rows
    want = rotary_reference(before, cos, sin, positions, hq, hkv, d)
    _assert_rope_close(qkv, want, before, cos, sin, positions, (hq + hkv) * d, dtype)
    ref_qk = ref.rope(before[:, :(hq + hkv) * d].view(t, hq + hkv, d),
                      ref.rope_tables(positions, cos, sin))
    assert torch.equal(ref_qk.reshape(t, -1), want[:, :(hq + hkv) * d])  # one reference

    gate_up = torch.randn(t, 2 * inter, generator=gen).to(dtype).to(DEV)
    tol = {"atol": 1e-6, "rtol": 1e-6} if dtype == F32 else {"atol": 1e-2, "rtol": 2 * ULP[dtype]}
    torch.testing.assert_close(tri.silu_mul(gate_up), ref.silu_mul(gate_up), **tol)
