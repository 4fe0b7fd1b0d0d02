"""The manifests and the image agree with the product: every `router-sidecar ...` command line in deploy/
(each kustomization and each render of the Helm chart) and the Dockerfile parses with the real CLI parser,
and the Envoy config each gateway Pod renders passes `envoy --mode validate`.

Renders behind an endpoint picker use `--endpoint-picker HOST:PORT` (issue 23, item 2), written at the same
time as the chart: while the CLI does not have that flag, their cases are expected to fail (xfail, strict),
and they run as every other case as soon as it does."""

from __future__ import annotations

import argparse
import contextlib
import io
import re
import shlex
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from router_sidecar.runtime import cli
from router_sidecar.runtime.envoy_config import Endpoint, EnvoyNotFound, find_envoy
from tests.deploy.chart import HELM_RENDERS, RENDERS, values_of
from tests.deploy.kube import REPO, Obj, container, containers, pod_specs

# Values the kubelet would substitute for $(VAR): the Pod IP, or a ConfigMap's value from the render.
POD_IP = "10.244.1.7"
VAR_REF = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def _cli_has_endpoint_picker() -> bool:
    envoy_config = cli.build_parser()._subparsers._group_actions[0].choices["envoy-config"]  # type: ignore[union-attr]
    return any("--endpoint-picker" in a.option_strings for a in envoy_config._actions)


def _behind_endpoint_picker(name: str) -> bool:
    return name == "examples/inferencepool" or bool(values_of(name).get("endpointPicker", {}).get("enabled"))  # type: ignore[union-attr]


ENDPOINT_PICKER_PENDING = pytest.mark.xfail(
    not _cli_has_endpoint_picker(),
    reason="`router-sidecar envoy-config --endpoint-picker HOST:PORT` (issue 23 item 2) is not in the CLI "
    "yet: the chart renders it, the CLI cannot parse it",
    strict=True,
)


def _cases(names: list[str] | tuple[str, ...]) -> list[Any]:
    """The renders as parameters, those behind an endpoint picker marked ENDPOINT_PICKER_PENDING."""
    return [
        pytest.param(n, marks=ENDPOINT_PICKER_PENDING) if _behind_endpoint_picker(n) else n for n in names
    ]


class _Parsed(Exception):
    def __init__(self, namespace: argparse.Namespace, rest: list[str]) -> None:
        self.namespace = namespace
        self.rest = rest


