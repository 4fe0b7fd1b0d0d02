"""The Helm chart (deploy/helm/router-sidecar) with the pinned helm: `helm lint --strict`, its values schema
and its refusals, its defaults (the policy and fingerprint examples), releases that do not collide, the etcd
member count, the ServiceMonitor, and the endpoint picker (an address, or the EPP in the gateway Pod with its
InferencePool). The checks every render shares (schemas, labels, namespace, lock-down, wiring, CLI, Envoy)
are in test_manifests.py and test_cli_agreement.py, parametrized over the chart's renders too."""

from __future__ import annotations

import hashlib
import re
import subprocess
from typing import Any

import kubernetes_validate
import pytest
import yaml

from router_sidecar.core.fingerprint import load_fingerprint_file
from router_sidecar.core.policy import load_policy
from tests.deploy import crd
from tests.deploy import test_cli_agreement as cli_agreement
from tests.deploy import test_manifests as manifests
from tests.deploy.chart import (
    CHART,
    HELM_DIR,
    NAMESPACE,
    RELEASE,
    VALUES_FILES,
    helm,
    pin,
    render,
    run_helm,
    template,
)
from tests.deploy.kube import REPO, Obj, container, containers, find, pod_specs, pod_template
from tests.deploy.test_manifests import KUBERNETES_VERSION

VALUES = yaml.safe_load((CHART / "values.yaml").read_text())


def _gateway(objects: list[Obj], release: str = RELEASE) -> Obj:
    _, spec = next((w, s) for w, s in pod_specs(objects) if w["metadata"]["name"] == f"{release}-gateway")
    return spec


def _flag(c: Obj, name: str) -> str:
    args = c["args"]
    assert name in args, f"{c['name']}: no {name}"
    return str(args[args.index(name) + 1])


def _selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


# -- the tool ---------------------------------------------------------------------------------------------


def test_helm_is_the_pinned_binary() -> None:
    version, digest = pin()
    binary = helm()
    assert run_helm("version", "--short").stdout.startswith(f"v{version}+")
    with open(binary, "rb") as f:
        assert hashlib.sha256(f.read()).hexdigest() == digest


def test_vendored_crds_are_the_recorded_ones() -> None:
    readme = (crd.CRDS / "README.md").read_text()
    files = sorted(crd.CRDS.glob("*.yaml"))
    assert files
    for path in files:
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
        assert f"`{path.name}`" in readme and digest in readme, f"{path.name}: record its source and sha256"
    assert set(crd.schemas()) == {
        ("inference.networking.k8s.io/v1", "InferencePool"),
        ("monitoring.coreos.com/v1", "ServiceMonitor"),
    }


# -- lint and values --------------------------------------------------------------------------------------


