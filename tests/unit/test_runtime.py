"""The bus runtime's options: every option is a flag and an env var, flag wins."""

from __future__ import annotations

from pathlib import Path

import pytest

from shared.runtime import METRICS_PORTS, Option, common_options, parse_options

EXTRA = [
    Option("--cdi-dir", "CDI dir", default=Path("/etc/cdi"), type=Path),
    Option("--rescan-interval", "s", default=30.0, type=float),
    Option("--adapter", "a", default="nvidia", choices=("nvidia", "fakehw")),
]


def parse(argv, env):
    return parse_options("inventory", [*common_options("inventory"), *EXTRA], argv, env)


@pytest.mark.parametrize(
    "argv, env, field, expected",
    [
        pytest.param(["--node-id", "n1"], {}, "nats_url", "nats://127.0.0.1:4222", id="default"),
        pytest.param(["--node-id", "n1"], {"BCD_NATS_URL": "nats://10.0.0.1:4"}, "nats_url", "nats://10.0.0.1:4", id="env"),
        pytest.param(["--node-id", "n1", "--nats-url", "nats://flag:1"], {"BCD_NATS_URL": "nats://env:2"}, "nats_url", "nats://flag:1", id="flag-wins"),
        pytest.param([], {"BCD_NODE_ID": "from-env"}, "node_id", "from-env", id="required-from-env"),
        pytest.param(["--node-id", "n1"], {"BCD_CDI_DIR": "/x/cdi"}, "cdi_dir", Path("/x/cdi"), id="typed-path-env"),
        pytest.param(["--node-id", "n1"], {"BCD_RESCAN_INTERVAL": "2.5"}, "rescan_interval", 2.5, id="typed-float-env"),
        pytest.param(["--node-id", "n1"], {}, "metrics_port", METRICS_PORTS["inventory"], id="own-metrics-port"),
        pytest.param(["--node-id", "n1"], {}, "nats_user", "inventory", id="own-user"),
        pytest.param(["--node-id", "n1"], {}, "metrics_addr", "127.0.0.1", id="loopback-metrics"),
    ],
)
def test_option_sources(argv, env, field, expected):
    assert getattr(parse(argv, env), field) == expected


def test_required_option_missing_everywhere_exits(capsys):
    with pytest.raises(SystemExit):
        parse([], {})
    assert "--node-id" in capsys.readouterr().err


def test_bad_choice_from_env_is_refused(capsys):
    with pytest.raises(SystemExit):
        parse(["--node-id", "n"], {"BCD_ADAPTER": "amd"})
    assert "BCD_ADAPTER" in capsys.readouterr().err


def test_every_option_has_an_env_var_named_after_its_flag():
    for opt in [*common_options("signer"), *EXTRA]:
        assert opt.env == "BCD_" + opt.flag[2:].replace("-", "_").upper()


def test_each_service_has_its_own_metrics_port():
    assert len(set(METRICS_PORTS.values())) == len(METRICS_PORTS)


SWITCH = Option("--accept-unsigned-specs", "lab only", switch=True)


@pytest.mark.parametrize(
    "argv, env, expected",
    [
        pytest.param([], {}, False, id="off-by-default"),
        pytest.param(["--accept-unsigned-specs"], {}, True, id="flag"),
        pytest.param([], {"BCD_ACCEPT_UNSIGNED_SPECS": "1"}, True, id="env-1"),
        pytest.param([], {"BCD_ACCEPT_UNSIGNED_SPECS": "Yes"}, True, id="env-yes"),
        pytest.param([], {"BCD_ACCEPT_UNSIGNED_SPECS": "0"}, False, id="env-0"),
        pytest.param([], {"BCD_ACCEPT_UNSIGNED_SPECS": ""}, False, id="env-empty"),
        pytest.param(["--accept-unsigned-specs"], {"BCD_ACCEPT_UNSIGNED_SPECS": "0"}, True, id="flag-wins"),
    ],
)
def test_a_switch_takes_no_value_and_reads_its_env_var(argv, env, expected):
    ns = parse_options("converger", [*common_options("converger"), SWITCH], ["--node-id", "n", *argv], env)
    assert ns.accept_unsigned_specs is expected


def test_a_switch_refuses_an_env_value_it_cannot_read(capsys):
    # "flase" must not silently read as either answer of a switch that weakens a check
    with pytest.raises(SystemExit):
        parse_options("converger", [*common_options("converger"), SWITCH], ["--node-id", "n"], {"BCD_ACCEPT_UNSIGNED_SPECS": "flase"})
    assert "BCD_ACCEPT_UNSIGNED_SPECS: 'flase' is neither 1 nor 0" in capsys.readouterr().err
