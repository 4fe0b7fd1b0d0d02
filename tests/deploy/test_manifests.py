"""deploy/: every kustomization and every render of the Helm chart (its defaults and each values file beside
it) renders, every object passes the Kubernetes 1.32 schemas (strict; custom resources their CRDs'), and the
objects agree with each other (selectors, ports, ConfigMaps, env references, security settings)."""

from __future__ import annotations

import re
from typing import Any

import kubernetes_validate
import pytest

from router_sidecar.core.fingerprint import load_fingerprint_file
from router_sidecar.core.policy import load_policy
from tests.deploy import crd
from tests.deploy.chart import HELM_RENDERS, RENDERS, values_of
from tests.deploy.kube import (
    DEPLOY,
    KUSTOMIZATIONS,
    REPO,
    Obj,
    container,
    containers,
    find,
    pod_specs,
    pod_template,
)

KUBERNETES_VERSION = "1.32.0"

# Custom resources have no schema in kubernetes-validate: those with a vendored CRD (tests/deploy/crds/) are
# validated against it; Envoy Gateway's are checked in test_envoy_gateway.py. Any other kind must validate.
CUSTOM_KINDS = {
    ("gateway.networking.k8s.io/v1", "HTTPRoute"),
    ("gateway.envoyproxy.io/v1alpha1", "EnvoyExtensionPolicy"),
    ("gateway.envoyproxy.io/v1alpha1", "EnvoyPatchPolicy"),
}

LABELS = ("app.kubernetes.io/name", "app.kubernetes.io/component", "app.kubernetes.io/part-of")
VAR_REF = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def test_every_kustomization_is_tested() -> None:
    on_disk = {
        str(p.parent.relative_to(DEPLOY))
        for p in DEPLOY.rglob("kustomization.yaml")
        if "components" not in p.parts
    }
    assert on_disk == set(KUSTOMIZATIONS)


# Renders of our own objects (the Envoy Gateway example attaches to the user's Gateway, in their namespaces).
OWN = [r for r in RENDERS if r != "envoy-gateway"]
# Renders with the etcd StatefulSet: the overlays that add its component, and the chart unless told not to.
WITH_ETCD = [
    "overlays/etcd-statefulset",
    "overlays/replica-front",
    "examples/inferencepool",
    *(r for r in HELM_RENDERS if values_of(r).get("etcd", {}).get("enabled", True)),  # type: ignore[union-attr]
]


@pytest.mark.parametrize("kustomization", RENDERS)
def test_schemas_strict(rendered: dict[str, list[Obj]], kustomization: str) -> None:
    objects = rendered[kustomization]
    assert objects, f"deploy/{kustomization} rendered nothing"
    errors = []
    for obj in objects:
        if (obj["apiVersion"], obj["kind"]) in CUSTOM_KINDS:
            continue
        if crd.known(obj):
            errors += [f"{obj['kind']}/{obj['metadata']['name']} at {e}" for e in crd.validate(obj)]
            continue
        try:
            # The version actually used must be 1.32 itself, not an older fallback.
            used = kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
            assert used == "1.32"
        except kubernetes_validate.ValidationError as exc:
            path = "/".join(str(p) for p in exc.path)
            errors.append(f"{obj['kind']}/{obj['metadata']['name']} at {path}: {exc.message}")
        except kubernetes_validate.utils.SchemaNotFoundError as exc:
            errors.append(exc.message)
    assert not errors, "\n".join(errors)


def test_validator_is_strict() -> None:
    """A misspelt field must fail: otherwise the schema test proves nothing."""
    bad = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "x"},
        "spec": {"ports": [{"port": 80}], "selectr": {"a": "b"}},
    }
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, KUBERNETES_VERSION, strict=True)


@pytest.mark.parametrize("name", RENDERS)
def test_recommended_labels(rendered: dict[str, list[Obj]], name: str) -> None:
    objects = rendered[name]
    for obj in objects:
        if obj["kind"] == "Namespace":
            continue
        labels = obj["metadata"].get("labels", {})
        missing = [k for k in LABELS if k not in labels]
        assert not missing, f"{name}: {obj['kind']}/{obj['metadata']['name']} lacks {missing}"
        assert labels["app.kubernetes.io/part-of"] == "router-sidecar"
    for workload, _ in pod_specs(objects):
        template_labels = pod_template(workload)["metadata"]["labels"]
        assert all(k in template_labels for k in LABELS), workload["metadata"]["name"]


CLUSTER_SCOPED = frozenset({"Namespace", "ClusterRole", "ClusterRoleBinding", "GatewayClass"})


