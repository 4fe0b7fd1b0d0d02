"""The scenario matrix: what each scenario promises, the request(s) it sends, the fault and the verdict.

The article's test section asks for a replica killed during prefill, after computing a token, right after
the first delta, a path lost with the process alive, and a worker killed after a tool call; the README
adds the ways an upstream ends wrongly after the first delta, and the failure classes of docs/design.md (slow
is not failed, a client that leaves is cancelled). Each scenario runs in the fault modes that can produce
its fault:

* ``sim``: the simulator's per-request fault header (``x-sim-fault``, see `router_testbed.sim.faults`);
* ``hooks``: shell hooks against real replicas (``--kill-cmd``, ``--freeze-cmd``/``--thaw-cmd``);
* ``none``: no fault at all; only scenarios that need none.

Against a gateway that is not router-sidecar, the scenarios whose promise is router-sidecar's own (one
request per Idempotency-Key, tool calls replayed by key) and those whose hook finds the serving replica in
its journal are not applicable; the others run, and their verdicts skip what only router-sidecar keeps
(`verdicts.Verdict.router_sidecar`).

Every scenario runs on one streaming API at a time (`apis.py`: chat completions, completions, the Responses
API, the Messages API): its requests are that API's, and its judge reads the client's bytes by that API's
rules. `--api all` runs the matrix once per API.

A driver sends the requests and records evidence (`client.py`); the judge (`verdicts.py`) decides.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from router_testbed.drill import apis
from router_testbed.drill import verdicts as v
from router_testbed.drill.client import Client, Reaction
from router_testbed.drill.evidence import Exchange, HookRun, SseEvent
from router_testbed.drill.hooks import Hooks

MODES = ("sim", "hooks", "none")
SHORT_TOKENS = 8
SIM_LONG_TOKENS = 40  # the simulator's faults pause a stream where needed; no need for a long one
KEY_RELEASE_WAIT = 5.0  # how long a finished request's key may still count as in flight
# Just over the default limits.max_request_body_bytes (4 MiB): the gateway's own documented refusal.
DEFAULT_OVERSIZE = 4 * 1024 * 1024 + 1024
# Why a reset, not a terminal event, is honest for the Responses API's in-band error (a note when it happens).
RESPONSES_CUT = (
    "vLLM's Responses route ends a stream on a generation error without any event and without its last chunk "
    "(as its engine's death does): the gateway gets a broken body and no proxy can add an event to a reset "
    "stream"
)


@dataclass
class Context:
    """One drill run's settings, shared by every scenario."""

    client: Client
    mode: str  # sim | hooks | none
    model: str
    run_id: str
    hooks: Hooks = field(default_factory=Hooks)
    tool: str | None = None  # NAME or NAME/PATH of a tool routed under /tools/
    long_tokens: int = 400  # a stream long enough to be cut mid-way on a real engine
    oversize_bytes: int = 4 * 1024 * 1024 + 1024
    timeout: float = 30.0
    router_sidecar: bool = True  # the gateway keeps router-sidecar's journal (found by the pre-flight)
    api: str = apis.DEFAULT  # the API this scenario's requests speak
    fallback_model: str | None = None  # the model the gateway's policy falls back to (fallback.models)
    # The gateway whose policy falls back to it, when it is another one than `client`'s.
    fallback_client: Client | None = None

    @property
    def sim(self) -> bool:
        return self.mode == "sim"

    @property
    def spec(self) -> apis.Api:
        return apis.of(self.api)

    def key(self, scenario: str, n: int = 1) -> str:
        """An Idempotency-Key (= the gateway's request id) unique to this run, API, scenario and request
        (chat completions' keys do not name their API)."""
        api = "" if self.api == apis.DEFAULT else f"{self.api}-"
        return f"drill-{self.run_id}-{api}{scenario}-{n}"

    def body(self, max_tokens: int, /, **extra: Any) -> dict[str, Any]:
        """A streamed request of this run's API (`apis.Api.body`: a fixed seed makes a simulated replica's
        generation known in advance; a real engine writes all `max_tokens`)."""
        return self.spec.body(self.model, max_tokens, **extra)

    def exchange(self, label: str, key: str | None, fault: str | None = None) -> Exchange:
        return Exchange(label, "POST", self.spec.path, key, fault=fault, api=self.api)

    def expected_pieces(self, body: dict[str, Any]) -> tuple[str, ...] | None:
        """The text of each content event a simulated replica writes for `body` (None outside sim mode)."""
        if not self.sim:
            return None
        from router_testbed.sim import generation as gen

        try:
            request = gen.parse_request(
                self.spec.sim_kind,  # type: ignore[arg-type]
                json.dumps(body).encode(),
                served_model=str(body["model"]),
            )
        except gen.RequestError:
            return None
        output = gen.plan_output(request, 0)  # the request's own seed wins over the server's
        return tuple(p if isinstance(p, str) else str(p.get("content") or "") for p in output.pieces)