@pytest.mark.parametrize("values", [None, *VALUES_FILES])
def test_lint_strict(values: str | None) -> None:
    args = ["lint", "--strict", str(CHART), "--namespace", NAMESPACE, "--kube-version", KUBERNETES_VERSION]
    if values:
        args += ["--values", str(HELM_DIR / values)]
    result = run_helm(*args, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 chart(s) failed" in result.stdout


@pytest.mark.parametrize(
    ("sets", "message"),
    [
        (("gateway.replicacount=3",), "additional properties 'replicacount' not allowed"),
        (("etcd.enabled=false",), "set etcd.endpoints"),
        (("etcd.endpoints=e:2379",), "endpoints is for an etcd you run"),
        (("etcd.enabled=false", "etcd.endpoints=https://e:2379"), "etcd/endpoints"),
        (("endpointPicker.enabled=true",), "set endpointPicker.address"),
        (("endpointPicker.container.enabled=true",), "needs endpointPicker.enabled=true"),
        (
            (
                "endpointPicker.enabled=true",
                "endpointPicker.container.enabled=true",
                "endpointPicker.address=a:1",
            ),
            "not both",
        ),
        (("endpointPicker.enabled=true", "endpointPicker.address=no-port"), "endpointPicker/address"),
        (("inferencePool.create=true", "replica.enabled=false"), "needs replica.enabled=true"),
        (("replicaPools[0].name=big",), "missing property 'fingerprint'"),
        (("replicaPools[0].name=Big", "replicaPools[0].fingerprint.block_size=16"), "replicaPools/0/name"),
        (
            (
                "replicaPools[0].name=big",
                "replicaPools[0].fingerprint.block_size=16",
                "replicaPools[1].name=big",
                "replicaPools[1].fingerprint.block_size=16",
            ),
            'the name "big" is given twice',
        ),
        (
            (
                "replicaPools[0].name=big",
                "replicaPools[0].fingerprint.block_size=16",
                "replica.enabled=false",
            ),
            "they need replica.enabled=true",
        ),
        (("image.digest=sha256:abc",), "image/digest"),
    ],
)
def test_bad_values_are_refused_with_the_key(sets: tuple[str, ...], message: str) -> None:
    result = template(sets=sets, check=False)
    assert result.returncode != 0, f"{sets} rendered"
    assert message in result.stderr, result.stderr


def test_default_policy_is_the_example() -> None:
    """values.yaml carries policy.example.yaml, comments and all (indented under `policy:`); the sidecar
    loads the ConfigMap the chart renders from it."""
    example = (REPO / "policy.example.yaml").read_text().rstrip("\n").split("\n")
    block = "\n".join(("  " + line).rstrip() for line in example)
    assert "\npolicy:\n" + block + "\n" in (CHART / "values.yaml").read_text(), (
        "values.yaml's policy must be policy.example.yaml indented by two spaces"
    )
    cm = find(render(), "ConfigMap", f"{RELEASE}-policy")
    rendered = yaml.safe_load(cm["data"]["policy.yaml"])
    assert rendered == yaml.safe_load("\n".join(example))
    assert load_policy_text(cm["data"]["policy.yaml"]) == load_policy(str(REPO / "policy.example.yaml"))


def load_policy_text(text: str) -> Any:
    import tempfile

    with tempfile.NamedTemporaryFile("w", suffix=".yaml") as f:
        f.write(text)
        f.flush()
        return load_policy(f.name)


def test_default_fingerprint_is_the_example(tmp_path: Any) -> None:
    example = (REPO / "fingerprint.example.yaml").read_text().rstrip("\n").split("\n")
    block = "\n".join(("    " + line).rstrip() for line in example)
    assert "\n  fingerprint:\n" + block + "\n" in (CHART / "values.yaml").read_text()
    cm = find(render(), "ConfigMap", f"{RELEASE}-fingerprint")
    path = tmp_path / "fingerprint.yaml"
    path.write_text(cm["data"]["fingerprint.yaml"])
    fingerprint = load_fingerprint_file(path)
    assert fingerprint == load_fingerprint_file(REPO / "fingerprint.example.yaml")
    # The engine serves the model the fingerprint declares.
    assert container(_replica(render()), "engine")["args"][1] == fingerprint.model_id


def _replica(objects: list[Obj], release: str = RELEASE) -> Obj:
    _, spec = next((w, s) for w, s in pod_specs(objects) if w["metadata"]["name"] == f"{release}-replica")
    return spec


# -- a fallback pool ---------------------------------------------------------------------------------------


def test_fallback_values_render_a_primary_and_a_fallback_pool_and_the_policy(tmp_path: Any) -> None:
    """values-fallback.yaml: the primary pool (the chart's replica Deployment) and a fallback pool of another
    model (replicaPools: its own Deployment, agents, fingerprint and NetworkPolicy), and the gateways' policy
    falling back to that model. Gateways find both pools in the registry (no --replica), each agent
    registers its engine's model as its fingerprint declares it, and the two Deployments never select each
    other's Pods."""
    values = yaml.safe_load((HELM_DIR / "values-fallback.yaml").read_text())
    objects = render("values-fallback.yaml")
    fallback_model = "Qwen/Qwen2.5-1.5B-Instruct"

    policy = load_policy_text(find(objects, "ConfigMap", f"{RELEASE}-policy")["data"]["policy.yaml"])
    assert policy.fallback.models == (fallback_model,)
    assert policy.fallback.causes == {
        "failed_before_content",
        "overloaded",
        "no_compatible_replica",
        "unavailable",
    }
    assert "--replica" not in container(_gateway(objects), "envoy-config")["args"]  # discovery

    primary = find(objects, "Deployment", f"{RELEASE}-replica")
    pool = find(objects, "Deployment", f"{RELEASE}-replica-fallback")
    assert (primary["spec"]["replicas"], pool["spec"]["replicas"]) == (2, 1)
    served = {}
    for workload, configmap in (
        (primary, f"{RELEASE}-fingerprint"),
        (pool, f"{RELEASE}-fingerprint-fallback"),
    ):
        spec = pod_template(workload)["spec"]
        engine, agent = container(spec, "engine"), container(spec, "replica-agent")
        volume = next(v for v in spec["volumes"] if v["name"] == "fingerprint")
        assert volume["configMap"]["name"] == configmap
        path = tmp_path / f"{configmap}.yaml"
        path.write_text(find(objects, "ConfigMap", configmap)["data"]["fingerprint.yaml"])
        # The agent refuses to register an engine whose model its fingerprint does not declare.
        assert _flag(agent, "--fingerprint") == "/etc/router-sidecar/fingerprint.yaml"
        assert engine["args"][:2] == ["serve", load_fingerprint_file(path).model_id]
        served[workload["metadata"]["name"]] = engine["args"][1]
        # The rest is the primary's: the same image, port and resources.
        assert engine["image"] == container(_replica(objects), "engine")["image"]
    assert served == {
        f"{RELEASE}-replica": "Qwen/Qwen2.5-0.5B-Instruct",
        f"{RELEASE}-replica-fallback": fallback_model,
    }
    assert values["policy"]["fallback"]["models"] == [served[f"{RELEASE}-replica-fallback"]]

    # Neither Deployment selects the other's Pods; each set's NetworkPolicy admits the gateways to its port.
    pods = {w["metadata"]["name"]: pod_template(w)["metadata"]["labels"] for w in (primary, pool)}
    for workload in (primary, pool):
        selector = workload["spec"]["selector"]["matchLabels"]
        assert [n for n, labels in pods.items() if _selects(selector, labels)] == [
            workload["metadata"]["name"]
        ]
        rule = find(objects, "NetworkPolicy", workload["metadata"]["name"])["spec"]
        assert [n for n, labels in pods.items() if _selects(rule["podSelector"]["matchLabels"], labels)] == [
            workload["metadata"]["name"]
        ]
        [ingress] = rule["ingress"]
        gateway_labels = pod_template(find(objects, "Deployment", f"{RELEASE}-gateway"))["metadata"]["labels"]
        assert _selects(ingress["from"][0]["podSelector"]["matchLabels"], gateway_labels)
        advertise = _flag(container(pod_template(workload)["spec"], "replica-agent"), "--advertise")
        assert [p["port"] for p in ingress["ports"]] == [int(advertise.rpartition(":")[2])]

    # A change of the pool's fingerprint rolls the pool only: the primary's engines keep their loaded model.
    def fingerprint_checksums(objects: list[Obj]) -> list[str]:
        return [
            pod_template(find(objects, "Deployment", name))["metadata"]["annotations"]["checksum/fingerprint"]
            for name in (f"{RELEASE}-replica", f"{RELEASE}-replica-fallback")
        ]

    before = fingerprint_checksums(objects)
    after = fingerprint_checksums(
        render("values-fallback.yaml", sets=("replicaPools[0].fingerprint.block_size=32",))
    )
    assert after[0] == before[0] and after[1] != before[1]


# -- Helm's own conventions -------------------------------------------------------------------------------


def test_helm_labels_and_rollouts() -> None:
    """Objects carry Helm's labels; a policy change rolls the gateways (not the replicas), a fingerprint
    change the replicas (not the gateways), an etcd endpoint change both."""
    objects = render()
    for obj in objects:
        labels = obj["metadata"]["labels"]
        assert (
            labels["app.kubernetes.io/managed-by"] == "Helm"
            and labels["helm.sh/chart"] == "router-sidecar-0.1.0"
        )
        assert labels["app.kubernetes.io/instance"] == RELEASE

    def checksums(objects: list[Obj]) -> dict[str, dict[str, str]]:
        return {
            w["metadata"]["name"]: {
                k: v
                for k, v in pod_template(w)["metadata"]["annotations"].items()
                if k.startswith("checksum/")
            }
            for w, _ in pod_specs(objects)
            if w["kind"] == "Deployment"
        }

    before = checksums(objects)
    policy = checksums(render(sets=("policy.deadlines.request_seconds=120",)))
    fingerprint = checksums(render(sets=("replica.fingerprint.block_size=32",)))
    gateway, replica = f"{RELEASE}-gateway", f"{RELEASE}-replica"
    assert policy[gateway] != before[gateway] and policy[replica] == before[replica]
    assert fingerprint[replica] != before[replica] and fingerprint[gateway] == before[gateway]
    external = checksums(render("values-external-etcd.yaml"))
    assert all(external[w]["checksum/etcd"] != before[w]["checksum/etcd"] for w in (gateway, replica))


def test_two_releases_in_one_namespace_do_not_collide() -> None:
    """Names carry the release; selectors carry app.kubernetes.io/instance, so one release's Services,
    PodDisruptionBudgets and NetworkPolicies never select the other's Pods."""
    a, b = render(release="alpha"), render(release="beta")
    names_a = {(o["kind"], o["metadata"]["name"]) for o in a}
    names_b = {(o["kind"], o["metadata"]["name"]) for o in b}
    assert not names_a & names_b
    pods_b = [pod_template(w)["metadata"]["labels"] for w, _ in pod_specs(b)]
    for obj in a:
        spec = obj.get("spec", {})
        selector = spec.get("selector") if obj["kind"] == "Service" else None
        if obj["kind"] in {"PodDisruptionBudget", "Deployment", "StatefulSet"}:
            selector = spec["selector"]["matchLabels"]
        if obj["kind"] == "NetworkPolicy":
            selector = spec["podSelector"]["matchLabels"]
        if selector:
            assert not any(_selects(selector, labels) for labels in pods_b), obj["metadata"]["name"]
    # Everything the release refers to is its own: the etcd endpoint, the ConfigMaps, the member names.
    etcd = find(a, "ConfigMap", "alpha-router-sidecar-etcd")
    assert etcd["data"]["ROUTER_SIDECAR_ETCD"] == "alpha-router-sidecar-etcd:2379"
    find(a, "Service", "alpha-router-sidecar-etcd")
    find(a, "ConfigMap", "alpha-router-sidecar-policy")


def test_release_namespace_everywhere() -> None:
    objects = render(namespace="llm-serving")
    assert {o["metadata"]["namespace"] for o in objects} == {"llm-serving"}


@pytest.mark.parametrize("members", [1, 5])
def test_etcd_member_count(members: int) -> None:
    """etcd.replicaCount sizes the StatefulSet, --initial-cluster, the defrag steps and their deadline."""
    objects = render(sets=(f"etcd.replicaCount={members}",))
    sts = find(objects, "StatefulSet", f"{RELEASE}-etcd")
    assert sts["spec"]["replicas"] == members
    if members >= 3:
        manifests.test_etcd_statefulset({"x": objects}, "x")
    (etcd,) = sts["spec"]["template"]["spec"]["containers"]
    cluster = next(a for a in etcd["args"] if a.startswith("--initial-cluster="))
    assert cluster.count("=http://") == members
    manifests.test_etcd_defrag_cronjob({"x": objects}, "x")


def test_etcd_persistence_and_quota() -> None:
    objects = render(sets=("etcd.persistence.storageClassName=fast", "etcd.quotaBackendBytes=4294967296"))
    sts = find(objects, "StatefulSet", f"{RELEASE}-etcd")
    (claim,) = sts["spec"]["volumeClaimTemplates"]
    assert claim["spec"]["storageClassName"] == "fast"
    (etcd,) = sts["spec"]["template"]["spec"]["containers"]
    assert "--quota-backend-bytes=4294967296" in etcd["args"]  # an integer, not Helm's float


def test_without_etcd_or_replicas_or_policies() -> None:
    objects = render(
        "values-external-etcd.yaml",
        sets=(
            "replica.enabled=false",
            "networkPolicy.enabled=false",
            "gateway.podDisruptionBudget.enabled=false",
        ),
    )
    kinds = {o["kind"] for o in objects}
    assert kinds == {"ConfigMap", "Deployment", "Service"}
    assert [w["metadata"]["name"] for w, _ in pod_specs(objects)] == [f"{RELEASE}-gateway"]


# -- ServiceMonitor ---------------------------------------------------------------------------------------


def test_service_monitor() -> None:
    """Off by default; on, a headless Service on the sidecars' metrics port and a ServiceMonitor (valid
    against the Prometheus Operator CRD) that selects it."""
    assert not [o for o in render() if o["kind"] == "ServiceMonitor"]
    objects = render(sets=("serviceMonitor.enabled=true", "serviceMonitor.labels.release=prometheus"))
    monitor = find(objects, "ServiceMonitor", f"{RELEASE}-gateway")
    assert crd.validate(monitor) == []
    assert monitor["metadata"]["labels"]["release"] == "prometheus"
    (service,) = [
        o
        for o in objects
        if o["kind"] == "Service"
        and _selects(monitor["spec"]["selector"]["matchLabels"], o["metadata"]["labels"])
    ]
    kubernetes_validate.validate(service, KUBERNETES_VERSION, strict=True)
    assert service["spec"]["clusterIP"] == "None"
    (endpoint,) = monitor["spec"]["endpoints"]
    (port,) = [p for p in service["spec"]["ports"] if p["name"] == endpoint["port"]]
    spec = _gateway(objects)
    assert _selects(
        service["spec"]["selector"],
        pod_template(find(objects, "Deployment", f"{RELEASE}-gateway"))["metadata"]["labels"],
    )
    sidecar = container(spec, "sidecar")
    assert port["targetPort"] in [p["name"] for p in sidecar["ports"]]
    assert _flag(sidecar, "--metrics").endswith(f":{port['port']}")
    assert monitor["spec"]["namespaceSelector"]["matchNames"] == [NAMESPACE]


def test_crd_validator_is_strict() -> None:
    """A misspelt field, duplicate target ports and a Service reference without a port all fail: otherwise
    the custom resources' schema check proves nothing."""
    pool = find(render("values-inferencepool.yaml"), "InferencePool", RELEASE)
    assert crd.validate(pool) == []
    bad = yaml.safe_load(yaml.safe_dump(pool))
    bad["spec"]["selectr"] = bad["spec"].pop("selector")
    assert any("selectr" in e for e in crd.validate(bad))
    bad = yaml.safe_load(yaml.safe_dump(pool))
    bad["spec"]["targetPorts"] = [{"number": 8000}, {"number": 8000}]
    assert any("port number must be unique" in e for e in crd.validate(bad))
    bad = yaml.safe_load(yaml.safe_dump(pool))
    bad["spec"]["endpointPickerRef"] = {"name": "epp"}
    assert any("port is required" in e for e in crd.validate(bad))


# -- the endpoint picker ----------------------------------------------------------------------------------


def test_no_endpoint_picker_by_default() -> None:
    objects = render()
    spec = _gateway(objects)
    assert "--endpoint-picker" not in container(spec, "envoy-config")["args"]
    assert "epp" not in [c["name"] for c in containers(spec)]
    assert not {"ServiceAccount", "Role", "RoleBinding", "InferencePool"} & {o["kind"] for o in objects}


def _pool_serves_the_replicas(objects: list[Obj]) -> Obj:
    """The InferencePool selects exactly the replica Pods, at the port their agents advertise."""
    (pool,) = [o for o in objects if o["kind"] == "InferencePool"]
    replica = find(objects, "Deployment", f"{RELEASE}-replica")
    selected = [
        w["metadata"]["name"]
        for w, _ in pod_specs(objects)
        if _selects(pool["spec"]["selector"]["matchLabels"], pod_template(w)["metadata"]["labels"])
    ]
    assert selected == [replica["metadata"]["name"]]
    advertise = _flag(container(_replica(objects), "replica-agent"), "--advertise")
    assert [p["number"] for p in pool["spec"]["targetPorts"]] == [int(advertise.rpartition(":")[2])]
    # Those ports are admitted from the gateway Pods (where the picker runs or is dialled from).
    policy = find(objects, "NetworkPolicy", f"{RELEASE}-replica")
    assert [p["port"] for p in policy["spec"]["ingress"][0]["ports"]] == [
        p["number"] for p in pool["spec"]["targetPorts"]
    ]
    return pool


def test_endpoint_picker_at_an_address() -> None:
    """values-endpoint-picker.yaml: Envoy's config is rendered with the picker's address; nothing of the
    picker runs in the Pod; the release's InferencePool is the one the picker is told to serve."""
    values = yaml.safe_load((HELM_DIR / "values-endpoint-picker.yaml").read_text())
    objects = render("values-endpoint-picker.yaml")
    spec = _gateway(objects)
    init = container(spec, "envoy-config")
    assert _flag(init, "--endpoint-picker") == values["endpointPicker"]["address"]
    # Before --output, after the policy: one flag, one value.
    assert init["args"].count("--endpoint-picker") == 1
    assert [c["name"] for c in containers(spec)] == ["envoy-config", "sidecar", "envoy"]
    assert not {"ServiceAccount", "Role", "RoleBinding"} & {o["kind"] for o in objects}
    pool = _pool_serves_the_replicas(objects)
    assert pool["metadata"]["name"] == values["inferencePool"]["name"]


def test_endpoint_picker_in_the_gateway_pod() -> None:
    """values-inferencepool.yaml (GAIE standalone): the EPP is a container of the gateway Pod, Envoy dials
    it on loopback at its gRPC port, it serves this release's InferencePool, and it alone holds a token,
    of a ServiceAccount that may only read pools and Pods."""
    objects = render("values-inferencepool.yaml")
    spec = _gateway(objects)
    assert [c["name"] for c in containers(spec)] == ["envoy-config", "sidecar", "envoy", "epp"]
    epp = container(spec, "epp")
    address = _flag(container(spec, "envoy-config"), "--endpoint-picker")
    assert address == f"127.0.0.1:{_flag(epp, '--grpc-port')}"
    assert "--secure-serving=false" in epp["args"]  # plaintext on loopback: Envoy dials it without TLS
    ports = {p["name"]: p["containerPort"] for p in epp["ports"]}
    assert ports["epp-grpc"] == int(_flag(epp, "--grpc-port"))
    assert epp["readinessProbe"]["grpc"]["port"] == int(_flag(epp, "--grpc-health-port"))
    assert ports["epp-health"] == int(_flag(epp, "--grpc-health-port"))
    pool = _pool_serves_the_replicas(objects)
    assert _flag(epp, "--pool-name") == pool["metadata"]["name"]
    assert _flag(epp, "--pool-namespace") == pool["metadata"]["namespace"] == NAMESPACE
    assert _flag(epp, "--pool-group") == pool["apiVersion"].partition("/")[0]

    # The token: the Pod mounts none; the EPP's container mounts the ServiceAccount's, projected.
    assert spec["automountServiceAccountToken"] is False
    account = find(objects, "ServiceAccount", spec["serviceAccountName"])
    assert account["automountServiceAccountToken"] is False
    token_volumes = {
        v["name"]
        for v in spec["volumes"]
        if any("serviceAccountToken" in s for s in v.get("projected", {}).get("sources", []))
    }
    assert len(token_volumes) == 1
    for c in containers(spec):
        mounted = {m["name"] for m in c.get("volumeMounts", [])}
        assert bool(mounted & token_volumes) == (c["name"] == "epp"), c["name"]
    (mount,) = [m for m in epp["volumeMounts"] if m["name"] in token_volumes]
    assert mount["mountPath"] == "/var/run/secrets/kubernetes.io/serviceaccount" and mount["readOnly"]

    # The Role: read pools and Pods, nothing else; bound to that account.
    role = find(objects, "Role", spec["serviceAccountName"])
    granted = {
        (g, r, v)
        for rule in role["rules"]
        for g in rule["apiGroups"]
        for r in rule["resources"]
        for v in rule["verbs"]
    }
    assert granted == {
        (group, resource, verb)
        for group, resource in (("inference.networking.k8s.io", "inferencepools"), ("", "pods"))
        for verb in ("get", "list", "watch")
    }
    binding = find(objects, "RoleBinding", spec["serviceAccountName"])
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "Role",
        "name": role["metadata"]["name"],
    }
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": account["metadata"]["name"], "namespace": NAMESPACE}
    ]

    # The gateway Pod takes connections on the listener and the metrics port only, not on the EPP's.
    policy = find(objects, "NetworkPolicy", f"{RELEASE}-gateway")
    admitted = {p["port"] for rule in policy["spec"]["ingress"] for p in rule["ports"]}
    assert admitted == {8080, 9464}
    assert not admitted & set(ports.values())


