"""`pdserve bench`: the load generator of `pdserve.bench.loadgen` as a `pdserve` subcommand.

The subcommand takes exactly loadgen's flags (its parser is the parent of this one, so
`pdserve bench --help` and `python -m pdserve.bench.loadgen --help` list the same options) and
hands the parsed arguments to `pdserve.bench.loadgen.run`.
"""

from __future__ import annotations

import argparse

from pdserve.bench import loadgen


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add `bench` to the `pdserve` subcommands."""
    source = loadgen.build_parser()
    p = subparsers.add_parser(
        "bench",
        parents=[source],
        add_help=False,  # the parent brings -h/--help
        help="replay a seeded workload against a server and report latency and throughput",
        description=source.description,
        epilog=source.epilog,
    )
    p.set_defaults(func=lambda a: loadgen.run(a, p))
