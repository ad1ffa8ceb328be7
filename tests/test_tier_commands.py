"""`pdserve gateway | prefill | decode`: the same flags as each tier's `python -m` entry point
(one definition each), and a worker's gateway list (`--gateway`, repeatable or a:p,b:p)."""

from __future__ import annotations

import pytest

from pdserve import cli
from pdserve.addresses import addresses
from pdserve.decode_worker import __main__ as decode_main
from pdserve.gateway import __main__ as gateway_main
from pdserve.prefill_worker import __main__ as prefill_main
from pdserve.worker_runtime import worker_config_from_args

WORKER_ARGV = ["--model", "m", "--host", "10.0.0.2", "--port", "7001", "--metrics-port", "7002",
               "--advertise-address", "w.example:7001", "--gateway", "g1:1,g2:2",
               "--gateway", "g3:3", "--worker-id", "w", "--heartbeat-interval", "0.5",
               "--threads", "1", "--kv-cache-memory", "8MiB"]


@pytest.mark.parametrize("command,module,argv", [
    ("prefill", prefill_main, [*WORKER_ARGV, "--max-chunk-bytes", "4096"]),
    ("decode", decode_main, [*WORKER_ARGV, "--reservation-timeout", "3"]),
    ("gateway", gateway_main, ["--model", "m", "--host", "10.0.0.1", "--grpc-port", "1",
                               "--http-port", "2", "--decode", "d:1", "--disagg-threshold",
                               "64", "--max-queue", "5", "--heartbeat-timeout", "2"]),
])
def test_subcommand_parses_exactly_as_the_entry_point(command, module, argv):
    sub = vars(cli.build_parser().parse_args([command, *argv]))
    own = vars(module.build_parser().parse_args(argv))
    assert sub.pop("command") == command
    assert sub.pop("func") is module.run
    assert sub.pop("verbose") is False and own.pop("verbose", False) is False
    assert sub == own


def test_gateway_list_is_comma_separated_and_repeatable():
    a = prefill_main.build_parser().parse_args([*WORKER_ARGV, "--gateway", "g1:1"])
    cfg = worker_config_from_args(a)
    assert cfg.gateways == ("g1:1", "g2:2", "g3:3")  # in order, the repeat dropped
    assert cfg.advertise_address == "w.example:7001"
    assert worker_config_from_args(prefill_main.build_parser().parse_args([])).gateways == ()
    assert addresses(["a:1, b:2", "", "[::1]:3"], "--x") == ["a:1", "b:2", "[::1]:3"]


@pytest.mark.parametrize("command", ["prefill", "decode"])
def test_a_malformed_gateway_is_refused_naming_the_flag(command, capsys):
    # refused before any model loads: the flag is checked first
    assert cli.main([command, "--gateway", "g1:1,nohost"]) == 2
    assert "--gateway 'nohost' is not host:port" in capsys.readouterr().err