def test_endpoint_picker_with_the_replica_front() -> None:
    """Behind the replica-side fence the pool's port is the front's: the picker's endpoints are the
    addresses the agents register."""
    objects = render("values-inferencepool.yaml", "values-replica-front.yaml")
    pool = _pool_serves_the_replicas(objects)
    assert [p["number"] for p in pool["spec"]["targetPorts"]] == [8001]


def test_values_examples_say_how_to_install_them() -> None:
    for name in VALUES_FILES:
        text = (HELM_DIR / name).read_text()
        assert text.startswith("# "), name
        if name != "values-kustomize.yaml":
            assert f"-f deploy/helm/{name}" in text, name


def test_chart_metadata() -> None:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["apiVersion"] == "v2" and chart["name"] == "router-sidecar"
    assert chart["appVersion"] == re.search(
        r'^version = "([^"]+)"', (REPO / "pyproject.toml").read_text(), re.M
    ).group(1)  # type: ignore[union-attr]
    # The image's default tag is the appVersion.
    image = container(_gateway(render()), "envoy")["image"]
    assert image == f"{VALUES['image']['repository']}:{chart['appVersion']}"
    result = subprocess.run(
        [helm(), "show", "values", str(CHART)], capture_output=True, text=True, timeout=60, check=True
    )
    assert yaml.safe_load(result.stdout) == VALUES


