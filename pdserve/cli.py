"""The `pdserve` command line: one subcommand per thing a person does with pdserve."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from pdserve.engine_args import add_engine_args, engine_config_from_args


def _cmd_generate(a: argparse.Namespace) -> int:
    from pdserve.engine.detokenizer import IncrementalDetokenizer
    from pdserve.engine.llm_engine import LLMEngine
    from pdserve.engine.model_files import chat_text
    from pdserve.protocol import SamplingParams

    try:
        params = SamplingParams(max_tokens=a.max_tokens, temperature=a.temperature,
                                top_p=a.top_p, top_k=a.top_k, seed=a.seed)
    except ValueError as e:
        print(f"pdserve generate: {e}", file=sys.stderr)
        return 2
    engine = LLMEngine(engine_config_from_args(a, kv_cache_memory=a.kv_cache_memory))
    tok = engine.tokenizer
    prompt = a.prompt
    if a.chat:
        try:
            prompt = chat_text(tok, [{"role": "user", "content": a.prompt}])
        except ValueError as e:
            print(f"pdserve generate: --chat: {e}", file=sys.stderr)
            return 2
    try:
        ids = engine.encode_prompt(prompt)
        engine.add_request("cli", ids, params)
    except ValueError as e:
        print(f"pdserve generate: {e}", file=sys.stderr)
        return 2
    detok = IncrementalDetokenizer(tok, ids) if tok is not None else None
    while engine.has_unfinished():
        for d in engine.step():
            text = detok.add(d.new_token_ids) if detok else " ".join(map(str, d.new_token_ids))
            if d.finished and detok:
                text += detok.flush()
            sys.stdout.write(text)
            sys.stdout.flush()
            if d.finished:
                print(f"\n[{d.num_output_tokens} tokens, finish_reason={d.finish_reason}]",
                      file=sys.stderr)
    sys.stdout.write("\n")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdserve", description=__doc__.splitlines()[0].strip())
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging on stderr")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    g = sub.add_parser("generate", help="generate a completion in-process, streamed to stdout",
                       description="Generate one completion with the colocated engine in this "
                                   "process. Only the completion goes to stdout; logs and "
                                   "progress go to stderr.")
    g.add_argument("--prompt", required=True, help="the prompt text")
    g.add_argument("--chat", action="store_true",
                   help="wrap the prompt as a user message in the model's chat template")
    g.add_argument("--max-tokens", type=int, default=128, help="tokens to generate (default 128)")
    g.add_argument("--temperature", type=float, default=0.0,
                   help="0 = greedy (default 0)")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default 1)")
    g.add_argument("--top-k", type=int, default=-1, help="top-k sampling (default off)")
    g.add_argument("--seed", type=int, default=None, help="seed for reproducible sampling")
    add_engine_args(g)
    g.set_defaults(func=_cmd_generate, kv_cache_memory="256MiB")

    _add_tier_commands(sub)
    for register in _optional_commands():
        register(sub)
    return p


# `pdserve <tier>` runs the module behind `python -m pdserve.<package>`
TIERS = {"gateway": ("gateway", "the gateway (gRPC + OpenAI HTTP)"),
         "prefill": ("prefill_worker", "one prefill worker"),
         "decode": ("decode_worker", "one decode worker")}


def _add_tier_commands(sub) -> None:
    """`pdserve gateway | prefill | decode`: one tier per process, for a tier per host. The
    tier's own parser (`build_parser` of its `__main__`, the one definition of its flags)
    reads everything after the command, and its `run` serves; the module is imported only
    when its command runs, so other commands never load a tier."""
    for name, (_, what) in TIERS.items():
        t = sub.add_parser(name, help=f"run {what} until SIGTERM (--help for its flags)",
                           add_help=False)  # --help goes to the tier's own parser
        t.set_defaults(func=_run_tier)


def _run_tier(a: argparse.Namespace) -> int:
    module = importlib.import_module(f"pdserve.{TIERS[a.command][0]}.__main__")
    args = module.build_parser(prog=f"pdserve {a.command}").parse_args(a.tier_argv)
    if getattr(args, "verbose", False):
        logging.getLogger().setLevel(logging.DEBUG)
    return module.run(args)


def _optional_commands():
    """Subcommands owned by other packages, added when those packages are present."""
    out = []
    try:
        from pdserve.cli_up import register as reg_up
        out.append(reg_up)
    except ImportError:
        pass
    try:
        from pdserve.cli_bench import register as reg_bench
        out.append(reg_bench)
    except ImportError:
        pass
    return out


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    a, rest = parser.parse_known_args(argv)
    if a.command in TIERS:
        a.tier_argv = rest
    elif rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    logging.basicConfig(level=logging.DEBUG if a.verbose else logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return a.func(a)


if __name__ == "__main__":
    sys.exit(main())
