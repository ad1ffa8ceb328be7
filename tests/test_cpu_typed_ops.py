"""The C kernels as typed torch ops (torch.ops.pdserve.*): their schemas, the dispatcher's
type check at the call, the launchers' checks that stop a wrong dtype, shape, stride or
device before the ctypes call (each raises a ValueError naming the argument; a call that
reached C with these would read or write outside its tensors), and the fake
implementations that let torch.compile trace them."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import pdserve.engine.cpu_kernels.layer_ops  # noqa: F401  (registers the layer ops)
import pdserve.engine.cpu_kernels.paged_decode  # noqa: F401
import pdserve.engine.cpu_kernels.paged_prefill  # noqa: F401
from pdserve.engine.attention.torch_backend import decode_attention_reference

ops = torch.ops.pdserve

SCHEMAS = {
    "add_rms_norm": "pdserve::add_rms_norm(Tensor(a0!) x, Tensor? delta, Tensor weight, "
                    "float eps) -> Tensor",
    "rope_": "pdserve::rope_(Tensor(a0!) qk, Tensor positions, Tensor cos, Tensor sin) -> ()",
    "silu_mul": "pdserve::silu_mul(Tensor gate_up) -> Tensor",
    "paged_decode_attention": "pdserve::paged_decode_attention(Tensor query, Tensor k_cache, "
                              "Tensor v_cache, Tensor seq_lens, Tensor block_tables, "
                              "float scale, Tensor(a6!) out) -> ()",
    "paged_prefill_attention": "pdserve::paged_prefill_attention(Tensor query, "
                               "Tensor k_cache, Tensor v_cache, SymInt[] query_lens, "
                               "SymInt[] seq_lens, Tensor block_tables, float scale, "
                               "Tensor(a7!) out) -> ()",
}


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_schema(name):
    assert str(getattr(ops, name).default._schema) == SCHEMAS[name]


def _decode_args(b=3, hq=4, hkv=2, d=64, bs=16, num_blocks=8):
    gen = torch.Generator().manual_seed(0)
    k = torch.randn(num_blocks, bs, hkv, d, generator=gen)
    return {
        "query": torch.randn(b, hq, d, generator=gen),
        "k_cache": k,
        "v_cache": torch.randn(num_blocks, bs, hkv, d, generator=gen),
        "seq_lens": torch.tensor([1, 17, 40][:b], dtype=torch.int32),
        "block_tables": torch.arange(b * 3, dtype=torch.int32).view(b, 3) % num_blocks,
        "scale": d ** -0.5,
        "out": torch.zeros(b, hq, d),
    }


def test_decode_op_runs_and_matches_reference():
    a = _decode_args()
    ops.paged_decode_attention(**a)
    want = decode_attention_reference(a["query"], a["k_cache"], a["v_cache"], a["seq_lens"],
                                      a["block_tables"], a["scale"])
    torch.testing.assert_close(a["out"], want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("change", [
    lambda a: a.update(scale="0.1"),  # a str where the schema says float
    lambda a: a.update(seq_lens=[1, 17, 40]),  # a list where it says Tensor
    lambda a: a.update(block_tables=3),
])
def test_decode_schema_rejects_wrong_types_at_the_call(change):
    a = _decode_args()
    change(a)
    with pytest.raises(RuntimeError, match="Expected a value of type"):
        ops.paged_decode_attention(**a)


def test_none_for_a_tensor_is_named():
    # the dispatcher lets None through for a Tensor (an undefined tensor): the op names it
    a = _decode_args()
    with pytest.raises(ValueError, match="out must be a tensor, got None"):
        ops.paged_decode_attention(**{**a, "out": None})
    with pytest.raises(ValueError, match="query must be a tensor, got None"):
        ops.paged_decode_attention(**{**a, "query": None})
    with pytest.raises(ValueError, match="gate_up must be a tensor, got None"):
        ops.silu_mul(None)


def _strided_query(a):
    q = torch.randn(3, 64, 4).transpose(1, 2)  # [3, 4, 64] with dims not contiguous
    a.update(query=q)


@pytest.mark.parametrize("change,match", [
    (lambda a: a.update(query=a["query"].double()), "query dtype must be float32 or bfloat16"),
    (lambda a: a.update(query=a["query"][:, :, :32]), "head_dim 32 != k_cache head_dim 64"),
    (_strided_query, "query must have contiguous heads and dims"),
    (lambda a: a.update(query=a["query"].to("meta")), "query must be on the CPU"),
    (lambda a: a.update(k_cache=a["k_cache"].transpose(0, 1)), "v_cache must match k_cache"),
    (lambda a: a.update(k_cache=a["k_cache"][:, ::2], v_cache=a["v_cache"][:, ::2]),
     "must be contiguous"),
    (lambda a: a.update(seq_lens=a["seq_lens"].long()), "seq_lens must be a contiguous int32"),
    (lambda a: a.update(block_tables=a["block_tables"].t().contiguous().t()),
     "block_tables must be int32 .* contiguous rows"),
    (lambda a: a.update(out=a["out"].bfloat16()), "out must be a contiguous torch.float32"),
    (lambda a: a.update(seq_lens=torch.tensor([1, 17, 49], dtype=torch.int32)),
     r"seq_lens\[2\] = 49 must be in 1..48"),
    (lambda a: a["block_tables"].__setitem__((1, 1), 99), "block id 99, outside"),
])
def test_decode_op_checks_before_c(change, match):
    a = _decode_args()
    change(a)
    before = a["out"].clone()
    with pytest.raises(ValueError, match=match):
        ops.paged_decode_attention(**a)
    assert torch.equal(a["out"], before)  # nothing written


def test_prefill_op_checks_before_c():
    a = _decode_args()
    q = torch.randn(5, 4, 64)
    base = dict(query=q, k_cache=a["k_cache"], v_cache=a["v_cache"], query_lens=[2, 3],
                seq_lens=[2, 40], block_tables=a["block_tables"][:2], scale=0.125,
                out=torch.zeros(5, 4, 64))
    ops.paged_prefill_attention(**base)  # the good call runs
    for change, match in (
            ({"query_lens": [2, 2]}, "query_lens sum to 4, not the 5 query rows"),
            ({"seq_lens": [2]}, "seq_lens has 1 entries, query_lens 2"),
            ({"query_lens": [3, 2], "seq_lens": [2, 40]}, r"chunk 0: query length 3"),
            ({"query": q.bfloat16(), "out": torch.zeros(5, 4, 64, dtype=torch.bfloat16),
              "k_cache": a["k_cache"].half(), "v_cache": a["v_cache"].half()},
             "k_cache dtype must be float32 or bfloat16"),
            ({"out": torch.zeros(5, 4, 63)}, "out must be a contiguous")):
        with pytest.raises(ValueError, match=match):
            ops.paged_prefill_attention(**{**base, **change})


@pytest.mark.parametrize("call,match", [
    (lambda: ops.add_rms_norm(torch.randn(3, 8).half(), None, torch.randn(8).half(), 1e-5),
     "x must be a float32 or bfloat16 CPU tensor"),
    (lambda: ops.add_rms_norm(torch.randn(3, 8), torch.randn(3, 8).t().contiguous().t(),
                              torch.randn(8), 1e-5), "delta must be"),
    (lambda: ops.rope_(torch.randn(2, 3, 8), torch.zeros(2, dtype=torch.int32),
                       torch.randn(5, 8), torch.randn(5, 8)), "int64"),
    (lambda: ops.rope_(torch.randn(2, 3, 8), torch.tensor([0, 5]), torch.randn(5, 8),
                       torch.randn(5, 8)), r"positions\[1\] = 5 is outside"),
    (lambda: ops.silu_mul(torch.randn(6, 4).t()), "contiguous"),
    (lambda: ops.silu_mul(torch.randn(3, 8).to("meta")), "CPU tensor"),
])
def test_layer_ops_check_before_c(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_fake_impls_give_metadata_and_the_same_errors():
    with FakeTensorMode():
        x, w = torch.randn(5, 24)[:, :16], torch.randn(16)  # strided rows: out contiguous
        h = ops.add_rms_norm(x, torch.randn(5, 16), w, 1e-5)
        assert h.shape == (5, 16) and h.is_contiguous()
        assert ops.silu_mul(torch.randn(4, 10, dtype=torch.bfloat16)).shape == (4, 5)
        a = _decode_args()
        ops.paged_decode_attention(**a)  # no data read: metadata checks only
        with pytest.raises(ValueError, match="gate_up must be a contiguous"):
            ops.silu_mul(torch.randn(4, 9))
        a["query"] = a["query"].double()
        with pytest.raises(ValueError, match="query dtype"):
            ops.paged_decode_attention(**a)


def test_torch_compile_traces_the_ops():
    from pdserve.engine.cpu_kernels.layer_ops import add_rms_norm, rope_, silu_mul
    from pdserve.engine.cpu_kernels.paged_decode import paged_decode_attention

    def step(x, delta, w, qk, pos, cos, sin, gate_up, a):
        h = add_rms_norm(x, delta, w, 1e-5)
        rope_(qk, pos, cos, sin)
        att = paged_decode_attention(a["query"], a["k_cache"], a["v_cache"], a["seq_lens"],
                                     a["block_tables"], a["scale"])
        return h * 2, silu_mul(gate_up) + 1, att.sum()

    gen = torch.Generator().manual_seed(4)
    args = [torch.randn(4, 32, generator=gen), torch.randn(4, 32, generator=gen),
            torch.randn(32, generator=gen), torch.randn(4, 3, 8, generator=gen),
            torch.tensor([0, 1, 2, 3]), torch.randn(6, 8, generator=gen),
            torch.randn(6, 8, generator=gen), torch.randn(4, 16, generator=gen)]
    eager_args = [t.clone() for t in args]
    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    got = compiled(*args, _decode_args())
    want = step(*eager_args, _decode_args())
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    assert torch.equal(args[0], eager_args[0]) and torch.equal(args[3], eager_args[3])