def test_tools_reach_envoy_config(tmp_path: Any) -> None:
    """gateway.tools: one --tool NAME=HOST:PORT each on the init container; the command parses and the
    Envoy config it renders validates."""
    objects = render(sets=("gateway.tools.search=search.tools.svc:8080", "gateway.tools.calc=10.0.0.9:9000"))
    init = container(_gateway(objects), "envoy-config")
    tools = [init["args"][i + 1] for i, a in enumerate(init["args"]) if a == "--tool"]
    assert tools == ["calc=10.0.0.9:9000", "search=search.tools.svc:8080"]
    assert cli_agreement.parse(init["args"]).tool
    cli_agreement.test_gateway_envoy_config_validates({"x": objects}, "x", tmp_path)


@pytest.mark.parametrize("values", [None, *VALUES_FILES])
def test_install_dry_run_prints_the_notes(values: str | None) -> None:
    """`helm install --dry-run=client` (no cluster) renders NOTES.txt too, which `helm template` skips."""
    args = ["install", RELEASE, str(CHART), "--namespace", NAMESPACE, "--dry-run=client"]
    if values:
        args += ["--values", str(HELM_DIR / values)]
    notes = run_helm(*args).stdout.partition("\nNOTES:\n")[2]
    assert f"svc/{RELEASE}-gateway" in notes and "router-sidecar trace" in notes