Driver = Callable[[Context, "Scenario"], v.Evidence]


@dataclass(frozen=True)
class Scenario:
    name: str  # for --scenario
    title: str
    promise: str  # what the article / the README promises, in a sentence
    source: str  # where the promise comes from
    checked: str  # what the verdict checks, in a sentence (docs, report)
    drive: Driver
    judge: v.Judge
    sim_fault: str | None = None  # the x-sim-fault header in sim mode
    hooks: tuple[str, ...] = ()  # the hook actions it needs in hooks mode
    sim_hooks: tuple[str, ...] = ()  # ... and in sim mode (a simulator's process frozen by a hook)
    needs_fault: bool = True  # False: runs in every mode without any fault
    needs_tool: bool = False
    needs_fallback: bool = False  # runs only with --fallback-model (a gateway whose policy falls back)
    expect: dict[str, Any] = field(default_factory=dict)  # passed to the judge (what the fault leads to)
    # Why its promise is router-sidecar's own, not one any gateway makes (None: any gateway's).
    router_sidecar_only: str | None = None
    # Per API: another simulator fault where the API's own stream needs one, and what it leads to.
    api_faults: dict[str, str] = field(default_factory=dict)
    api_expect: dict[str, dict[str, Any]] = field(default_factory=dict)
    per_api: bool = True  # False: not an inference API's request (tool-replay): run once, whatever --api

    def fault_for(self, api: str, model: str | None = None) -> str | None:
        """Its simulator fault on `api`; `{model}` in it is the run's model (said so until it is known)."""
        fault = self.api_faults.get(api, self.sim_fault)
        return fault.replace("{model}", model or "MODEL") if fault is not None else None

    def expect_for(self, api: str) -> dict[str, Any]:
        return {**self.expect, **self.api_expect.get(api, {})}

    def needs_router_sidecar(self, mode: str) -> str | None:
        """Why it cannot be judged against another gateway in `mode`, or None when it can."""
        if self.router_sidecar_only is not None:
            return self.router_sidecar_only
        if self.needs_fault and (self.sim_hooks if mode == "sim" else self.hooks if mode == "hooks" else ()):
            return "its hook finds the serving replica in router-sidecar's journal"
        return None

    def runs_in(
        self, mode: str, hooks: Hooks, tool: str | None, fallback_model: str | None = None
    ) -> tuple[bool, str]:
        """Whether it runs in this mode, and if not, why (for a clear usage error)."""
        if self.needs_tool and not tool:
            return False, "needs --tool NAME (a tool service routed by the gateway under /tools/NAME/)"
        if self.needs_fallback and not fallback_model:
            return False, "needs --fallback-model NAME (a model the gateway's fallback.models names)"
        if not self.needs_fault:
            return True, ""
        if mode == "sim":
            if self.sim_fault is None and not self.sim_hooks:
                return False, "has no simulator fault (--fault-mode hooks)"
            missing = [a for a in self.sim_hooks if not hooks.can(a)]
            if missing:
                return False, "needs " + " and ".join(f"--{a}-cmd" for a in missing)
            return True, ""
        if mode == "hooks":
            if not self.hooks:
                return False, "needs the simulator's fault header (--fault-mode sim)"
            missing = [a for a in self.hooks if not hooks.can(a)]
            if missing:
                return False, "needs " + " and ".join(f"--{a}-cmd" for a in missing)
            return True, ""
        return False, "needs a fault (--fault-mode sim or hooks)"

    def fault_in(self, mode: str, api: str = apis.DEFAULT, model: str | None = None) -> str:
        """The fault this scenario injects in `mode` on `api` (requests for `model`), for the report."""
        sim_fault = self.fault_for(api, model)
        if not self.needs_fault:
            # A pause that keeps the stream running while the drill acts; not a failure.
            return f"x-sim-fault: {sim_fault}" if mode == "sim" and sim_fault else "none"
        hooks = " then ".join(f"{a} hook" for a in (self.sim_hooks if mode == "sim" else self.hooks))
        if mode == "sim":
            header = f"x-sim-fault: {sim_fault}" if sim_fault else ""
            return "; ".join(p for p in (header, hooks and f"{hooks} on the serving replica") if p)
        if mode == "hooks":
            return " then ".join(f"{a} hook" for a in self.hooks) + " on the serving replica"
        return "none"


