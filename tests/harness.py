"""Test harness: real etcd, real Envoy (through `router-sidecar gateway`), simulated replicas, an HTTP client.

Everything listens on 127.0.0.1; every process is started in its own group and stopped by its fixture.
Waiting is by polling with a deadline, never by fixed sleeps.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml

from router_sidecar.runtime.supervise import (
    Child,
    envoy_admin,
    free_port,
    free_ports,
    port_open,
    start_etcd,
    wait_etcd_healthy,
    wait_until,
)

PYTHON = sys.executable
REPO = Path(__file__).resolve().parent.parent
# Every test request carries a credential unless it says otherwise: callers without one are refused on
# journal look-ups and tool calls (tenancy.refuse_anonymous), and all would share one tenant.
CREDENTIAL = {"Authorization": "Bearer test-tenant"}


def json_lines(path: Path, *, prefix: str = "") -> list[dict[str, Any]]:
    """The JSON objects on a log's complete lines (those starting with `prefix`).

    A line still being written when the file is read has no newline yet: it is left for the next read,
    not parsed half-written.
    """
    try:
        text = path.read_text(errors="replace")
    except FileNotFoundError:
        return []
    complete = text.split("\n")[:-1]
    return [json.loads(line) for line in complete if line.strip() and line.startswith(prefix)]


def with_credential(headers: dict[str, str] | None) -> dict[str, str]:
    """`headers` plus the test credential, unless they carry a credential (or an explicit None) already."""
    merged = dict(headers or {})
    if not any(k.lower() in ("authorization", "x-api-key") for k in merged):
        merged.update(CREDENTIAL)
    return {k: v for k, v in merged.items() if v is not None}


class Sim:
    """One simulated replica process with its request log."""

    def __init__(
        self,
        name: str,
        work: Path,
        *,
        prefill_delay: float = 0.02,
        token_interval: float = 0.005,
        extra_args: tuple[str, ...] = (),
    ) -> None:
        self.name = name
        self.port = free_port()
        self.endpoint = f"127.0.0.1:{self.port}"
        self.log_path = work / f"sim-{name}.jsonl"
        self.out_path = work / f"sim-{name}.out"
        self._args = [
            "--prefill-delay",
            str(prefill_delay),
            "--token-interval",
            str(token_interval),
            *extra_args,
        ]
        self.child: Child | None = None
        self.start()

    def start(self) -> None:
        argv = [
            PYTHON,
            "-m",
            "router_testbed.sim",
            "--listen",
            self.endpoint,
            "--name",
            self.name,
            "--log",
            str(self.log_path),
            *self._args,
        ]
        self.child = Child(f"sim-{self.name}", argv, log_path=self.out_path)
        wait_until(
            lambda: port_open("127.0.0.1", self.port), timeout=15, what=f"sim {self.name}", child=self.child
        )

    def ensure_running(self) -> bool:
        """Start it again if it is not running; returns whether it had to."""
        if self.child is None or not self.child.alive():
            if self.child is not None:
                self.child.stop()
            self.start()
            return True
        return False

    def stop(self) -> None:
        if self.child is not None:
            self.child.stop()

    def records(self) -> list[dict[str, Any]]:
        return json_lines(self.log_path)

    def requests_for(self, request_id: str) -> list[dict[str, Any]]:
        """The end records of the request's attempts this replica served."""
        return [r for r in self.records() if r.get("request_id") == request_id and r.get("event") == "end"]

    def started_for(self, request_id: str) -> int:
        """How many of the request's attempts reached this replica (ended or not)."""
        return sum(r.get("request_id") == request_id and r.get("event") == "start" for r in self.records())


@contextlib.contextmanager
def sim_pool(work: Path, names: Iterable[str], **options: Any) -> Iterator[dict[str, Sim]]:
    """Simulated replicas by name (`Sim` options for all), stopped on exit: a module fixture's body."""
    pool = {name: Sim(name, work, **options) for name in names}
    try:
        yield pool
    finally:
        for sim in pool.values():
            sim.stop()


