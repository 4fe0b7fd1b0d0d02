"""Fault fuzzing of the first-delta contract: seeded random trials against a real gateway.

One environment is a real etcd of our own (restartable on its port), 2–3 simulated replicas each with a
replica agent (heartbeat TTL 2 s, so a frozen replica is seen as lost and fenced), and one gateway
(`tests.harness.Gateway`, attempt lease TTL 2 s). A trial is drawn from ``random.Random(trial_seed)``:

* 1–32 requests sent at once (mostly few, sometimes many), each on one of the four inference routes (chat
  completions, completions, the Responses API, the Messages API), stream or not, ``include_usage`` or not
  (chat, completions), ``max_tokens`` 4..40, its own ``Idempotency-Key`` (= request id) and
  ``Authorization: Bearer fuzz``; per request a random simulator fault that applies to its API
  (``x-sim-fault``: action × point × attempt filter × replica filter, sometimes two clauses) or none;
  sometimes a client that disconnects after k content events. The replicas speak vLLM's and SGLang's
  dialects side by side, so a Responses request that lands on the SGLang one meets its failing route (a
  text/plain 500, docs/simulator.md) and is retried like any failure before content;
* sometimes an environment fault during the batch: a replica SIGKILLed (restarted a moment later), a
  replica frozen with SIGSTOP for a moment (slow or lost, not dead), or etcd restarted;
* sometimes connection-closing replicas (`tests/closing_proxy.py` in front of them): one or every replica
  closes a connection 2-10 ms after each response unless the next request is there, or after a short
  keep-alive (0.1-0.5 s, well below the gateway's idle timeout, as an engine with a shortened
  `timeout_keep_alive` would); Envoy then hands requests connections the replica is closing.

After the batch every request's evidence (client bytes, journal record, replica logs) is checked with
`tests.invariants`, each API by its own rules (`tests.api_streams`: first content, clean end, terminal
event, one opening, the delivered count), and one normal request plus Envoy's pid check invariant 10. A
failing trial prints its seed, its spec and the evidence; ``--replay SEED`` runs exactly that trial again
(same spec; the timing of processes is not reproducible, so a race may need a few replays).

    python -m tests.fault.fuzz --trials 100 [--seed S]      # S: the run's seed (random when omitted)
    python -m tests.fault.fuzz --replay 3735928559           # one trial, by its trial seed

The CI-size entry is `tests/fault/test_fuzz.py`; the nightly soak is this CLI with ``--trials 10000``.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import json
import random
import secrets
import signal
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal, TextIO

import httpx

from router_sidecar.coordination.store import keys
from router_sidecar.runtime.supervise import Child, free_port, start_etcd
from router_testbed.sim.faults import parse_fault_spec
from tests.closing_proxy import ClosingProxy
from tests.harness import Agent, Gateway, Sim
from tests.invariants import (
    NOT_SENT,
    TERMINAL_PHASES,
    ClientOutcome,
    Evidence,
    GatewayProbe,
    Route,
    SentRequest,
    Violation,
    check_gateway,
    check_request,
    count_content_events,
    describe,
    outcome_kind,
    records_by_request,
    simulated_pieces,
    simulated_variants,
    stream_ended,
    unfinished_attempts,
)

REPLICA_NAMES = ("a", "b", "c")
DIALECTS = {"a": "vllm", "b": "sglang", "c": "vllm"}  # what each simulated replica speaks
LEASE_TTL = 2
AGENT_TTL = 2
AGENT_INTERVAL = 0.3
MAX_ATTEMPTS = 2  # the default policy's before_first_delta.max_attempts
POLICY = f"leases:\n  attempt_ttl_seconds: {LEASE_TTL}\n"
AUTH = "Bearer fuzz"
CLIENT_TIMEOUT = 20.0  # a response that neither ends nor breaks in this long is a hang (invariant 9)
# A journal record must be terminal and settled this long after the batch: covers a fence that waits for
# a lease's expiry (TTL 2 s + slack) and an etcd restart during the batch.
JOURNAL_DEADLINE = 10.0
REPLICA_LOG_DEADLINE = 10.0  # a live replica logs the end of each attempt within this long
POLL = 0.05

ACTION_WEIGHTS: dict[str, float] = {
    "reset": 3,
    "close": 3,
    "error": 3,
    "abort": 2,
    "status503": 2,
    "delay": 2,
    "stall": 1,
    "exit": 0.4,
    "oversize": 0.5,
    "status429": 0.5,
}
# The share of requests per route.
ROUTE_WEIGHTS: dict[Route, float] = {"chat": 0.4, "completions": 0.15, "responses": 0.225, "messages": 0.225}
# Faults that do not apply to an API: on Responses and Messages `abort` ends the answer as a normal one
# (vLLM's Responses `status: completed`, its Messages `stop_reason: null`, SGLang's `end_turn`;
# docs/simulator.md), a short answer no client or gateway can tell from a whole one, not a failure.
NOT_ON_ROUTE: dict[str, frozenset[str]] = {
    "responses": frozenset({"abort"}),
    "messages": frozenset({"abort"}),
}
# Over the gateway's 1 MiB event limit (limits.max_event_bytes) by enough that the event's incomplete part
# crosses it at a chunk boundary: an event only a little over it is forwarded whole after the first content,
# a product bug of its own (tests/unit/test_sse_event_bound.py), which would fail most trials here.
OVERSIZE_BYTES = 3 << 20
EnvFaultKind = Literal["kill_replica", "freeze_replica", "restart_etcd"]


# --- the trial spec (pure: a function of the trial seed) ------------------------------------------------


@dataclass(frozen=True)
class RequestSpec:
    index: int
    route: Route
    stream: bool
    include_usage: bool
    max_tokens: int
    fault: str | None
    disconnect_after: int | None  # the client leaves after this many content events
    delay: float  # seconds after the batch starts


@dataclass(frozen=True)
class EnvFault:
    kind: EnvFaultKind
    replica: str | None  # kill/freeze: which replica
    at: float  # seconds after the first request of the batch reached a replica
    duration: float  # how long the replica is dead / frozen, or etcd is down


@dataclass(frozen=True)
class TrialSpec:
    seed: int
    replicas: int
    requests: tuple[RequestSpec, ...]
    env_fault: EnvFault | None
    # Replicas that close idle connections, with after how long (seconds; the rest keep them open).
    closing: tuple[tuple[str, float], ...] = ()

    def as_json(self) -> dict[str, Any]:
        return asdict(self)


def draw_trial(seed: int) -> TrialSpec:
    rng = random.Random(seed)
    replicas = rng.choice((2, 2, 3))
    names = REPLICA_NAMES[:replicas]
    r = rng.random()
    concurrency = rng.randint(1, 3) if r < 0.6 else rng.randint(4, 8) if r < 0.9 else rng.randint(9, 32)
    requests = tuple(_draw_request(rng, i, names) for i in range(concurrency))
    env_fault = _draw_env_fault(rng, names) if rng.random() < 0.2 else None
    return TrialSpec(seed, replicas, requests, env_fault, _draw_closing(rng, names))


def _draw_closing(rng: random.Random, names: Sequence[str]) -> tuple[tuple[str, float], ...]:
    """Connection-closing replicas, in a quarter of the trials (drawn last: the rest of a seed's trial is as
    it was before this fault existed)."""
    if rng.random() >= 0.25:
        return ()
    after_response = rng.random() < 0.6
    closing = list(names) if rng.random() < 0.3 else [rng.choice(list(names))]
    return tuple(
        (name, round(rng.uniform(0.002, 0.01) if after_response else rng.uniform(0.1, 0.5), 3))
        for name in closing
    )


def _draw_request(rng: random.Random, index: int, names: Sequence[str]) -> RequestSpec:
    route: Route = rng.choices(list(ROUTE_WEIGHTS), weights=list(ROUTE_WEIGHTS.values()))[0]
    stream = rng.random() < 0.8
    include_usage = stream and rng.random() < 0.3 and route in ("chat", "completions")
    max_tokens = rng.randint(4, 40)
    fault = _draw_fault(rng, max_tokens, names, route, stream) if rng.random() < 0.55 else None
    disconnect_after = rng.randint(1, max_tokens - 1) if stream and rng.random() < 0.12 else None
    return RequestSpec(
        index,
        route,
        stream,
        include_usage,
        max_tokens,
        fault,
        disconnect_after,
        round(rng.uniform(0, 0.05), 3),
    )


def _draw_fault(
    rng: random.Random, max_tokens: int, names: Sequence[str], route: Route = "chat", stream: bool = True
) -> str:
    clauses = [_draw_clause(rng, max_tokens, names, route, stream)]
    if rng.random() < 0.15:
        clauses.append(_draw_clause(rng, max_tokens, names, route, stream))
    spec = "; ".join(clauses)
    parse_fault_spec(spec)  # a malformed spec fails here, loudly, instead of as a simulator 400
    return spec


def _draw_clause(
    rng: random.Random, max_tokens: int, names: Sequence[str], route: Route = "chat", stream: bool = True
) -> str:
    # A non-streamed answer has no events to oversize: the fault pads its text, a legitimate big answer.
    excluded = NOT_ON_ROUTE.get(route, frozenset()) | (frozenset() if stream else frozenset({"oversize"}))
    actions = [a for a in ACTION_WEIGHTS if a not in excluded]
    action = rng.choices(actions, weights=[ACTION_WEIGHTS[a] for a in actions])[0]
    n = rng.randint(1, 4) if rng.random() < 0.7 else rng.randint(1, max_tokens + 2)
    if action in ("status503", "status429"):
        point = "headers"
    elif action == "oversize":
        point = f"token:{n}"  # the only point it takes
    else:
        kinds = ["headers", "role", "token", "after", "done", "terminal"]
        kind = rng.choices(kinds, weights=[2, 2, 4, 4, 1, 1])[0]
        point = f"{kind}:{n}" if kind in ("token", "after") else kind
    parts = [f"{action}@{point}"]
    if action == "oversize":
        parts.append(f"bytes={OVERSIZE_BYTES}")
    if action == "stall":
        parts.append(f"for={rng.uniform(0.1, 1.0):.2f}")  # never an endless stall: that is the deadline's job
    elif action == "delay":
        parts.append(f"for={rng.uniform(0.05, 0.6):.2f}")
    r = rng.random()
    if r < 0.45:
        parts.append("attempt=1")
    elif r < 0.55:
        parts.append("attempt=2")
    elif r < 0.62:
        parts.append("attempt=1,2")
    if rng.random() < 0.2:
        parts.append(f"replica={rng.choice(list(names))}")
    return " ".join(parts)


def _draw_env_fault(rng: random.Random, names: Sequence[str]) -> EnvFault:
    kind: EnvFaultKind = rng.choices(
        ["kill_replica", "freeze_replica", "restart_etcd"], weights=[35, 40, 25]
    )[0]
    replica = rng.choice(list(names)) if kind != "restart_etcd" else None
    return EnvFault(kind, replica, round(rng.uniform(0, 0.25), 3), round(rng.uniform(0.2, 1.5), 3))


def trial_seeds(seed: int, trials: int) -> list[int]:
    master = random.Random(seed)
    return [master.getrandbits(32) for _ in range(trials)]


def request_body(spec: RequestSpec, request_id: str) -> dict[str, Any]:
    # The prompt names the request, so every request has its own deterministic text: content of another
    # request (or another answer) shows up as text that is not a prefix of this request's generation.
    prompt = f"fuzz {request_id}"
    if spec.route == "responses":
        return {"model": "tiny", "stream": spec.stream, "max_output_tokens": spec.max_tokens, "input": prompt}
    body: dict[str, Any] = {"model": "tiny", "stream": spec.stream, "max_tokens": spec.max_tokens}
    if spec.route in ("chat", "messages"):
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    if spec.include_usage:
        body["stream_options"] = {"include_usage": True}
    return body


# --- the environment ----------------------------------------------------------------------------------


class EnvironmentBroken(Exception):
    """The testbed itself could not be restored (not a finding about the gateway)."""


class RestartableEtcd:
    """Our own etcd on a fixed port and data dir, so it can be stopped and started again under the gateway."""

    def __init__(self, work: Path) -> None:
        self.work = work
        self.port = free_port()
        self.endpoint = f"127.0.0.1:{self.port}"
        self.child: Child | None = None
        self.start()

    def start(self) -> None:
        self.child, _ = start_etcd(
            self.work / "etcd-data", client_port=self.port, log_path=self.work / "etcd.log"
        )

    def stop(self) -> None:
        if self.child is not None:
            self.child.stop()

    def alive(self) -> bool:
        return self.child is not None and self.child.alive()


def envoy_pid(gateway_pid: int) -> int | None:
    """The Envoy child of the `router-sidecar gateway` process (from /proc)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        comm = text[text.index("(") + 1 : text.rindex(")")]
        ppid = int(text[text.rindex(")") + 2 :].split()[1])
        if ppid == gateway_pid and comm.startswith("envoy"):
            return int(stat.parent.name)
    return None