# --- drivers ------------------------------------------------------------------------------------------


def _request(ctx: Context, sc: Scenario, label: str, body: dict[str, Any], n: int = 1) -> Exchange:
    fault = sc.fault_for(ctx.api, ctx.model) if ctx.sim else None
    x = ctx.exchange(label, ctx.key(sc.name, n), fault)
    x.expected_pieces = ctx.expected_pieces(body)
    return x


def drive_one(ctx: Context, sc: Scenario) -> v.Evidence:
    """One streamed request (with the scenario's fault header in sim mode), read to its end."""
    body = ctx.body(SHORT_TOKENS)
    x = _request(ctx, sc, "the request", body)
    ctx.client.send(x, json_body=body)
    ctx.client.settle(x, timeout=ctx.timeout)
    return v.Evidence([x], sim=ctx.sim, expect=sc.expect_for(ctx.api))


def drive_hook_after_first_delta(ctx: Context, sc: Scenario) -> v.Evidence:
    """Sim mode: like `drive_one`. Hooks mode: a long stream; at its first content event the drill looks up
    which replica serves it (the journal names the attempt's replica while it runs) and runs the
    scenario's first hook against it; a freeze is thawed once the stream ended."""
    actions = sc.sim_hooks if ctx.sim else sc.hooks
    if not actions:
        return drive_one(ctx, sc)
    body = ctx.body(ctx.long_tokens)
    x = _request(ctx, sc, "the request", body)
    runs: list[HookRun] = []
    target: list[str] = []
    action = actions[0]

    def on_event(ex: Exchange, event: SseEvent, content: int) -> Reaction:
        if content >= 1 and not runs and ex.request_id is not None:
            replica = ctx.client.serving_replica(ex.request_id)
            if replica is None:
                runs.append(HookRun(action, "?", "", time.time(), time.time(), 1, "no replica in journal"))
                return None
            target.append(replica)
            runs.append(ctx.hooks.run(action, replica))
        return None

    try:
        ctx.client.send(x, json_body=body, on_event=on_event)
    finally:
        for follow_up in actions[1:]:  # thaw: whatever happened, the replica is not left frozen
            if target:
                runs.append(ctx.hooks.run(follow_up, target[0]))
    x.hooks = runs
    ctx.client.settle(x, timeout=ctx.timeout)
    # What a simulator's fault leads to (e.g. its content count) says nothing about a real replica's.
    expect = {"end_within_seconds": ctx.timeout}
    return v.Evidence([x], sim=ctx.sim, expect=expect, hooks=runs)