@pytest.mark.parametrize("name", OWN)
def test_every_namespaced_object_is_in_the_namespace(rendered: dict[str, list[Obj]], name: str) -> None:
    """A component's objects get no namespace from the base's kustomization: without the overlay's own,
    `kubectl apply -k` would put etcd in whatever namespace is current, where the gateways never find it.
    The chart's objects name the release's namespace (`helm template | kubectl apply` keeps them there)."""
    objects = rendered[name]
    for obj in objects:
        where = obj["metadata"].get("namespace")
        what = f"{name}: {obj['kind']}/{obj['metadata']['name']} in {where}"
        assert obj["kind"] in CLUSTER_SCOPED or where == "router-sidecar", what


def _selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def _pod_labels(objects: list[Obj]) -> list[tuple[Obj, dict[str, str]]]:
    return [(w, pod_template(w)["metadata"]["labels"]) for w, _ in pod_specs(objects)]


@pytest.mark.parametrize("kustomization", OWN)
def test_selectors_and_ports_agree(rendered: dict[str, list[Obj]], kustomization: str) -> None:
    objects = rendered[kustomization]
    pods = _pod_labels(objects)
    for workload, _ in pod_specs(objects):
        if workload["kind"] in {"Job", "CronJob"}:
            continue  # the Job controller writes their selector
        selector = workload["spec"]["selector"]["matchLabels"]
        assert _selects(selector, pod_template(workload)["metadata"]["labels"])
    for service in (o for o in objects if o["kind"] == "Service"):
        targets = [w for w, labels in pods if _selects(service["spec"]["selector"], labels)]
        assert targets, f"Service {service['metadata']['name']} selects no Pod"
        for workload in targets:
            spec = workload["spec"]["template"]["spec"]
            named = {p["name"]: p["containerPort"] for c in containers(spec) for p in c.get("ports", [])}
            for port in service["spec"]["ports"]:
                target = port.get("targetPort", port["port"])
                if isinstance(target, str):
                    assert target in named, f"{service['metadata']['name']}: no container port {target!r}"
                else:
                    assert target in named.values()
    for kind in ("PodDisruptionBudget", "NetworkPolicy"):
        for obj in (o for o in objects if o["kind"] == kind):
            selector = (obj["spec"].get("selector") or obj["spec"]["podSelector"])["matchLabels"]
            assert any(_selects(selector, labels) for _, labels in pods), f"{kind} {obj['metadata']['name']}"


def _config_maps(objects: list[Obj]) -> dict[str, Obj]:
    return {o["metadata"]["name"]: o for o in objects if o["kind"] == "ConfigMap"}


@pytest.mark.parametrize("kustomization", OWN)
def test_references_resolve(rendered: dict[str, list[Obj]], kustomization: str) -> None:
    """ConfigMaps named by volumes and env exist (kustomize rewrote the hashed names), and every $(VAR) in a
    command line is defined in that container's env: Kubernetes leaves an unknown one as literal text."""
    objects = rendered[kustomization]
    config_maps = _config_maps(objects)
    for workload, spec in pod_specs(objects):
        for volume in spec.get("volumes", []):
            if "configMap" in volume:
                assert volume["configMap"]["name"] in config_maps
        for c in containers(spec):
            env = {e["name"]: e for e in c.get("env", [])}
            for e in env.values():
                ref = e.get("valueFrom", {}).get("configMapKeyRef")
                if ref:
                    assert ref["key"] in config_maps[ref["name"]]["data"], ref
            for arg in [*c.get("command", []), *c.get("args", [])]:
                for var in VAR_REF.findall(arg):
                    assert var in env, f"{workload['metadata']['name']}/{c['name']}: $({var}) undefined"


_RESTRICTED = {
    "allowPrivilegeEscalation": False,
    "readOnlyRootFilesystem": True,
    "runAsNonRoot": True,
    "capabilities": {"drop": ["ALL"]},
    "seccompProfile": {"type": "RuntimeDefault"},
}


@pytest.mark.parametrize("kustomization", OWN)
def test_pods_are_locked_down(rendered: dict[str, list[Obj]], kustomization: str) -> None:
    for workload, spec in pod_specs(rendered[kustomization]):
        name = workload["metadata"]["name"]
        assert spec["securityContext"]["runAsNonRoot"] is True, name
        assert spec["securityContext"]["runAsUser"] != 0, name
        assert spec.get("automountServiceAccountToken") is False, name
        assert not spec.get("hostNetwork") and not spec.get("hostPID"), name
        assert not any("hostPath" in v for v in spec.get("volumes", [])), name
        for c in containers(spec):
            assert c["securityContext"] == _RESTRICTED, f"{name}/{c['name']}"
            assert c["resources"]["requests"] and c["resources"]["limits"]["memory"], f"{name}/{c['name']}"
            # A full registry path: the kustomize `images:` override was applied (values-kustomize.yaml
            # names them bare for that override to replace).
            if kustomization != "helm/values-kustomize.yaml":
                assert c["image"].count("/") >= 2 and ":" in c["image"], f"{name}/{c['name']}: {c['image']}"


