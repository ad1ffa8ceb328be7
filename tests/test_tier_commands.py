"""`pdserve gateway | prefill | decode`: each tier's own `python -m` parser (imported only when
its command runs), and a worker's gateway list (`--gateway`, repeatable or a:p,b:p)."""

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


@pytest.mark.parametrize("command,module", [("gateway", gateway_main),
                                            ("prefill", prefill_main),
                                            ("decode", decode_main)])
def test_subcommand_is_the_entry_points_parser(command, module, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main([command, "--help"])
    assert e.value.code == 0
    assert capsys.readouterr().out == module.build_parser(f"pdserve {command}").format_help()
    assert command in cli.build_parser().format_help()


def test_other_commands_still_refuse_unknown_flags(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["generate", "--prompt", "hi", "--gateway", "g:1"])
    assert e.value.code == 2
    assert "unrecognized arguments: --gateway g:1" in capsys.readouterr().err


def test_gateway_list_is_comma_separated_and_repeatable():
    a = prefill_main.build_parser().parse_args([*WORKER_ARGV, "--gateway", "g1:1"])
    cfg = worker_config_from_args(a)
    assert cfg.gateways == ("g1:1", "g2:2", "g3:3")  # in order, the repeat dropped
    assert cfg.advertise_address == "w.example:7001"
    assert worker_config_from_args(prefill_main.build_parser().parse_args([])).gateways == ()
    assert addresses(["a:1, b:2", "", "[::1]:3"], "--x") == ["a:1", "b:2", "[::1]:3"]


@pytest.mark.parametrize("argv,message", [
    (["prefill", "--gateway", "g1:1,nohost"], "--gateway 'nohost' is not host:port"),
    (["decode", "--gateway", "g1:1", "--gateway", ":2"], "--gateway ':2' is not host:port"),
    (["gateway", "--model", "m", "--decode", "d"], "worker address 'd' is not host:port"),
])
def test_a_malformed_address_is_refused_naming_the_flag(argv, message, capsys):
    # refused before anything loads or binds: flags are checked first
    assert cli.main(argv) == 2
    assert message in capsys.readouterr().err