def drive_freeze_in_prefill(ctx: Context, sc: Scenario) -> v.Evidence:
    """The simulator holds the request before any content (its fault header); meanwhile a watcher reads the
    journal until it names the replica holding the attempt, and freezes it: alive, connected, silent. The
    client's request blocks until the gateway answers (it holds the headers until the first delta), so the
    watcher has its own connection. The replica is thawed once the request ended."""
    body = ctx.body(SHORT_TOKENS)
    x = _request(ctx, sc, "the request", body)
    assert x.request_id is not None
    key = x.request_id
    runs: list[HookRun] = []
    target: list[str] = []
    stop = threading.Event()
    watcher = Client(ctx.client.gateway, credential=ctx.client.credential, timeout=5.0)

    def watch() -> None:
        deadline = time.monotonic() + ctx.timeout
        while not stop.is_set() and time.monotonic() < deadline:
            status, record = watcher.lookup(key)
            attempts = (record or {}).get("attempts") or [] if status == 200 else []
            if attempts and attempts[-1].get("outcome") == "holding":
                target.append(str(attempts[-1].get("replica")))
                runs.append(ctx.hooks.run(sc.sim_hooks[0], target[0]))
                return
            stop.wait(0.02)

    thread = threading.Thread(target=watch, name="drill-freeze-watcher", daemon=True)
    thread.start()
    try:
        ctx.client.send(x, json_body=body)
    finally:
        stop.set()
        thread.join(ctx.client.timeout)
        watcher.close()
        if target:
            runs.append(ctx.hooks.run(sc.sim_hooks[1], target[0]))
    x.hooks = runs
    ctx.client.settle(x, timeout=ctx.timeout)
    return v.Evidence([x], sim=ctx.sim, expect=sc.expect_for(ctx.api), hooks=runs)


def drive_fallback(ctx: Context, sc: Scenario) -> v.Evidence:
    """One streamed request for the run's model, to the gateway whose policy falls back to
    `ctx.fallback_model`; in sim mode every replica of the requested model answers 503 before any content
    (the fault is scoped to the replicas serving it), so only the fallback model's replicas can answer."""
    assert ctx.fallback_model is not None
    client = ctx.fallback_client or ctx.client
    body = ctx.body(SHORT_TOKENS)
    x = _request(ctx, sc, "the request", body)
    x.expected_pieces = ctx.expected_pieces({**body, "model": ctx.fallback_model})  # the fallback's text
    client.send(x, json_body=body)
    client.settle(x, timeout=ctx.timeout)
    expect = {**sc.expect_for(ctx.api), "fallback_model": ctx.fallback_model, "requested_model": ctx.model}
    return v.Evidence([x], sim=ctx.sim, expect=expect)


def drive_disconnect(ctx: Context, sc: Scenario) -> v.Evidence:
    """A stream the client leaves after its third content event (the simulator pauses there, so it is
    still running); then the journal and the replica's log are read."""
    leave_after = int(sc.expect.get("leave_after", 3))
    body = ctx.body(SIM_LONG_TOKENS if ctx.sim else ctx.long_tokens)
    x = _request(ctx, sc, "the request", body)

    def on_event(ex: Exchange, event: SseEvent, content: int) -> Reaction:
        return "leave" if content >= leave_after else None

    ctx.client.send(x, json_body=body, on_event=on_event)
    ctx.client.settle(x, timeout=ctx.timeout)
    return v.Evidence([x], sim=ctx.sim, expect=sc.expect_for(ctx.api))