@pytest.mark.parametrize("name", ["base", "examples/inferencepool", *HELM_RENDERS])
def test_gateway_pod_wiring(rendered: dict[str, list[Obj]], name: str) -> None:
    """The init container, the native sidecar and Envoy agree on the sockets, the rendered config's path and
    the listener port; the sidecar gates Envoy's start with a startupProbe; probes hit the right paths."""
    _, spec = next((w, s) for w, s in pod_specs(rendered[name]) if w["metadata"]["name"].endswith("gateway"))
    init = container(spec, "envoy-config")
    sidecar = container(spec, "sidecar")
    envoy = container(spec, "envoy")
    assert [c["name"] for c in spec["initContainers"]] == ["envoy-config", "sidecar"]
    assert "restartPolicy" not in init and sidecar["restartPolicy"] == "Always"
    assert "startupProbe" in sidecar and "livenessProbe" in sidecar

    def flag(c: Obj, name: str) -> str:
        args = c["args"]
        return args[args.index(name) + 1]

    bind = flag(sidecar, "--listen")
    assert bind == "unix:" + flag(init, "--sidecar-socket")
    probe = " ".join(sidecar["startupProbe"]["exec"]["command"])
    assert repr(flag(init, "--sidecar-socket")) in probe
    assert flag(envoy, "-c") == flag(init, "--output")
    assert "--disable-hot-restart" in envoy["args"]

    def mounted(c: Obj, path: str) -> str:
        mounts = [m for m in c.get("volumeMounts", []) if path.startswith(m["mountPath"].rstrip("/") + "/")]
        assert mounts, f"{c['name']} does not mount {path}"
        return str(mounts[0]["name"])

    for path in (flag(init, "--sidecar-socket"), flag(init, "--admin-socket")):
        assert mounted(sidecar, path) == mounted(envoy, path)
    assert mounted(init, flag(init, "--output")) == mounted(envoy, flag(envoy, "-c"))
    assert mounted(init, flag(init, "--policy")) == mounted(sidecar, flag(sidecar, "--policy"))
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert "emptyDir" in volumes[mounted(envoy, flag(init, "--sidecar-socket"))]

    port = int(flag(init, "--listen").rpartition(":")[2])
    (http,) = envoy["ports"]
    assert http["containerPort"] == port
    assert envoy["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": http["name"]}
    assert envoy["livenessProbe"]["httpGet"] == {"path": "/livez", "port": http["name"]}


def _etcd_endpoint(objects: list[Obj]) -> str:
    (cm,) = [o for o in objects if o["kind"] == "ConfigMap" and "ROUTER_SIDECAR_ETCD" in o.get("data", {})]
    return str(cm["data"]["ROUTER_SIDECAR_ETCD"])


@pytest.mark.parametrize("name", WITH_ETCD)
def test_etcd_statefulset(rendered: dict[str, list[Obj]], name: str) -> None:
    objects = rendered[name]
    sts = find(objects, "StatefulSet", "router-sidecar-etcd")
    replicas = sts["spec"]["replicas"]
    assert replicas >= 3 and replicas % 2 == 1, "an odd member count: quorum survives (n - 1) / 2 down"
    (etcd,) = sts["spec"]["template"]["spec"]["containers"]
    flags = dict(a.removeprefix("--").split("=", 1) for a in etcd["args"])
    assert flags["auto-compaction-mode"] == "periodic" and flags["auto-compaction-retention"]
    assert int(flags["quota-backend-bytes"]) > 0
    peer_service = find(objects, "Service", sts["spec"]["serviceName"])
    assert peer_service["spec"]["clusterIP"] == "None" and peer_service["spec"]["publishNotReadyAddresses"]
    # --initial-cluster names exactly the StatefulSet's members, at their peer Service DNS names.
    members = dict(m.split("=", 1) for m in flags["initial-cluster"].split(","))
    name, peers = sts["metadata"]["name"], sts["spec"]["serviceName"]
    assert set(members) == {f"{name}-{i}" for i in range(replicas)}
    for member, url in members.items():
        assert url == f"http://{member}.{peers}.$(POD_NAMESPACE).svc:2380"
    # The gateways' endpoint is the client Service.
    host, _, port = _etcd_endpoint(objects).rpartition(":")
    client = find(objects, "Service", host)
    assert int(port) in [p["port"] for p in client["spec"]["ports"]]
    # Quorum: a PDB never lets two members go at once.
    assert find(objects, "PodDisruptionBudget", name)["spec"]["maxUnavailable"] == 1