@contextlib.contextmanager
def gateway_over(sims: Iterable[Sim], *, etcd: str, work: Path, **options: Any) -> Iterator[Gateway]:
    """`router-sidecar gateway` with these replicas (`Gateway` options), stopped on exit."""
    gateway = Gateway(replicas=[s.endpoint for s in sims], etcd=etcd, work=work, **options)
    try:
        yield gateway
    finally:
        gateway.stop()


class Agent:
    """`router-sidecar replica` for one simulated replica: a lease-backed heartbeat in the registry."""

    def __init__(
        self,
        sim: Sim,
        etcd: str,
        work: Path,
        *,
        fingerprint: Path | None = None,
        ttl: int = 2,
        interval: float = 0.3,
        advertise: str | None = None,  # where the gateway reaches the replica (default: the sim itself)
    ) -> None:
        self.sim = sim
        self.out = work / f"agent-{sim.name}.out"
        self._argv = [
            PYTHON,
            "-m",
            "router_sidecar",
            "replica",
            "--engine",
            sim.endpoint,
            "--advertise",
            advertise or sim.endpoint,
            "--etcd",
            etcd,
            "--ttl",
            str(ttl),
            "--interval",
            str(interval),
        ]
        if fingerprint is not None:
            self._argv += ["--fingerprint", str(fingerprint)]
        self.child: Child | None = None
        self.start()

    def start(self) -> None:
        self.out.write_text("")
        self.child = Child(f"agent-{self.sim.name}", self._argv, log_path=self.out)
        wait_until(
            lambda: "ready" in self.out.read_text(), timeout=15, what="agent registered", child=self.child
        )

    def stop(self) -> None:
        if self.child is not None:
            self.child.stop()


class EtcdCluster:
    """A several-member etcd cluster on loopback whose members can be killed and restarted."""

    def __init__(self, work: Path, size: int = 3) -> None:
        self.work = work
        work.mkdir(parents=True, exist_ok=True)
        self.names = [f"member{i}" for i in range(size)]
        ports = free_ports(2 * size)  # distinct: a port given twice makes a cluster that never forms
        self._peer = dict(zip(self.names, ports[:size], strict=True))
        self._client = dict(zip(self.names, ports[size:], strict=True))
        self._initial = ",".join(f"{n}=http://127.0.0.1:{self._peer[n]}" for n in self.names)
        self.children: dict[str, Child] = {}
        try:
            for name in self.names:  # a new cluster's members only get healthy together
                self._start(name)
            for name in self.names:
                wait_etcd_healthy(self.children[name], self.endpoint_of(name), timeout=30)
        except BaseException:
            self.stop()
            raise

    def _start(self, name: str) -> None:
        self.children[name], _ = start_etcd(
            self.work / name,
            name=name,
            client_port=self._client[name],
            peer_port=self._peer[name],
            initial_cluster=self._initial,
            log_path=self.work / f"{name}.log",
            wait=False,
        )

    def endpoint_of(self, name: str) -> str:
        return f"127.0.0.1:{self._client[name]}"

    @property
    def endpoints(self) -> str:
        """What `--etcd` takes: every member."""
        return ",".join(self.endpoint_of(n) for n in self.names)

    def leader(self) -> str:
        """The member that leads now (asked of each member through etcd's JSON gateway)."""
        ids: dict[int, str] = {}
        leaders: set[int] = set()
        for name in self.names:
            if not self.children[name].alive():
                continue
            status = httpx.post(f"http://{self.endpoint_of(name)}/v3/maintenance/status", json={}, timeout=5)
            body = status.json()
            ids[int(body["header"]["member_id"])] = name
            leaders.add(int(body["leader"]))
        (leader,) = leaders
        return ids[leader]

    def kill(self, name: str) -> None:
        child = self.children[name]
        child.signal(signal.SIGKILL)
        child.proc.wait(10)
        child.stop()

    def restart(self, name: str) -> None:
        self._start(name)  # its data dir is kept: it rejoins as the member it was
        wait_etcd_healthy(self.children[name], self.endpoint_of(name), timeout=30)

    def stop(self) -> None:
        for child in self.children.values():
            child.stop()