def drive_duplicate(ctx: Context, sc: Scenario) -> v.Evidence:
    """The first request streams (paused after its first delta in sim mode); at its first content event the
    same Idempotency-Key is sent again; once the first ended and its record says so, once more.

    The gateway lets go of a key a moment after the client read [DONE] (its ext_proc stream ends after the
    response): until then the key is still in flight. So the last request is asked again, for a bounded
    time, while it is told so; how long that lasted is recorded as a note."""
    body = ctx.body(SHORT_TOKENS if ctx.sim else ctx.long_tokens)
    first = _request(ctx, sc, "the first request", body)
    dup = ctx.exchange("the duplicate", first.request_id)

    def on_event(ex: Exchange, event: SseEvent, content: int) -> Reaction:
        if content == 1 and dup.sent_at == 0.0:
            ctx.client.send(dup, json_body=body)
        return None

    ctx.client.send(first, json_body=body, on_event=on_event)
    ctx.client.settle(first, timeout=ctx.timeout)
    settled = time.time()
    deadline = time.monotonic() + KEY_RELEASE_WAIT
    in_flight = 0
    while True:
        after = ctx.exchange("after completion", first.request_id)
        ctx.client.send(after, json_body=body)
        error = after.json_error() or {}
        if error.get("code") != "idempotency_key_in_flight" or time.monotonic() > deadline:
            break
        in_flight += 1
        time.sleep(0.1)
    notes = []
    if in_flight:
        notes.append(
            f"after its record said completed, the key was still answered idempotency_key_in_flight "
            f"{in_flight} time(s), for {after.sent_at - settled:.2f}s"
        )
    return v.Evidence([first, dup, after], sim=ctx.sim, expect=sc.expect_for(ctx.api), notes=notes)


def drive_malformed(ctx: Context, sc: Scenario) -> v.Evidence:
    """Three bad requests: a body that is not JSON, a body over the size limit, a model nobody serves."""
    client = ctx.client
    bad_json = ctx.exchange("invalid JSON", ctx.key(sc.name, 1))
    client.send(bad_json, content=ctx.spec.truncated_json(ctx.model))
    oversize = ctx.exchange("oversize body", ctx.key(sc.name, 2))
    client.send(oversize, json_body=ctx.spec.huge(ctx.model, SHORT_TOKENS, ctx.oversize_bytes))
    unknown = ctx.exchange("unknown model", ctx.key(sc.name, 3))
    client.send(unknown, json_body=ctx.body(SHORT_TOKENS, model=f"drill-no-such-model-{ctx.run_id}"))
    for x in (bad_json, oversize, unknown):
        client.settle(x, expect_record=False, timeout=ctx.timeout)
    return v.Evidence([bad_json, oversize, unknown], sim=ctx.sim, expect=sc.expect_for(ctx.api))


def drive_tool_replay(ctx: Context, sc: Scenario) -> v.Evidence:
    """The same tool call twice with one key, then another body with the same key."""
    assert ctx.tool is not None
    name, _, action = ctx.tool.partition("/")
    path = f"/tools/{name}/{action or 'drill'}"
    key = f"{ctx.key(sc.name)}:call_01"
    call = Exchange("the call", "POST", path, key)
    replay = Exchange("the same call again", "POST", path, key)
    other = Exchange("another body, same key", "POST", path, key)
    body = {"drill": ctx.run_id, "amount": 1}
    ctx.client.send(call, json_body=body)
    ctx.client.send(replay, json_body=body)
    ctx.client.send(other, json_body={**body, "amount": 2})
    return v.Evidence([call, replay, other], sim=ctx.sim, expect=sc.expect_for(ctx.api))


# --- the matrix ---------------------------------------------------------------------------------------