def rss_mb(pid: int | None) -> float | None:
    if pid is None:
        return None
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


class Environment:
    def __init__(self, work: Path, replicas: int, *, closing_proxies: bool = False) -> None:
        work.mkdir(parents=True, exist_ok=True)
        self.work = work
        self.sims: dict[str, Sim] = {}
        self.agents: dict[str, Agent] = {}
        # Between Envoy and each replica, for trials with connection-closing replicas (open until told).
        self.proxies: dict[str, ClosingProxy] = {}
        self.gateway: Gateway | None = None
        self.etcd = RestartableEtcd(work)
        try:
            for name in REPLICA_NAMES[:replicas]:
                # Both engines' dialects in every trial: a retry may land on the other (a mixed fleet).
                self.sims[name] = Sim(
                    name,
                    work,
                    prefill_delay=0.02,
                    token_interval=0.005,
                    extra_args=("--dialect", DIALECTS[name]),
                )
            if closing_proxies:
                self.proxies = {n: ClosingProxy(s.endpoint, idle_close=None) for n, s in self.sims.items()}
            for name, sim in self.sims.items():
                self.agents[name] = Agent(
                    sim,
                    self.etcd.endpoint,
                    work,
                    ttl=AGENT_TTL,
                    interval=AGENT_INTERVAL,
                    advertise=self.advertised(name),
                )
            config = work / "policy.yaml"
            config.write_text(POLICY)
            self.gateway = Gateway(
                replicas=[self.advertised(n) for n in self.sims],
                etcd=self.etcd.endpoint,
                work=work,
                config=config,
            )
        except BaseException:
            self.close()
            raise
        self.envoy_pid = envoy_pid(self.gateway.proc.pid)
        self.rss_at_start = (rss_mb(self.envoy_pid), rss_mb(self.gateway.proc.pid))
        self._log_offsets = {name: self._log_size(name) for name in self.sims}

    def advertised(self, name: str) -> str:
        """Where Envoy reaches the replica: its proxy when it has one."""
        proxy = self.proxies.get(name)
        return proxy.endpoint if proxy is not None else self.sims[name].endpoint

    def close_connections(self, closing: Sequence[tuple[str, float]]) -> None:
        """The trial's closing replicas close idle connections after their delay; the others never do."""
        delays = dict(closing)
        for name, proxy in self.proxies.items():
            proxy.idle_close = delays.get(name)

    @property
    def gw(self) -> Gateway:
        assert self.gateway is not None
        return self.gateway

    def close(self) -> None:
        for sim in self.sims.values():
            if sim.child is not None:
                sim.child.signal(signal.SIGCONT)
        if self.gateway is not None:
            self.gateway.stop()
        for agent in self.agents.values():
            agent.stop()
        for sim in self.sims.values():
            sim.stop()
        for proxy in self.proxies.values():
            proxy.stop()
        self.etcd.stop()

    def rss(self) -> tuple[float | None, float | None]:
        return rss_mb(self.envoy_pid), rss_mb(self.gw.proc.pid)

    def live_replica_pids(self) -> frozenset[int]:
        return frozenset(s.child.pid for s in self.sims.values() if s.child is not None and s.child.alive())

    def _log_size(self, name: str) -> int:
        path = self.sims[name].log_path
        return path.stat().st_size if path.exists() else 0

    def mark_logs(self) -> None:
        """Replica log records of the next trial start here (the logs only ever grow)."""
        self._log_offsets = {name: self._log_size(name) for name in self.sims}

    def logs_grew(self) -> bool:
        return any(self._log_size(name) > offset for name, offset in self._log_offsets.items())

    def new_records(self) -> list[dict[str, Any]]:
        """Every complete replica log record written since `mark_logs`."""
        records: list[dict[str, Any]] = []
        for name, offset in self._log_offsets.items():
            path = self.sims[name].log_path
            if not path.exists():
                continue
            with path.open("rb") as f:
                f.seek(offset)
                data = f.read()
            for line in data.split(b"\n"):
                with contextlib.suppress(ValueError):
                    if line.strip():
                        records.append(json.loads(line))
        return records

    async def gather(self, sent: Sequence[SentRequest], outcomes: Sequence[ClientOutcome]) -> list[Evidence]:
        return await gather_evidence(
            self.gw.url, sent, outcomes, replica_records=self.new_records, live_pids=self.live_replica_pids
        )

    def registered(self, name: str) -> bool:
        """The replica's agent has it in the registry (read over etcd's JSON gateway, no etcd client here)."""
        key = base64.b64encode(keys.replica(self.advertised(name)).encode()).decode()
        try:
            response = httpx.post(f"http://{self.etcd.endpoint}/v3/kv/range", json={"key": key}, timeout=1)
            return response.status_code == 200 and bool(response.json().get("kvs"))
        except (httpx.HTTPError, ValueError):
            return False

    def restore(self, timeout: float = 20.0) -> None:
        """Every replica running and registered, etcd up: the state each trial starts from."""
        for sim in self.sims.values():
            if sim.child is not None:
                sim.child.signal(signal.SIGCONT)
        try:
            if not self.etcd.alive():
                self.etcd.start()
            for name, sim in self.sims.items():
                sim.ensure_running()
                agent = self.agents[name]
                if agent.child is None or not agent.child.alive():
                    agent.stop()
                    agent.start()
        except Exception as exc:
            raise EnvironmentBroken(f"could not restart the testbed: {exc}") from exc
        deadline = time.monotonic() + timeout
        while not all(self.registered(n) for n in self.sims):
            if time.monotonic() > deadline:
                missing = [n for n in self.sims if not self.registered(n)]
                raise EnvironmentBroken(f"replicas {missing} not registered again within {timeout}s")
            time.sleep(POLL)
        # Registered is not yet routable: Envoy learns of it over EDS from the sidecar a moment later.
        try:
            self.gw.wait_replicas_healthy((self.advertised(n) for n in self.sims), timeout=timeout)
        except AssertionError as exc:
            raise EnvironmentBroken(f"Envoy does not route to every replica again: {exc}") from exc