def parse(argv: list[str]) -> argparse.Namespace:
    """Parse `router-sidecar ARGV` with the real parser built by cli.main, stopping before it runs anything.
    argparse errors (missing required flag, a value its type rejects) and unknown arguments fail the test."""
    original = argparse.ArgumentParser.parse_known_args

    def intercept(self: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        if self.prog == "router-sidecar":  # the top-level parser, not a subcommand's
            raise _Parsed(*result)
        return result

    stderr = io.StringIO()
    with (
        pytest.MonkeyPatch.context() as mp,
        contextlib.redirect_stderr(stderr),
        contextlib.redirect_stdout(io.StringIO()),
    ):
        mp.setattr(argparse.ArgumentParser, "parse_known_args", intercept)
        try:
            cli.main(argv)
        except _Parsed as parsed:
            if parsed.rest:
                pytest.fail(f"router-sidecar {shlex.join(argv)}: unrecognized {parsed.rest}")
            return parsed.namespace
        except SystemExit as exc:
            pytest.fail(f"router-sidecar {shlex.join(argv)}: exit {exc.code}: {stderr.getvalue().strip()}")
    pytest.fail(f"router-sidecar {shlex.join(argv)}: the CLI returned before parsing")


def _env_values(c: Obj, objects: list[Obj]) -> dict[str, str]:
    config = {k: v for o in objects if o["kind"] == "ConfigMap" for k, v in o.get("data", {}).items()}
    values = {}
    for e in c.get("env", []):
        source = e.get("valueFrom", {})
        if "value" in e:
            values[e["name"]] = e["value"]
        elif source.get("fieldRef", {}).get("fieldPath") == "status.podIP":
            values[e["name"]] = POD_IP
        elif "configMapKeyRef" in source:
            values[e["name"]] = config[source["configMapKeyRef"]["key"]]
    return values


def manifest_command_lines(objects: list[Obj], kustomization: str) -> Iterator[tuple[str, list[str]]]:
    for workload, spec in pod_specs(objects):
        for c in containers(spec):
            argv = [*c.get("command", []), *c.get("args", [])]
            if argv and argv[0] == "router-sidecar":
                env = _env_values(c, objects)
                argv = [VAR_REF.sub(lambda m, env=env: env[m.group(1)], a) for a in argv]
                yield f"{kustomization}:{workload['metadata']['name']}/{c['name']}", argv[1:]


def dockerfile_command_lines() -> list[list[str]]:
    text = (REPO / "Dockerfile").read_text().replace("\\\n", " ")
    lines = []
    for line in text.splitlines():
        if line.startswith("RUN "):
            for part in line[4:].split("&&"):
                words = shlex.split(part)
                if words and words[0] == "router-sidecar":
                    lines.append(words[1:])
    return lines


def test_manifests_use_every_router_sidecar_container(rendered: dict[str, list[Obj]]) -> None:
    # The gateway Pod's renderer and sidecar, the replica agent (both modes).
    names = {
        name
        for render in ("base", "overlays/replica-front")
        for name, _ in manifest_command_lines(rendered[render], render)
    }
    assert {
        "base:router-sidecar-gateway/envoy-config",
        "base:router-sidecar-gateway/sidecar",
        "base:router-sidecar-replica/replica-agent",
        "overlays/replica-front:router-sidecar-replica/replica-agent",
    } <= names


@pytest.mark.parametrize("render", _cases([r for r in RENDERS if r != "envoy-gateway"]))
def test_manifest_command_lines_parse(rendered: dict[str, list[Obj]], render: str) -> None:
    lines = list(manifest_command_lines(rendered[render], render))
    assert lines
    for where, argv in lines:
        namespace = parse(argv)
        assert namespace.command == argv[0], where
        # --etcd is a free string to argparse; check it as the store will read it.
        if getattr(namespace, "etcd", None):
            _check_etcd(namespace.etcd)
        for attribute in ("engine", "advertise", "front"):
            if getattr(namespace, attribute, None):
                Endpoint.parse(getattr(namespace, attribute))


def _check_etcd(endpoint: str) -> None:
    try:
        from router_sidecar.coordination.store import grpc_target
    except ImportError:  # before --etcd took several members
        Endpoint.parse(endpoint)
    else:
        grpc_target(endpoint)


def test_dockerfile_command_lines_parse() -> None:
    lines = dockerfile_command_lines()
    assert lines, "the Dockerfile's build-time check no longer runs router-sidecar"
    for argv in lines:
        parse(argv)


def test_parse_rejects_what_the_cli_rejects() -> None:
    """The harness itself: an unknown flag and a missing required flag fail."""
    with pytest.raises(pytest.fail.Exception):
        parse(["serve", "--bind", "unix:/x.sock", "--etcd", "e:2379", "--no-such-flag"])
    with pytest.raises(pytest.fail.Exception):
        parse(["replica", "--engine", "127.0.0.1:8000", "--etcd", "e:2379"])


@pytest.mark.parametrize("render", _cases(["base", "examples/inferencepool", *HELM_RENDERS]))
def test_gateway_envoy_config_validates(rendered: dict[str, list[Obj]], render: str, tmp_path: Path) -> None:
    """Run the gateway Pod's init container command (the policy from the render's ConfigMap, the output in
    tmp_path) and validate the result with the Envoy the image ships (here: the checkout's)."""
    try:
        envoy = find_envoy()
    except EnvoyNotFound as exc:
        pytest.skip(str(exc))
    objects = rendered[render]
    _, spec = next((w, s) for w, s in pod_specs(objects) if w["metadata"]["name"] == "router-sidecar-gateway")
    init = container(spec, "envoy-config")
    args = list(init["args"])
    # The policy file is the ConfigMap the init container mounts there.
    policy_path = args[args.index("--policy") + 1]
    (mount,) = [m for m in init["volumeMounts"] if policy_path.startswith(m["mountPath"] + "/")]
    (volume,) = [v for v in spec["volumes"] if v["name"] == mount["name"]]
    (config_map,) = [
        o
        for o in objects
        if o["kind"] == "ConfigMap" and o["metadata"]["name"] == volume["configMap"]["name"]
    ]
    policy = tmp_path / "policy.yaml"
    policy.write_text(config_map["data"][policy_path.removeprefix(mount["mountPath"] + "/")])
    args[args.index("--policy") + 1] = str(policy)
    output = tmp_path / "envoy.yaml"
    args[args.index("--output") + 1] = str(output)
    parse(args)
    with contextlib.redirect_stdout(io.StringIO()):
        assert cli.main(args) == 0
    text = output.read_text()
    # The sockets stay where the Pod mounts them: Envoy dials them, validation does not.
    assert "/run/router-sidecar/sidecar.sock" in text and "/run/router-sidecar/envoy-admin.sock" in text
    result = subprocess.run(
        [envoy, "--mode", "validate", "--disable-hot-restart", "-c", str(output), "--log-level", "error"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr or result.stdout
    envoy_args = container(spec, "envoy")["args"]
    assert envoy_args[envoy_args.index("-c") + 1] == "/etc/envoy-rendered/envoy.yaml"