SCENARIOS: tuple[Scenario, ...] = (
    Scenario(
        "healthy",
        "healthy request",
        "No fault: one complete answer from one attempt.",
        "baseline",
        "exactly one clean end ([DONE], response.completed, message_stop), last; one finish; one answer "
        "id and one preamble (Responses: sequence numbers from 0); journal completed, 1 attempt, count = "
        "client's",
        drive_one,
        v.judge_healthy,
        needs_fault=False,
    ),
    Scenario(
        "dies-in-prefill",
        "replica dies during prefill",
        "Killed before the first downstream byte: retried on another replica, one complete answer; the "
        "client sees no trace of the failure.",
        "article, test 1",
        "one complete answer; journal completed with 2 attempts, the first failed, another replica, leases "
        "one after the other; the replica log shows the fault fired before any content",
        drive_one,
        v.judge_retried,
        sim_fault="reset@role attempt=1",
    ),
    Scenario(
        "dies-after-token",
        "replica dies after computing a token",
        "200 and the role event sent (Responses: response.created; Messages: message_start), the process "
        "gone before the first content event: still retried; the client sees no fragment.",
        "article, test 2",
        "as dies-in-prefill: one complete answer from attempt 2, no byte of attempt 1 (one answer id; one "
        "response.created / message_start, sequence numbers gapless from 0)",
        drive_one,
        v.judge_retried,
        sim_fault="reset@token:1 attempt=1",
    ),
    Scenario(
        "dies-after-first-delta",
        "replica dies after the first delta",
        "The first delta was delivered: no retry, no second answer. The client gets the prefix, then a "
        "reset (or one terminal event); the journal keeps the facts under the request id.",
        "article, test 3",
        "the prefix of one attempt, then a reset without the API's end or one terminal event; journal "
        "interrupted, 1 attempt, client <= delivered_output_tokens <= written; x-request-id names the record",
        drive_hook_after_first_delta,
        v.judge_death_after_first_delta,
        sim_fault="delay@after:2 for=0.3; reset@after:2",
        hooks=("kill",),
        expect={"content_before_fault": 2},
    ),
    Scenario(
        "ends-without-done",
        "upstream ends cleanly without its end",
        "After the first delta the body ends cleanly but without its end ([DONE] or a finish; "
        "response.completed; message_stop): exactly one terminal event in the client's API (chat: a frame "
        "then [DONE]; Responses: response.failed; Messages: event: error) — never a silent cut.",
        "README",
        "3 content events, exactly one terminal event (code, request_id, partial_output, retryable=false, "
        "delivered_output_tokens = client's; Responses: the response id and the next sequence number; "
        "Messages: an Anthropic error type), last; journal interrupted with the same count",
        drive_one,
        v.judge_frame_after_first_delta,
        sim_fault="close@after:3",
        expect={"content_before_fault": 3},
    ),
    Scenario(
        "error-after-first-delta",
        "in-band error after the first delta",
        "The replica writes its own error event after the first delta: the client gets the prefix and "
        "exactly one terminal event, never the replica's raw error.",
        "README",
        "2 content events, exactly one terminal event (the gateway's, not the replica's), last; journal "
        "interrupted with the client's count (Responses: vLLM writes no error event, it cuts the body: a "
        "reset is allowed, as for a replica that dies)",
        drive_one,
        v.judge_frame_after_first_delta,
        sim_fault="error@after:2",
        expect={"content_before_fault": 2},
        # vLLM's Responses route ends a stream on a generation error without any event and without its last
        # chunk (docs/simulator.md): the gateway gets a broken body, as from a replica that died. The pause
        # lets the two content events reach the client before the cut, as in dies-after-first-delta.
        api_faults={"responses": "delay@after:2 for=0.3; error@after:2"},
        api_expect={"responses": {"allow_reset": RESPONSES_CUT}},
    ),
    Scenario(
        "client-disconnect",
        "client disconnects mid-stream",
        "The client leaves: the upstream attempt is cancelled (the replica sees it go) and no other "
        "attempt starts.",
        "article (failure class 4)",
        "journal cancelled/client_disconnected, 1 attempt, none started after the client left, client <= "
        "count <= written; the replica log shows one request that saw the client go",
        drive_disconnect,
        v.judge_client_disconnect,
        sim_fault="delay@after:3 for=2",
        needs_fault=False,
        expect={"leave_after": 3},
    ),
    Scenario(
        "slow-replica",
        "slow replica",
        "A long prefill is not a failure: no soft-timeout failover; one attempt, one complete answer, late.",
        "article (failure class 3)",
        "one complete answer, 1 attempt, no attempt_failed/retry/replica_lost/fence in the trace, the "
        "first content only after the replica's delay",
        drive_one,
        v.judge_slow_replica,
        sim_fault="stall@headers for=0.5; delay@token:1 for=0.5",
        expect={"min_first_content_seconds": 1.0},
    ),
    Scenario(
        "all-replicas-fail",
        "all replicas failing",
        "Every allowed attempt fails before content: exactly one JSON error naming the request and why, in "
        "the API's shape; never a partial body or a dead attempt's bytes.",
        "invariant 8, docs/design.md#the-invariants",
        "HTTP 502/503 JSON retries_exhausted with this request_id, in the API's error shape (Messages: "
        "Anthropic's, its type for the status), no SSE bytes; journal failed, every attempt failed, "
        "0 delivered, leases one after the other",
        drive_one,
        v.judge_all_replicas_fail,
        sim_fault="reset@role",
        expect={"code": "retries_exhausted"},
    ),
    Scenario(
        "duplicate-key",
        "duplicate Idempotency-Key",
        "Two requests with one key: one is served; the other is refused — 409 idempotency_key_in_flight "
        "while the first runs, 409 request_already_finished after it; nothing of it reaches the client, and "
        "an attempt of it that reached a replica is cancelled there.",
        "README",
        "the first complete with 1 attempt; the duplicate 409 in flight (or finished, if the first had "
        "ended); after completion 409 request_already_finished, outcome completed; one replica request",
        drive_duplicate,
        v.judge_duplicate_key,
        sim_fault="delay@after:1 for=1",
        needs_fault=False,
        router_sidecar_only="one request per Idempotency-Key (409 for a duplicate) is router-sidecar's",
    ),
    Scenario(
        "malformed-input",
        "malformed input",
        "A body that is not JSON, an oversize body and an unknown model get a clear 4xx JSON error "
        "naming the request, in the API's shape; nothing is served.",
        "README, invariant 10 (docs/design.md#the-invariants)",
        "400 invalid_json and 413 request_too_large naming the request, in the API's error shape; the "
        "unknown model a 4xx JSON error; no SSE bytes; nothing journaled as served",
        drive_malformed,
        v.judge_malformed_input,
        needs_fault=False,
        expect={"codes": {"invalid JSON": "invalid_json", "oversize body": "request_too_large"}},
    ),
    Scenario(
        "tool-replay",
        "tool call replayed, not re-executed",
        "A side-effecting tool call with an idempotency key executes once: the same call again gets the "
        "stored answer; the same key on another call is refused.",
        "article, test 5 (the tool's key, called directly)",
        "the same call twice: identical answer, the second with x-idempotent-replay: true; another body "
        "with the key: 422 idempotency_key_reused",
        drive_tool_replay,
        v.judge_tool_replay,
        needs_fault=False,
        needs_tool=True,
        router_sidecar_only="tool calls replayed by Idempotency-Key under /tools/ are router-sidecar's",
        per_api=False,
    ),
    Scenario(
        "frozen-in-prefill",
        "replica frozen before the first delta",
        "The replica holding the request stops answering before any content (alive, connected, silent): "
        "the gateway fences the attempt — lease revoked, then the cancel ack or the lease's expiry — and "
        "only then retries on another replica; one complete answer, never two attempts publishing.",
        "article, test 4",
        "one complete answer from attempt 2 on another replica; the trace says attempt 1 was lost and fenced "
        "(with its proof) before attempt 2 started; its lease revoked before the next was granted",
        drive_freeze_in_prefill,
        v.judge_frozen_in_prefill,
        sim_fault="delay@role for=20 attempt=1",
        sim_hooks=("freeze", "thaw"),
    ),
    Scenario(
        "frozen-after-first-delta",
        "replica frozen after the first delta",
        "The serving replica stops answering after the first delta but keeps its connection open (path "
        "lost, process alive): the gateway loses it and ends the stream with one terminal event within a "
        "bounded time.",
        "article, test 4; README",
        "the prefix, then exactly one terminal event, last; journal interrupted with replica_lost in the "
        "trace; the time from the freeze to the end of the stream",
        drive_hook_after_first_delta,
        v.judge_frozen_after_first_delta,
        hooks=("freeze", "thaw"),
        sim_hooks=("freeze", "thaw"),
    ),
    Scenario(
        "fallback",
        "fallback to another model",
        "Every replica of the requested model answers 503 before any content: the gateway's fallback model "
        "answers instead, before the first delta only and said out loud — its own answer (its model, its "
        "usage), x-router-fallback naming it, the journal saying why.",
        "issue 25, docs/design.md#fallback",
        "one complete answer whose events name the fallback model, with usage; x-router-fallback names it; "
        "journal completed: the requested model's attempts failed, then one chosen as the fallback, its "
        "fallback record (model, requested_model, one cause per failed attempt) and answered_by_fallback "
        "event; the replica log shows the requested model's replicas failed before content",
        drive_fallback,
        v.judge_fallback,
        sim_fault="status503@headers model={model}",
        needs_fallback=True,
        expect={"cause": "failed_before_content"},
    ),
)