def _etcd_admitted(objects: list[Obj]) -> dict[int, set[str]]:
    """Port -> the workloads whose Pods the etcd NetworkPolicy admits to it."""
    policy = find(objects, "NetworkPolicy", "router-sidecar-etcd")
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    pods = {w["metadata"]["name"]: labels for w, labels in _pod_labels(objects)}
    admitted: dict[int, set[str]] = {}
    for rule in policy["spec"]["ingress"]:
        assert all(set(peer) == {"podSelector"} for peer in rule["from"]), "no namespace/IP-wide rule"
        sources = {
            name
            for peer in rule["from"]
            for name, labels in pods.items()
            if _selects(peer["podSelector"]["matchLabels"], labels)
        }
        for port in rule["ports"]:
            admitted.setdefault(port["port"], set()).update(sources)
    return admitted


@pytest.mark.parametrize("name", WITH_ETCD)
def test_etcd_network_policy_admits_only_gateways_agents_defrag_and_peers(
    rendered: dict[str, list[Obj]], name: str
) -> None:
    admitted = _etcd_admitted(rendered[name])
    # Every replica set's agents register in etcd: the chart's own and each pool's (values-fallback.yaml).
    pools = [f"router-sidecar-replica-{p['name']}" for p in values_of(name).get("replicaPools", [])]  # type: ignore[attr-defined]
    assert admitted == {
        2379: {
            "router-sidecar-gateway",
            "router-sidecar-replica",
            *pools,
            "router-sidecar-etcd-defrag",
            "router-sidecar-etcd",
        },
        2380: {"router-sidecar-etcd"},
    }


def _go_duration_seconds(text: str) -> int:
    units = {"s": 1, "m": 60, "h": 3600}
    parts = re.fullmatch(r"(?:\d+[hms])+", text) and re.findall(r"(\d+)([hms])", text)
    assert parts, f"not a duration: {text!r}"
    return sum(int(n) * units[u] for n, u in parts)


def _etcdctl(c: Obj) -> tuple[dict[str, str], list[str]]:
    """An etcdctl container's --flag=value options and its other words."""
    assert c["command"] == ["etcdctl"], c["name"]
    flags = dict(a.removeprefix("--").split("=", 1) for a in c["args"] if a.startswith("--") and "=" in a)
    words = [a for a in c["args"] if not (a.startswith("--") and "=" in a)]
    return flags, words


@pytest.mark.parametrize("kustomization", RENDERS)
def test_etcd_defrag_cronjob(rendered: dict[str, list[Obj]], kustomization: str) -> None:
    """Where the etcd StatefulSet is, and only there: daily, never two runs at once; every member, one at a
    time, each only after every member answered a status request; with the members' own image (etcdctl);
    admitted by the NetworkPolicy to 2379 only."""
    objects = rendered[kustomization]
    crons = [o for o in objects if o["kind"] == "CronJob"]
    if not any(o["kind"] == "StatefulSet" for o in objects):
        assert not crons
        return
    assert len(crons) == 1
    sts = find(objects, "StatefulSet", "router-sidecar-etcd")
    (etcd,) = sts["spec"]["template"]["spec"]["containers"]
    cron = find(objects, "CronJob", "router-sidecar-etcd-defrag")
    minute, hour, *rest = cron["spec"]["schedule"].split()
    assert minute.isdigit() and hour.isdigit() and rest == ["*", "*", "*"], "once a day at a fixed time"
    assert cron["spec"]["concurrencyPolicy"] == "Forbid"
    job = cron["spec"]["jobTemplate"]["spec"]
    assert 0 < job["backoffLimit"] <= 3
    spec = pod_template(cron)["spec"]
    assert spec["restartPolicy"] == "Never", "a failed step fails the Pod: the next member is not touched"
    steps = list(containers(spec))
    assert {c["image"] for c in steps} == {etcd["image"]}

    # The steps alternate: a cluster-wide status check, then one member's defrag; a final status.
    name, peers, replicas = sts["metadata"]["name"], sts["spec"]["serviceName"], sts["spec"]["replicas"]
    client = find(objects, "Service", name)
    client_port = next(p["port"] for p in client["spec"]["ports"] if p["name"] == "client")
    peer_port = next(
        p["port"] for p in find(objects, "Service", peers)["spec"]["ports"] if p["name"] == "client"
    )
    defragged, timeouts = [], []
    for i, c in enumerate(steps):
        flags, words = _etcdctl(c)
        if i % 2 == 0:
            assert words == ["endpoint", "status", "--cluster"], c["name"]
            assert flags["endpoints"] == f"http://{name}:{client_port}", c["name"]
        else:
            assert words == ["defrag"], c["name"]
            assert "--cluster" not in c["args"]
            defragged.append(flags["endpoints"])
            timeouts.append(_go_duration_seconds(flags["command-timeout"]))
    assert len(steps) == 2 * replicas + 1 and steps[-1] in spec["containers"]
    assert defragged == [f"http://{name}-{i}.{peers}:{peer_port}" for i in range(replicas)]
    # The client waits for a whole defrag (one it gave up on would still run when the next one starts), and
    # the deadline leaves room for all of them.
    assert min(timeouts) >= 300
    assert job["activeDeadlineSeconds"] > sum(timeouts)

    # Its Pods are not etcd members to the Services, the PDB or the anti-affinity, and reach etcd's client
    # port only.
    labels = pod_template(cron)["metadata"]["labels"]
    assert not _selects(sts["spec"]["selector"]["matchLabels"], labels)
    admitted = _etcd_admitted(objects)
    assert cron["metadata"]["name"] in admitted[2379]
    assert cron["metadata"]["name"] not in admitted[2380]