# --- one trial ------------------------------------------------------------------------------------------


@dataclass
class TrialResult:
    spec: TrialSpec
    evidence: list[Evidence]
    violations: list[Violation]
    gateway_alive: bool = True
    env_note: str = ""
    seconds: float = 0.0


async def send_request(
    client: httpx.AsyncClient,
    url: str,
    sent: SentRequest,
    *,
    authorization: str | None = AUTH,
    disconnect_after: int | None = None,
    delay: float = 0.0,
) -> ClientOutcome:
    """POST one request with its own Idempotency-Key and read every byte of the answer as it comes; leave
    after `disconnect_after` content events (a client disconnect). Transport errors are recorded."""
    await asyncio.sleep(delay)  # the spec's stagger of this request, not a synchronisation
    headers = {"idempotency-key": sent.request_id}
    if authorization is not None:
        headers["authorization"] = authorization
    if sent.fault:
        headers["x-sim-fault"] = sent.fault
    raw = b""
    status, response_headers, error = 0, {}, None
    disconnected, read_at_leave, left_at = False, None, None
    started = time.time()
    try:
        async with client.stream("POST", url + sent.path, json=sent.body, headers=headers) as response:
            status = response.status_code
            response_headers = {k.lower(): v for k, v in response.headers.items()}
            async for chunk in response.aiter_raw():
                raw += chunk
                if disconnect_after is not None and count_content_events(raw, sent.route) >= disconnect_after:
                    if stream_ended(raw, sent.route):
                        continue  # the response is over already: leaving now is no disconnect
                    read_at_leave = count_content_events(raw, sent.route)
                    disconnected, left_at = True, time.time()
                    break  # leaving the block closes the connection: a client disconnect
    except httpx.HTTPError as exc:
        error = f"{type(exc).__name__}: {exc}"
    return ClientOutcome(
        status=status,
        headers=response_headers,
        body=raw,
        transport_error=error,
        disconnected=disconnected,
        content_events_read=read_at_leave,
        disconnected_at=left_at,
        started_at=started,
        ended_at=time.time(),
    )