BY_NAME = {s.name: s for s in SCENARIOS}


def _rank(s: Scenario, mode: str) -> int:
    if s.needs_fallback:
        return 3
    used = s.sim_hooks if mode == "sim" else s.hooks if mode == "hooks" else ()
    return 2 if "kill" in used else 1 if used else 0


def run_order(selected: list[Scenario], mode: str) -> list[Scenario]:
    """Matrix order, except that the scenarios that hurt a replica through a hook run last: a thawed replica
    is back only when the gateway's health probe sees it again, a killed one when its own supervisor
    restarts it; the kill runs after the freezes. The fallback, after every failover of the model's own
    (another model answers: the matrix's last word; the demo's gateway for it warms up meanwhile)."""
    return sorted(selected, key=lambda s: _rank(s, mode))


def plan(selected: list[Scenario], mode: str, api_names: list[str]) -> list[tuple[Scenario, str | None]]:
    """The runs: each scenario on each API (one that is not an inference request, tool-replay, once, on no
    API), the matrix of one API after the other; the scenarios that hurt a replica after every other run,
    of every API, the kills last."""
    runs: list[tuple[Scenario, str | None]] = []
    for api in api_names:
        runs += [(s, api) for s in selected if s.per_api]
    runs += [(s, None) for s in selected if not s.per_api]
    return sorted(runs, key=lambda run: _rank(run[0], mode))


