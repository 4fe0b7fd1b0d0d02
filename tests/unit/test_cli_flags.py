"""`router-sidecar`'s parser, without running anything: the values its flags take (etcd as etcd's own
clients spell it, the sidecar's address), global flags before or after the subcommand, the deprecated
spellings, and one-line errors."""

from __future__ import annotations

import argparse
import re

import pytest

from router_sidecar.runtime import cli, flags


@pytest.mark.parametrize(
    ("given", "dialled"),
    [
        ("127.0.0.1:2379", "127.0.0.1:2379"),
        ("http://127.0.0.1:2379", "127.0.0.1:2379"),
        ("http://127.0.0.1:2379/", "127.0.0.1:2379"),
        ("HTTP://etcd-0.etcd:2379", "etcd-0.etcd:2379"),
        (
            "http://10.0.0.1:2379,http://10.0.0.2:2379, 10.0.0.3:2379",
            "10.0.0.1:2379,10.0.0.2:2379,10.0.0.3:2379",
        ),
        ("http://[::1]:2379,[::2]:2379", "[::1]:2379,[::2]:2379"),
    ],
)
def test_etcd_takes_what_etcdctl_takes(given: str, dialled: str) -> None:
    assert flags.etcd_endpoints(given) == dialled


@pytest.mark.parametrize(
    ("given", "message"),
    [
        (
            "https://10.0.0.1:2379",
            "'https://10.0.0.1:2379': TLS to etcd (https://) is not implemented; give http:// members (plain "
            "gRPC) and keep etcd's client port on a network only the gateways and agents reach",
        ),
        (
            "unix://run/etcd.sock",
            "'unix://run/etcd.sock' is not HOST:PORT or http://HOST:PORT, e.g. 127.0.0.1:2379 or "
            "http://10.0.0.1:2379,http://10.0.0.2:2379",
        ),
        (
            "http://10.0.0.1:2379/v3",
            "'10.0.0.1:2379/v3' is not HOST:PORT or http://HOST:PORT (port 1-65535), e.g. 127.0.0.1:2379 or "
            "http://10.0.0.1:2379,http://10.0.0.2:2379",
        ),
        (
            ",",
            "',' names no etcd member; expected HOST:PORT or http://HOST:PORT, e.g. 127.0.0.1:2379 or "
            "http://10.0.0.1:2379,http://10.0.0.2:2379",
        ),
    ],
)
def test_etcd_refuses_with_one_line_that_says_what_is_allowed(given: str, message: str) -> None:
    with pytest.raises(flags.FlagValueError) as refused:
        flags.etcd_endpoints(given)
    assert str(refused.value) == message


def test_the_sidecar_listens_on_a_unix_socket_or_loopback_only() -> None:
    assert flags.sidecar_listen("unix:/run/s.sock") == "unix:/run/s.sock"
    assert flags.sidecar_listen("127.0.0.1:50051") == "127.0.0.1:50051"
    assert flags.sidecar_listen("localhost:50051") == "localhost:50051"
    for path in ("/run/s.sock", "./s.sock", "s.sock"):
        with pytest.raises(
            flags.FlagValueError, match=re.escape(f"; for a unix socket write unix:{path}") + "$"
        ):
            flags.sidecar_listen(path)
    with pytest.raises(flags.FlagValueError, match=re.escape("loopback only, not '10.1.2.3:50051'")):
        flags.sidecar_listen("10.1.2.3:50051")
    with pytest.raises(flags.FlagValueError, match="has no path"):
        flags.sidecar_listen("unix:")


def test_log_levels_in_any_case() -> None:
    assert [flags.log_level(x) for x in ("debug", "Info", "WARNING")] == ["DEBUG", "INFO", "WARNING"]
    with pytest.raises(flags.FlagValueError):
        flags.log_level("warn")  # Python's logging has no such name: refused here, not by a traceback


def parse(argv: list[str]) -> argparse.Namespace:
    return cli.build_parser().parse_args(argv)


def test_global_flags_before_or_after_the_subcommand() -> None:
    render = ["envoy-config", "--listen", "127.0.0.1:8080", "--sidecar-socket", "s", "--admin-socket", "a"]
    default = parse(render)
    assert (default.log_level, default.log_format) == ("INFO", "text")
    before = parse(["--log-level", "debug", "--log-format", "json", *render])
    after = parse([*render, "--log-level", "debug", "--log-format", "json"])
    assert (before.log_level, before.log_format) == (after.log_level, after.log_format) == ("DEBUG", "json")
    # Given before and not after, the subcommand's parser does not reset it to the default.
    assert parse(["--log-level", "error", *render, "--log-format", "json"]).log_level == "ERROR"


def test_old_spellings_work_and_say_once_what_replaces_them(capsys: pytest.CaptureFixture[str]) -> None:
    cli._warned.clear()
    old = parse(
        ["serve", "--bind", "unix:/run/s.sock", "--etcd", "http://127.0.0.1:2379", "--config", "p.yaml"]
    )
    again = parse(["serve", "--bind", "unix:/run/t.sock", "--etcd", "127.0.0.1:2379"])
    new = parse(["serve", "--listen", "unix:/run/s.sock", "--etcd", "127.0.0.1:2379", "--policy", "p.yaml"])
    assert (old.listen, old.etcd, old.policy) == (new.listen, new.etcd, new.policy)
    assert again.listen == "unix:/run/t.sock"
    assert capsys.readouterr().err.splitlines() == [
        "router-sidecar: --bind is deprecated, use --listen (the old spelling is accepted through the 0.1 "
        "releases)",
        "router-sidecar: --config is deprecated, use --policy (the old spelling is accepted through the 0.1 "
        "releases)",
    ]


def test_help_shows_the_new_spellings_only(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse(["serve", "--help"])
    shown = capsys.readouterr().out
    assert "--listen ADDRESS" in shown and "--policy PATH" in shown
    assert "--bind " not in shown and "--config " not in shown
    assert "(formerly --bind)" in shown and "(formerly --config)" in shown


def test_every_subcommand_has_the_conventional_flags() -> None:
    parser = cli.build_parser()
    subcommands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    listed = [a.dest for a in subcommands._choices_actions]
    assert listed == ["gateway", "serve", "envoy-config", "replica", "trace", "version"]
    options = {
        name: {o for a in subcommands.choices[name]._actions for o in a.option_strings} for name in listed
    }
    assert all({"--log-level", "--log-format", "--help"} <= o for o in options.values())
    assert {"--listen", "--etcd", "--replica", "--policy"} <= options["gateway"] & options["serve"]
    assert {"--listen", "--replica", "--policy"} <= options["envoy-config"]
    assert {"--engine", "--advertise", "--etcd"} <= options["replica"]
    assert "--gateway" in options["trace"]