def _apply_env_fault(env: Environment, fault: EnvFault, batch: threading.Thread) -> str:
    """Inject the environment fault once the batch reached a replica; return what was done (for the log).

    Runs on the main thread, never in a worker thread: the testbed's children die with the thread that
    started them (`PR_SET_PDEATHSIG`), so a replica or etcd restarted from a worker thread would be killed
    again as soon as that thread ended."""
    deadline = time.monotonic() + 5
    while not env.logs_grew() and batch.is_alive() and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(fault.at)  # the spec's offset of the fault into the batch
    if fault.kind == "restart_etcd":
        env.etcd.stop()
        try:
            time.sleep(fault.duration)  # etcd stays down this long (the fault itself)
        finally:
            env.etcd.start()
        return f"etcd down {fault.duration}s"
    assert fault.replica is not None
    sim = env.sims[fault.replica]
    assert sim.child is not None
    if fault.kind == "freeze_replica":
        sim.child.signal(signal.SIGSTOP)
        try:
            time.sleep(fault.duration)  # frozen this long (the fault itself)
        finally:
            sim.child.signal(signal.SIGCONT)
        return f"replica {fault.replica} frozen {fault.duration}s"
    sim.child.signal(signal.SIGKILL)
    sim.child.proc.wait(5)
    time.sleep(fault.duration)  # dead this long (the fault itself)
    sim.ensure_running()
    return f"replica {fault.replica} killed, restarted after {fault.duration}s"