@dataclass
class Result:
    scenario: Scenario
    verdict: v.Verdict
    evidence: v.Evidence
    fault: str
    seconds: float
    not_applicable: str | None = None  # why it was not run against this gateway (then never a violation)
    api: str | None = apis.DEFAULT  # the API its requests spoke (None: not an inference API's, tool-replay)

    @property
    def passed(self) -> bool:
        return self.not_applicable is None and self.verdict.passed

    @property
    def violated(self) -> bool:
        return self.not_applicable is None and not self.verdict.passed

    @property
    def status(self) -> str:
        return "N/A" if self.not_applicable is not None else "PASS" if self.verdict.passed else "FAIL"


def not_applicable(sc: Scenario, mode: str, why: str, api: str | None = apis.DEFAULT) -> Result:
    fault = sc.fault_in(mode, api or apis.DEFAULT)
    return Result(sc, v.Verdict(), v.Evidence([]), fault, 0.0, not_applicable=why, api=api)


def run_scenario(ctx: Context, sc: Scenario) -> Result:
    """Run `sc` on `ctx.api` (tool-replay on no API) and judge it."""
    started = time.monotonic()
    try:
        evidence = sc.drive(ctx, sc)
        evidence.router_sidecar = ctx.router_sidecar
        verdict = sc.judge(evidence)
    except Exception as exc:  # a driver that broke is a failed scenario with its reason, not a crash
        evidence = v.Evidence([], sim=ctx.sim, router_sidecar=ctx.router_sidecar)
        verdict = v.Verdict(router_sidecar=ctx.router_sidecar)
        verdict.check("the scenario ran", False, f"the drill's driver raised {type(exc).__name__}: {exc}")
    verdict.notes[:0] = evidence.notes
    # Inconclusive (the fault's effect cannot be seen behind this gateway) is not a pass; a failed check is
    # still a violation.
    inconclusive = verdict.inconclusive if not verdict.failed else None
    return Result(
        sc,
        verdict,
        evidence,
        sc.fault_in(ctx.mode, ctx.api, ctx.model),
        time.monotonic() - started,
        not_applicable=inconclusive,
        api=ctx.api if sc.per_api else None,
    )