def _without_etcd_config(objects: list[Obj]) -> list[Any]:
    """The render with the etcd ConfigMap's name and data masked."""
    text = repr(sorted(repr(o) for o in objects))
    for cm in _config_maps(objects):
        if cm.startswith("router-sidecar-etcd"):
            text = text.replace(cm, "ETCD-CONFIGMAP")
    return [text.replace(_etcd_endpoint(objects), "ETCD")]


def test_external_etcd_changes_only_the_endpoint(rendered: dict[str, list[Obj]]) -> None:
    base, external = rendered["base"], rendered["overlays/etcd-external"]
    assert _etcd_endpoint(external) != _etcd_endpoint(base)
    assert _without_etcd_config(external) == _without_etcd_config(base)


@pytest.mark.parametrize(
    ("name", "without"),
    [("overlays/replica-front", "base"), ("helm/values-replica-front.yaml", "helm/defaults")],
)
def test_replica_front_overlay(rendered: dict[str, list[Obj]], name: str, without: str) -> None:
    objects = rendered[name]
    _, spec = next((w, s) for w, s in pod_specs(objects) if w["metadata"]["name"].endswith("replica"))
    agent, engine = container(spec, "replica-agent"), container(spec, "engine")
    args = agent["args"]
    front = args[args.index("--front") + 1]
    advertise = args[args.index("--advertise") + 1]
    front_port = front.rpartition(":")[2]
    assert advertise == f"$(POD_IP):{front_port}"
    assert int(front_port) in [p["containerPort"] for p in agent["ports"]]
    # The engine is reachable only through the fence.
    assert engine["args"][engine["args"].index("--host") + 1] == "127.0.0.1"
    policy = find(objects, "NetworkPolicy", "router-sidecar-replica")
    assert [p["port"] for p in policy["spec"]["ingress"][0]["ports"]] == [int(front_port)]
    # Without the overlay, gateways reach the engine itself at the advertised port.
    _, plain = next(
        (w, s) for w, s in pod_specs(rendered[without]) if w["metadata"]["name"].endswith("replica")
    )
    plain_args = container(plain, "replica-agent")["args"]
    assert "--front" not in plain_args
    assert plain_args[plain_args.index("--advertise") + 1] == "$(POD_IP):8000"


def test_policy_copy_is_the_example() -> None:
    copy = DEPLOY / "base" / "policy.yaml"
    assert copy.read_bytes() == (REPO / "policy.example.yaml").read_bytes(), (
        "deploy/base/policy.yaml must be policy.example.yaml: cp policy.example.yaml deploy/base/policy.yaml"
    )
    load_policy(str(copy))


def test_fingerprint_file_loads(rendered: dict[str, list[Obj]]) -> None:
    fingerprint = load_fingerprint_file(DEPLOY / "base" / "fingerprint.yaml")
    # The engine serves the model the file declares (the agent refuses to register a disagreement).
    _, spec = next(
        (w, s) for w, s in pod_specs(rendered["base"]) if w["metadata"]["name"].endswith("replica")
    )
    assert container(spec, "engine")["args"][1] == fingerprint.model_id