def _settled(status: int, record: dict[str, Any] | None) -> bool:
    """Terminal, and every attempt has an outcome: what a finished request's record must reach in time."""
    if status != 200 or record is None or record.get("phase") not in TERMINAL_PHASES:
        return False
    return all(a.get("outcome") is not None for a in record.get("attempts") or [])


async def _lookup(
    http: httpx.AsyncClient, url: str, request_id: str, authorization: str | None
) -> tuple[int, dict[str, Any] | None]:
    headers = {"authorization": authorization} if authorization is not None else {}
    try:
        response = await http.get(f"{url}/v1/requests/{request_id}", headers=headers)
        return response.status_code, response.json()
    except (httpx.HTTPError, ValueError):
        return 0, None


async def gather_evidence(
    url: str,
    sent: Sequence[SentRequest],
    outcomes: Sequence[ClientOutcome],
    *,
    replica_records: Callable[[], list[dict[str, Any]]],
    live_pids: Callable[[], frozenset[int]],
    authorization: str | None = AUTH,
    max_attempts: int = MAX_ATTEMPTS,
    journal_deadline: float = JOURNAL_DEADLINE,
) -> list[Evidence]:
    """The evidence of each request: poll (with deadlines) until its journal record settled (terminal,
    every attempt with an outcome) and every live replica logged the end of its attempts."""
    journals: dict[str, tuple[int, dict[str, Any] | None]] = {s.request_id: (0, None) for s in sent}
    pending = set(journals)
    deadline = time.monotonic() + journal_deadline
    async with httpx.AsyncClient(timeout=5) as http:
        while pending:
            ids = sorted(pending)
            answers = await asyncio.gather(*(_lookup(http, url, r, authorization) for r in ids))
            for rid, answer in zip(ids, answers, strict=True):
                if answer[0] != 0 or journals[rid][0] == 0:
                    journals[rid] = answer
                if _settled(*answer):
                    pending.discard(rid)
            if not pending or time.monotonic() > deadline:
                break
            await asyncio.sleep(POLL)
    wanted = {s.request_id for s in sent}
    deadline = time.monotonic() + REPLICA_LOG_DEADLINE
    while True:
        live = live_pids()
        by_request = records_by_request(r for r in replica_records() if r.get("request_id") in wanted)
        unfinished = [r for rid in wanted for r in unfinished_attempts(by_request.get(rid, []), live)]
        if not unfinished or time.monotonic() > deadline:
            break
        await asyncio.sleep(POLL)
    return [
        Evidence(
            sent=s,
            client=outcome,
            journal_status=journals[s.request_id][0],
            journal=journals[s.request_id][1],
            replica_records=by_request.get(s.request_id, []),
            live_replica_pids=live,
            expected_pieces=simulated_pieces(s.route, s.body),
            variant_pieces=simulated_variants(s.route, s.body, s.fault),
            max_attempts=max_attempts,
        )
        for s, outcome in zip(sent, outcomes, strict=True)
    ]


