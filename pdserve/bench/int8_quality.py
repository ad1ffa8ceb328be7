"""What `--quantization int8` costs in quality: perplexity over a text and how often the
next-token choice agrees with float32's, for the model in float32, bfloat16, int8 weights
as pdserve.engine.layers.int8 makes them (a scale per 64 weights of a row; what a batch
past a few rows computes with), the same with x quantized per 64 at every projection (what
the int8 kernels of a decode step of a few rows compute), and int8 weights with one scale
per row (the simpler scheme not taken).

    python -m pdserve.bench.int8_quality [--model smollm2-135m] [--text FILE ...]
                                         [--max-tokens 2048]

Teacher-forced through transformers' Llama on the weights each scheme leaves, x quantized
by a hook before every linear where the row says so (the arithmetic of
`int8_linear_reference`, which tests/test_int8.py holds the kernels to). Default text: the
repository's README and docs/architecture.md (English prose).
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import torch

from pdserve.engine.layers.int8 import GROUP, quantize_activations, quantize_int8

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_TEXTS = (REPO_ROOT / "README.md", REPO_ROOT / "docs" / "architecture.md")


def per_row_int8(w: torch.Tensor) -> torch.Tensor:
    """w with one symmetric int8 scale per row, de-quantized (the scheme not taken)."""
    amax = w.abs().amax(dim=1, keepdim=True)
    scale = torch.where(amax > 0, amax / 127, torch.ones_like(amax))
    return torch.round(w / scale).clamp(-127, 127) * scale


def quantized_state(state: dict[str, torch.Tensor], scheme: str) -> dict[str, torch.Tensor]:
    """The state as `scheme` leaves it: the projections, the LM head and the embedding
    (SmolLM2 ties the two, and the engine de-quantizes them as one) through int8, the
    norms untouched."""
    out = {}
    for name, w in state.items():
        if w.dim() == 2:  # every matrix: projections, LM head, embedding
            w = (quantize_int8(w).dequantize(torch.float32) if scheme == "int8"
                 else per_row_int8(w.float()))
        out[name] = w
    return out


def fake_quantized_x(x: torch.Tensor) -> torch.Tensor:
    """x [..., K] rounded as the int8 kernels round it (`quantize_activations`), back in
    x's dtype."""
    k = x.shape[-1]
    xq, sx = quantize_activations(x.reshape(-1, k))
    rounded = (xq.float().unflatten(1, (-1, GROUP)) * sx[:, :, None]).flatten(1)[:, :k]
    return rounded.reshape(x.shape).to(x.dtype)


def evaluate(model, ids: torch.Tensor) -> tuple[float, torch.Tensor]:
    """(perplexity, the argmax token at every position) of ids [1, T]."""
    with torch.inference_mode():
        logits = model(ids).logits.float()[0, :-1]
    nll = -torch.log_softmax(logits, dim=-1).gather(1, ids[0, 1:, None]).mean()
    return math.exp(float(nll)), logits.argmax(dim=-1)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pdserve.bench.int8_quality",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--text", nargs="+", default=[str(t) for t in DEFAULT_TEXTS],
                   help="text files, concatenated (default: README.md, docs/architecture.md)")
    p.add_argument("--max-tokens", type=int, default=2048)
    a = p.parse_args(argv)
    from transformers import AutoModelForCausalLM

    from pdserve.engine.model_files import load_tokenizer, resolve_model
    from pdserve.engine.model_loader import load_hf_weights

    source = resolve_model(a.model)
    config, state = load_hf_weights(source, show_progress=False)
    text = "\n\n".join(Path(t).read_text() for t in a.text)
    ids = torch.tensor([load_tokenizer(source).encode(text)[:a.max_tokens]])
    model = AutoModelForCausalLM.from_config(config).eval()
    print(f"{a.model}: {ids.shape[1]} tokens of {', '.join(a.text)}")
    print(f"{'weights':<24} {'perplexity':>10} {'top-1 = float32':>16}")
    reference = None
    for label, scheme, dtype, quantize_x in (
            ("float32", None, torch.float32, False),
            ("bfloat16", None, torch.bfloat16, False),
            ("int8 weights", "int8", torch.float32, False),
            ("int8 weights and x", "int8", torch.float32, True),
            ("int8 per row, weights", "row", torch.float32, False)):
        weights = quantized_state(state, scheme) if scheme else state
        model.load_state_dict(weights, strict=False)
        model.tie_weights()
        hooks = [m.register_forward_pre_hook(lambda _, args: (fake_quantized_x(args[0]),))
                 for m in model.modules() if isinstance(m, torch.nn.Linear) and quantize_x]
        ppl, top = evaluate(model.to(dtype), ids)
        for h in hooks:
            h.remove()
        model.float()
        reference = top if reference is None else reference
        print(f"{label:<24} {ppl:>10.3f} {float((top == reference).float().mean()):>16.4f}",
              flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