def _with_full_traces(config: Path | None, path: Path) -> Path:
    """The test's policy, keeping every record's event trace (production compacts clean completions'),
    since tests check the trace. A policy that sets `journal.trace_clean_completions` keeps its value."""
    policy = yaml.safe_load(config.read_text()) if config is not None else None
    policy = policy or {}
    policy.setdefault("journal", {}).setdefault("trace_clean_completions", 1)
    path.write_text(yaml.safe_dump(policy))
    return path


class Gateway:
    """`router-sidecar gateway` as a subprocess, exactly as a user runs it."""

    def __init__(
        self,
        *,
        replicas: list[str],
        etcd: str,
        work: Path,
        config: Path | None = None,
        port: int | None = None,
        tools: tuple[str, ...] = (),
        extra_args: tuple[str, ...] = (),
        env: dict[str, str] | None = None,
        up_line: bytes = b"ready:",
    ) -> None:
        """Started once its stdout has a line that starts with `up_line`: `ready:` (a replica to send to),
        or `waiting for replicas:` (up, not ready: none registered yet); the line is kept in `up`."""
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.etcd = etcd
        self.work = work
        self.out_path = work / "gateway.out"
        argv = [
            PYTHON,
            "-m",
            "router_sidecar",
            "gateway",
            "--listen",
            f"127.0.0.1:{self.port}",
            "--etcd",
            etcd,
            "--work-dir",
            str(work / "gw"),
        ]
        for replica in replicas:
            argv += ["--replica", replica]
        for tool in tools:
            argv += ["--tool", tool]
        argv += ["--policy", str(_with_full_traces(config, work / f"policy-{self.port}.yaml"))]
        argv += list(extra_args)
        self._out = open(self.out_path, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            argv,
            stdout=subprocess.PIPE,
            stderr=self._out,
            start_new_session=True,
            env={**os.environ, **env} if env else None,
            bufsize=0,  # unbuffered: a line read leaves none behind in a buffer select() cannot see
        )
        try:
            self.up = self.wait_line(up_line)
        except RuntimeError:
            self.stop()
            raise

    def wait_line(self, prefix: bytes, timeout: float = 40.0) -> str:
        """The next line of its stdout that starts with `prefix` (earlier lines are read and dropped)."""
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout
        seen = b""
        while time.monotonic() < deadline:
            ready, _, _ = select.select([self.proc.stdout], [], [], 0.1)
            if ready:
                line = self.proc.stdout.readline()
                seen += line
                if line.startswith(prefix):
                    return line.decode()
            if self.proc.poll() is not None:
                break
        raise RuntimeError(
            f"gateway printed no {prefix!r} line: {seen!r}\n{self.out_path.read_text()[-3000:]}"
        )

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)
        self._out.close()

    def envoy_admin(self, path: str) -> bytes:
        """GET from this gateway's Envoy admin interface (a unix socket in its work dir)."""
        answer = envoy_admin(self.work / "gw" / "admin.sock", path, timeout=5)
        assert answer is not None and answer[0] == 200, answer
        return answer[1]

    def wait_replicas_healthy(
        self, replicas: Iterable[str], *, fresh: bool = False, timeout: float = 15.0
    ) -> None:
        """Until Envoy has every one of `replicas` (HOST:PORT) as a healthy host of the replica cluster
        (after a test restarted one, or the registry re-announced it): a request, or a retry, must be able
        to land on any of them. `fresh`: a replica was just restarted, so a health check that failed while
        it was down may still count against it: wait for a round of passed checks after now as well."""
        wanted = set(replicas)
        passed_before = self._health_checks_passed() if fresh else 0

        def all_healthy() -> bool:
            healthy = set()
            for line in self.envoy_admin("/clusters").decode().splitlines():
                parts = line.split("::")
                if (
                    len(parts) == 4
                    and parts[0] == "llm"
                    and parts[2] == "health_flags"
                    and parts[3] == "healthy"
                ):
                    healthy.add(parts[1])
            if not wanted <= healthy:
                return False
            return not fresh or self._health_checks_passed() >= passed_before + len(wanted)

        poll(all_healthy, timeout=timeout, what=f"Envoy sees {sorted(wanted)} healthy")

    def _health_checks_passed(self) -> int:
        for line in self.envoy_admin("/stats?filter=cluster.llm.health_check.success").decode().splitlines():
            if line.startswith("cluster.llm.health_check.success:"):
                return int(line.split(":")[1])
        return 0

    def envoy_pid(self) -> int:
        return int((self.work / "gw" / "envoy.pid").read_text())

    def journal(self, request_id: str, headers: dict[str, str] | None = None) -> tuple[int, dict[str, Any]]:
        response = httpx.get(
            f"{self.url}/v1/requests/{request_id}", headers=with_credential(headers), timeout=5
        )
        return response.status_code, response.json()

    def wait_journal(
        self,
        request_id: str,
        predicate: Callable[[dict[str, Any]], bool],
        *,
        timeout: float = 10.0,
        headers: dict[str, str] | None = None,
    ) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        last: dict[str, Any] = {}
        while time.monotonic() < deadline:
            status, last = self.journal(request_id, headers)
            if status == 200 and predicate(last):
                return last
            time.sleep(0.02)
        raise AssertionError(f"journal of {request_id} never matched; last: {json.dumps(last, indent=1)}")