async def _send_all(url: str, sent: Sequence[SentRequest], trial: TrialSpec) -> list[ClientOutcome]:
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=0)
    timeout = httpx.Timeout(CLIENT_TIMEOUT, connect=5)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        return list(
            await asyncio.gather(
                *(
                    send_request(client, url, s, disconnect_after=spec.disconnect_after, delay=spec.delay)
                    for s, spec in zip(sent, trial.requests, strict=True)
                )
            )
        )


def _batch(env: Environment, trial: TrialSpec, nonce: str) -> tuple[list[Evidence], str]:
    """Send the trial's requests from a client thread while the main thread injects the environment fault."""
    sent = []
    for spec in trial.requests:
        rid = f"fz-{nonce}-{trial.seed:08x}-{spec.index}"
        sent.append(SentRequest(rid, spec.route, request_body(spec, rid), spec.fault))
    done: dict[str, Any] = {}

    def clients() -> None:
        try:
            done["outcomes"] = asyncio.run(_send_all(env.gw.url, sent, trial))
        except BaseException as exc:  # handed to the main thread
            done["error"] = exc

    batch = threading.Thread(target=clients, name=f"fuzz-clients-{trial.seed}", daemon=True)
    batch.start()
    note = ""
    try:
        if trial.env_fault is not None:
            note = _apply_env_fault(env, trial.env_fault, batch)
    finally:
        # Every client has its own timeout (CLIENT_TIMEOUT per read); this bound is only a backstop.
        batch.join(CLIENT_TIMEOUT * 2 + 10)
    if "error" in done:
        raise done["error"]
    if "outcomes" not in done:
        raise RuntimeError(f"the clients of trial {trial.seed} did not finish")
    return asyncio.run(env.gather(sent, done["outcomes"])), note


PROBE_TRIES = 4
PROBE_RETRY_SECONDS = 1.0


async def _probe(env: Environment, nonce: str, seed: int) -> Evidence:
    spec = RequestSpec(0, "chat", True, False, 4, None, None, 0.0)
    rid = f"fz-{nonce}-{seed:08x}-health"
    sent = SentRequest(rid, "chat", request_body(spec, rid))
    async with httpx.AsyncClient(timeout=httpx.Timeout(CLIENT_TIMEOUT, connect=5)) as client:
        outcome = await send_request(client, env.gw.url, sent)
    [evidence] = await env.gather([sent], [outcome])
    return evidence


def _probe_until_routed(env: Environment, nonce: str, seed: int) -> Evidence:
    """The normal request after a trial. Envoy may report every replica healthy a moment before the
    sidecar's next EDS answer puts them back in the load balancer (seen on a busy machine): "no healthy
    replica" is asked again, a bounded number of times; any other answer is the verdict."""
    for _ in range(PROBE_TRIES - 1):
        evidence = asyncio.run(_probe(env, nonce, seed))
        if outcome_kind(evidence) != "json_error:no_replica_available":
            return evidence
        time.sleep(PROBE_RETRY_SECONDS)  # the EDS push is not observable from here; bounded
    return asyncio.run(_probe(env, nonce, seed))


def run_trial(env: Environment, trial: TrialSpec, nonce: str) -> TrialResult:
    started = time.monotonic()
    env.restore()
    env.mark_logs()
    envoy_before = env.envoy_pid
    env.close_connections(trial.closing)
    try:
        evidence, note = _batch(env, trial, nonce)
    finally:
        env.close_connections(())
    if trial.closing:
        note = ", ".join(filter(None, [note, "closing " + " ".join(f"{n}@{d}s" for n, d in trial.closing)]))
    violations = [v for ev in evidence for v in check_request(ev)]
    env.restore()
    alive = env.gw.proc.poll() is None
    probe_evidence = _probe_until_routed(env, nonce, trial.seed) if alive else None
    probe = GatewayProbe(
        sidecar_alive=alive,
        envoy_pid_before=envoy_before,
        envoy_pid_after=envoy_pid(env.gw.proc.pid) if alive else None,
        normal_request=probe_evidence,
    )
    violations += check_gateway(probe)
    if probe_evidence is not None:
        evidence.append(probe_evidence)
    return TrialResult(
        trial, evidence, violations, gateway_alive=alive, env_note=note, seconds=time.monotonic() - started
    )


# --- a run ----------------------------------------------------------------------------------------------


@dataclass
class FuzzReport:
    seed: int | None
    trials: int = 0
    requests: int = 0
    outcomes: Counter[str] = field(default_factory=Counter)
    by_route: dict[str, Counter[str]] = field(default_factory=dict)  # route → outcome → requests
    violations: list[tuple[int, Violation]] = field(default_factory=list)  # (trial seed, violation)
    failing_seeds: list[int] = field(default_factory=list)
    env_rebuilds: int = 0
    # Attempts journaled as dead at their connection before their request was sent (not counted).
    never_sent: int = 0
    env_errors: list[str] = field(default_factory=list)
    rss: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def by_invariant(self) -> dict[str, dict[str, list[tuple[int, Violation]]]]:
        """invariant → check → [(trial seed, violation)], invariants by number, checks by count."""
        out: dict[str, dict[str, list[tuple[int, Violation]]]] = {}
        for seed, v in self.violations:
            out.setdefault(v.invariant, {}).setdefault(v.check, []).append((seed, v))
        return {
            inv: dict(sorted(checks.items(), key=lambda kv: -len(kv[1])))
            for inv, checks in sorted(out.items(), key=lambda kv: int(kv[0]))
        }

    def summary(self) -> str:
        lines = [
            f"fuzz: seed {self.seed}, {self.trials} trials, {self.requests} requests in {self.seconds:.0f}s",
            "outcomes: " + ", ".join(f"{k} {n}" for k, n in sorted(self.outcomes.items())),
            *(
                f"  {route} ({sum(kinds.values())}): "
                + ", ".join(f"{k} {n}" for k, n in sorted(kinds.items()))
                for route, kinds in sorted(self.by_route.items())
            ),
            f"attempts that died at their connection before their request was sent (not counted): "
            f"{self.never_sent}",
        ]
        by_inv = self.by_invariant()
        if not by_inv:
            lines.append("violations: none")
        else:
            lines.append(f"violations: {len(self.violations)} in {len(self.failing_seeds)} trials")
        for inv, checks in by_inv.items():
            lines.append(f"  invariant {inv}: {sum(len(items) for items in checks.values())}")
            for check, items in checks.items():
                seeds = sorted({seed for seed, _ in items})
                more = " …" if len(seeds) > 5 else ""
                lines.append(f"    {check}: {len(items)} in trials {seeds[:5]}{more}")
                lines.append(f"      e.g. {items[0][1]}"[:700])
        if self.env_rebuilds or self.env_errors:
            lines.append(f"environments started: {self.env_rebuilds}; testbed errors: {self.env_errors[:3]}")
        lines += [f"memory: {r}" for r in self.rss]
        return "\n".join(lines)


def _report_failure(result: TrialResult, out: TextIO, artifacts: Path | None, max_evidence: int = 3) -> None:
    spec = result.spec
    bad = {v.request_id for v in result.violations}
    print(
        f"\n=== trial {spec.seed} FAILED (replay: python -m tests.fault.fuzz --replay {spec.seed})", file=out
    )
    print(f"spec: {json.dumps(spec.as_json())}", file=out)
    if result.env_note:
        print(f"environment fault: {result.env_note}", file=out)
    for v in result.violations:
        print(f"  {v}"[:1500], file=out)
    shown = [ev for ev in result.evidence if ev.request_id in bad]
    for ev in shown[:max_evidence]:
        print(f"evidence {ev.request_id}: {json.dumps(describe(ev, body_limit=1500))}"[:6000], file=out)
    if artifacts is not None:
        artifacts.mkdir(parents=True, exist_ok=True)
        path = artifacts / f"trial-{spec.seed}.json"
        path.write_text(
            json.dumps(
                {
                    "seed": spec.seed,
                    "spec": spec.as_json(),
                    "env_fault": result.env_note,
                    "violations": [str(v) for v in result.violations],
                    "evidence": [describe(ev, body_limit=1 << 20) for ev in shown],
                },
                indent=1,
            )
        )
        print(f"evidence of all {len(shown)} failing requests: {path}", file=out)
    out.flush()