@dataclass
class ClientResult:
    status: int
    headers: dict[str, str]
    body: bytes
    transport_error: str | None = None
    events: list[bytes] = field(default_factory=list)

    @property
    def request_id(self) -> str:
        return self.headers.get("x-request-id", "")

    def data(self) -> list[Any]:
        """Payloads of the SSE events the client received: parsed JSON, or the literal `[DONE]`."""
        out: list[Any] = []
        for event in self.events:
            lines = [ln[5:].lstrip() for ln in event.splitlines() if ln.startswith(b"data:")]
            if not lines:
                continue
            payload = b"\n".join(lines)
            out.append("[DONE]" if payload == b"[DONE]" else json.loads(payload))
        return out

    def content_chunks(self) -> list[dict[str, Any]]:
        return [
            d
            for d in self.data()
            if isinstance(d, dict) and d.get("choices") and _has_content(d["choices"][0])
        ]

    def completion_ids(self) -> set[str]:
        return {d["id"] for d in self.data() if isinstance(d, dict) and "id" in d}


def _has_content(choice: dict[str, Any]) -> bool:
    delta = choice.get("delta") or {}
    return bool(
        delta.get("content")
        or delta.get("tool_calls")
        or delta.get("reasoning_content")
        or choice.get("text")
    )


def split_events(raw: bytes) -> list[bytes]:
    return [e for e in raw.replace(b"\r\n", b"\n").split(b"\n\n") if e.strip()]


def post(
    url: str,
    body: dict[str, Any],
    *,
    headers: dict[str, str] | None = None,
    timeout: float = 30.0,
    stop_after_content_events: int | None = None,
) -> ClientResult:
    """POST and read the whole response as raw bytes; a transport error is recorded, not raised."""
    raw = b""
    status, response_headers, error = 0, {}, None
    with httpx.Client(timeout=timeout) as client:
        try:
            with client.stream("POST", url, json=body, headers=with_credential(headers)) as response:
                status, response_headers = response.status_code, dict(response.headers)
                for chunk in response.iter_raw():
                    raw += chunk
                    if stop_after_content_events is not None:
                        got = ClientResult(status, {}, raw, events=split_events(raw)).content_chunks()
                        if len(got) >= stop_after_content_events:
                            break  # leaving the with-block closes the connection: a client disconnect
        except (httpx.RemoteProtocolError, httpx.ReadError) as exc:
            error = f"{type(exc).__name__}: {exc}"
    return ClientResult(status, response_headers, raw, error, split_events(raw))


def chat(max_tokens: int = 8, **extra: Any) -> dict[str, Any]:
    return {
        "model": "tiny",
        "messages": [{"role": "user", "content": "Say something"}],
        "stream": True,
        "max_tokens": max_tokens,
        **extra,
    }


def poll(predicate: Callable[[], Any], *, timeout: float = 10.0, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def no_overlapping_content(result: ClientResult) -> None:
    """Invariant 1: every chunk the client got belongs to one completion (one attempt)."""
    ids = {d["id"] for d in result.content_chunks()}
    assert len(ids) <= 1, f"content from several attempts reached the client: {ids}"


def iter_attempt_ids(journal: dict[str, Any]) -> Iterator[str]:
    for attempt in journal.get("attempts", []):
        yield attempt["attempt_id"]