def run_trials(
    trials: Sequence[TrialSpec],
    *,
    work: Path,
    seed: int | None = None,
    out: TextIO | None = None,
    artifacts: Path | None = None,
    rebuild_every: int = 500,
) -> FuzzReport:
    """Run the trials (grouped by topology: one environment per replica count, rebuilt every
    `rebuild_every` trials and after the gateway died) and check every request."""
    out = out or sys.stdout
    report = FuzzReport(seed)
    nonce = secrets.token_hex(3)
    started = time.monotonic()
    # One environment per replica count, and one with proxies in front of the replicas for the trials whose
    # replicas close connections (the others keep the direct path they always had).
    groups: dict[tuple[int, bool], list[TrialSpec]] = {}
    for trial in trials:
        groups.setdefault((trial.replicas, bool(trial.closing)), []).append(trial)
    for (replicas, closing), group in sorted(groups.items()):
        env: Environment | None = None
        used = 0
        try:
            for trial in group:
                if env is not None and used >= rebuild_every:
                    _close_env(env, report)
                    env = None
                if env is None:
                    env = _start_env(work, replicas, report, out, closing_proxies=closing)
                    used = 0
                used += 1
                try:
                    result = run_trial(env, trial, nonce)
                except EnvironmentBroken as exc:
                    report.env_errors.append(f"trial {trial.seed}: {exc}")
                    print(f"trial {trial.seed}: environment broken ({exc}); rebuilding", file=out)
                    _close_env(env, report)
                    env = None
                    continue
                report.trials += 1
                report.requests += len(trial.requests)
                kinds = Counter(outcome_kind(ev) for ev in result.evidence[: len(trial.requests)])
                report.outcomes.update(kinds)
                for ev in result.evidence[: len(trial.requests)]:
                    report.by_route.setdefault(ev.sent.route, Counter())[outcome_kind(ev)] += 1
                report.never_sent += sum(
                    a.get("detail") == NOT_SENT
                    for ev in result.evidence
                    for a in (ev.journal or {}).get("attempts") or []
                )
                print(
                    f"trial {trial.seed}: {len(trial.requests)} requests on {replicas} replicas"
                    f"{', ' + result.env_note if result.env_note else ''} in {result.seconds:.1f}s: "
                    + ", ".join(f"{k} {n}" for k, n in sorted(kinds.items()))
                    + (f"; {len(result.violations)} VIOLATIONS" if result.violations else ""),
                    file=out,
                    flush=True,
                )
                if result.violations:
                    report.failing_seeds.append(trial.seed)
                    report.violations += [(trial.seed, v) for v in result.violations]
                    _report_failure(result, out, artifacts)
                if not result.gateway_alive:
                    _close_env(env, report)
                    env = None
        finally:
            if env is not None:
                _close_env(env, report)
    report.seconds = time.monotonic() - started
    return report


def _start_env(
    work: Path, replicas: int, report: FuzzReport, out: TextIO, *, closing_proxies: bool = False
) -> Environment:
    """A fresh environment; one failed start (e.g. a port taken meanwhile) is retried once."""
    for attempt in (1, 2):
        report.env_rebuilds += 1
        try:
            return Environment(
                work / f"env-{replicas}-{report.env_rebuilds}", replicas, closing_proxies=closing_proxies
            )
        except Exception as exc:
            report.env_errors.append(f"environment start: {exc}"[:300])
            print(f"environment did not start ({exc})" + ("; once more" if attempt == 1 else ""), file=out)
            if attempt == 2:
                raise
    raise AssertionError("unreachable")


def _close_env(env: Environment, report: FuzzReport) -> None:
    before = env.rss_at_start
    after = env.rss() if env.gateway is not None and env.gateway.proc.poll() is None else (None, None)
    report.rss.append(
        f"{env.work.name}: envoy RSS {_mb(before[0])} → {_mb(after[0])}, "
        f"sidecar RSS {_mb(before[1])} → {_mb(after[1])}"
    )
    env.close()


def _mb(value: float | None) -> str:
    return "?" if value is None else f"{value:.0f} MB"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.fault.fuzz", description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=100)
    parser.add_argument("--seed", type=int, default=None, help="the run's seed (default: random, printed)")
    parser.add_argument("--replay", type=int, default=None, metavar="SEED", help="run exactly this one trial")
    parser.add_argument("--work", type=Path, default=None, help="directory for logs (default: a temp dir)")
    parser.add_argument("--artifacts", type=Path, default=None, help="where failing trials' evidence goes")
    parser.add_argument("--rebuild-every", type=int, default=500, help="fresh environment every N trials")
    args = parser.parse_args(argv)
    work = args.work or Path(tempfile.mkdtemp(prefix="fuzz-"))
    artifacts = args.artifacts or work / "failures"
    if args.replay is not None:
        specs = [draw_trial(args.replay)]
        seed = None
        print(f"replaying trial {args.replay}: {json.dumps(specs[0].as_json())}", flush=True)
    else:
        seed = args.seed if args.seed is not None else secrets.randbits(32)
        specs = [draw_trial(s) for s in trial_seeds(seed, args.trials)]
        print(f"fuzz seed {seed} ({args.trials} trials); work dir {work}", flush=True)
    report = run_trials(specs, work=work, seed=seed, artifacts=artifacts, rebuild_every=args.rebuild_every)
    print(report.summary(), flush=True)
    return 1 if report.violations or report.env_errors else 0


if __name__ == "__main__":
    sys.exit(main())
