"""`router-sidecar demo`: etcd + two simulated replicas + the gateway, then six failure scenarios.

Each scenario streams one request live to the terminal, prints the request's journal beside what the
client saw, and ends with one verdict line computed from the client's bytes and the journal:

    VERDICT n/6 PASS|FAIL  <title>: <what was checked>

Exit code 0 only if every verdict passed. Every process runs on 127.0.0.1 in a temp dir and is
stopped in a ``finally`` (also on Ctrl-C).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from router_sidecar.runtime.supervise import Child, find_etcd, free_port, http_ok, wait_until
from router_testbed.sim.log import read_log
from router_testbed.sim.process import SimProcess, spawn

TERMINAL_PHASES = frozenset({"completed", "interrupted", "cancelled", "rejected", "failed"})
# Trace events that close a request's story: a look-up may show a terminal phase a moment before the
# trace holds its closing event, so the demo waits for both.
TERMINAL_EVENTS = frozenset(
    {
        "stream_completed",
        "stream_terminated",
        "stream_reset",
        "client_disconnected",
        "request_failed",
        "request_rejected",
    }
)
REPLICA_NAMES = ("replica-a", "replica-b")
PREFILL_DELAY = 0.05
TOKEN_INTERVAL = 0.02
FAST_TOKEN_INTERVAL = 0.002
# The demo's caller: journal look-ups are scoped to a credential (and refused without one).
CREDENTIAL = {"Authorization": "Bearer demo"}
JOURNAL_TIMEOUT = 10.0
REQUEST_TIMEOUT = 20.0
TOTAL = 6


# --------------------------------------------------------------------------- terminal output


class Style:
    """ANSI styling, only on a TTY and without NO_COLOR."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled

    def _wrap(self, code: str, text: str) -> str:
        return f"\033[{code}m{text}\033[0m" if self.enabled else text

    def bold(self, text: str) -> str:
        return self._wrap("1", text)

    def dim(self, text: str) -> str:
        return self._wrap("2", text)

    def red(self, text: str) -> str:
        return self._wrap("31", text)

    def green(self, text: str) -> str:
        return self._wrap("32", text)

    def yellow(self, text: str) -> str:
        return self._wrap("33", text)


S = Style(sys.stdout.isatty() and not os.environ.get("NO_COLOR"))


def out(text: str = "", end: str = "\n") -> None:
    print(text, end=end, flush=True)


# --------------------------------------------------------------------------- what the client saw


@dataclass
class ClientView:
    """The raw bytes of one streamed response, split into SSE events."""

    status: int = 0
    headers: dict[str, str] = field(default_factory=dict)
    raw: bytes = b""
    transport_error: str | None = None
    disconnected: bool = False  # the client itself went away

    @property
    def request_id(self) -> str:
        return self.headers.get("x-request-id", "")

    @property
    def payloads(self) -> list[Any]:
        """The data of every complete SSE event: parsed JSON, or the string ``[DONE]``."""
        result: list[Any] = []
        for event in split_events(self.raw)[0]:
            data = event_data(event)
            if data is not None:
                result.append(data)
        return result

    @property
    def content_chunks(self) -> list[dict[str, Any]]:
        return [p for p in self.payloads if isinstance(p, dict) and content_of(p) is not None]

    @property
    def content_ids(self) -> set[str]:
        """Completion ids of the content chunks: one id = one attempt's generation."""
        return {str(p.get("id")) for p in self.content_chunks}

    @property
    def error_frames(self) -> list[dict[str, Any]]:
        return [p["error"] for p in self.payloads if isinstance(p, dict) and isinstance(p.get("error"), dict)]

    @property
    def done_count(self) -> int:
        return sum(1 for p in self.payloads if p == "[DONE]")

    @property
    def ends_with_done(self) -> bool:
        payloads = self.payloads
        return bool(payloads) and payloads[-1] == "[DONE]"

    @property
    def text(self) -> str:
        return "".join(content_of(p) or "" for p in self.content_chunks)


def split_events(buf: bytes) -> tuple[list[bytes], bytes]:
    """Complete SSE events in ``buf`` and the unterminated rest."""
    buf = buf.replace(b"\r\n", b"\n")
    *events, rest = buf.split(b"\n\n")
    return [e for e in events if e.strip()], rest


def event_data(event: bytes) -> Any:
    lines = [ln[5:].lstrip() for ln in event.split(b"\n") if ln.startswith(b"data:")]
    if not lines:
        return None  # comment / keep-alive
    payload = b"\n".join(lines)
    if payload == b"[DONE]":
        return "[DONE]"
    try:
        return json.loads(payload)
    except ValueError:
        return {"unparseable": payload.decode(errors="replace")}


def content_of(payload: dict[str, Any]) -> str | None:
    """User-visible content of a chunk (DESIGN §2 "first delta"), or None for role-only/empty chunks."""
    choices = payload.get("choices") or []
    if not choices:
        return None
    choice = choices[0]
    delta = choice.get("delta") or {}
    for value in (delta.get("content"), delta.get("reasoning_content"), choice.get("text")):
        if value:
            return str(value)
    if delta.get("tool_calls"):
        return "<tool_call>"
    return None


class LivePrinter:
    """Prints a stream compactly as its events arrive: deltas separated by '|', markers in brackets."""

    def __init__(self) -> None:
        self.pending = b""
        self.started = False

    def _begin(self) -> None:
        if not self.started:
            out("  client  ", end="")
            self.started = True

    def feed(self, chunk: bytes) -> None:
        events, self.pending = split_events(self.pending + chunk)
        for event in events:
            self._show(event_data(event))

    def _show(self, data: Any) -> None:
        self._begin()
        if data is None:
            out(S.dim("[:keep-alive]"), end="")
        elif data == "[DONE]":
            out(S.green("[DONE]"), end="")
        elif isinstance(data, dict) and isinstance(data.get("error"), dict):
            err = data["error"]
            tokens = err.get("delivered_output_tokens")
            out(S.yellow(f"[error frame: {err.get('code')}, delivered_output_tokens={tokens}]"), end="")
        elif isinstance(data, dict) and (text := content_of(data)) is not None:
            out(text + S.dim("|"), end="")
        elif isinstance(data, dict) and data.get("choices"):
            delta = data["choices"][0].get("delta") or {}
            out(S.dim("[role]" if "role" in delta else "[empty]"), end="")
        else:
            out(S.dim("[other]"), end="")

    def finish(self, view: ClientView) -> None:
        self._begin()
        if self.pending.strip():
            out(S.red(f"[{len(self.pending)} bytes of a torn event]"), end="")
        if view.disconnected:
            out(S.yellow(" [client disconnects]"), end="")
        if view.transport_error:
            out(S.red(f" [transport reset: {view.transport_error}]"), end="")
        out()


def stream_request(
    url: str,
    *,
    fault: str | None,
    max_tokens: int,
    disconnect_after: int | None,
    extra_body: dict[str, Any] | None = None,
    on_chunk: Callable[[ClientView], None] | None = None,
) -> ClientView:
    """POST a streamed chat completion, print it live; a transport error is recorded, not raised."""
    view = ClientView()
    headers = {"x-sim-fault": fault} if fault else {}
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "Tell me a short story"}],
        "stream": True,
        "max_tokens": max_tokens,
        **(extra_body or {}),
    }
    printer = LivePrinter()
    with httpx.Client(timeout=REQUEST_TIMEOUT) as client:
        try:
            with client.stream(
                "POST", f"{url}/v1/chat/completions", json=body, headers={**CREDENTIAL, **(headers or {})}
            ) as response:
                view.status, view.headers = response.status_code, dict(response.headers)
                out(f"  HTTP {view.status}, x-request-id: {view.request_id}")
                for chunk in response.iter_raw():
                    view.raw += chunk
                    printer.feed(chunk)
                    if on_chunk is not None:
                        on_chunk(view)
                    if disconnect_after is not None and len(view.content_chunks) >= disconnect_after:
                        view.disconnected = True
                        break  # leaving the block closes the connection: a client disconnect
        except httpx.TransportError as exc:
            view.transport_error = type(exc).__name__
    printer.finish(view)
    return view


# --------------------------------------------------------------------------- the stack


class Stack:
    """etcd, two simulated replicas and the gateway, all on loopback under ``work``."""

    def __init__(self, work: Path, *, token_interval: float) -> None:
        self.work = work
        self.token_interval = token_interval
        self.etcd: Child | None = None
        self.etcd_endpoint = ""
        self.sims: dict[str, SimProcess] = {}
        self.gateway: subprocess.Popen[bytes] | None = None
        self.url = ""

    def sim_log(self, name: str) -> Path:
        return self.work / f"sim-{name}.jsonl"

    def _spawn_sim(self, name: str, port: int = 0) -> SimProcess:
        args = ["--prefill-delay", str(PREFILL_DELAY), "--token-interval", str(self.token_interval)]
        return spawn(name=name, port=port, log_path=self.sim_log(name), args=args)

    def _start_etcd(self) -> None:
        # Like supervise.start_etcd, but the Child is ours before the health wait, so a Ctrl-C or a
        # failed start-up still stops it.
        peer = free_port()
        self.etcd_endpoint = f"127.0.0.1:{free_port()}"
        client_url, peer_url = f"http://{self.etcd_endpoint}", f"http://127.0.0.1:{peer}"
        options = {
            "--name": "demo",
            "--data-dir": str(self.work / "etcd-data"),
            "--listen-client-urls": client_url,
            "--advertise-client-urls": client_url,
            "--listen-peer-urls": peer_url,
            "--initial-advertise-peer-urls": peer_url,
            "--initial-cluster": f"demo={peer_url}",
            "--log-level": "warn",
        }
        argv = [find_etcd(), *(part for item in options.items() for part in item)]
        self.etcd = Child("etcd", argv, log_path=self.work / "etcd.log")
        wait_until(
            lambda: http_ok(f"{client_url}/health"),
            timeout=20,
            what=f"etcd on {self.etcd_endpoint}",
            child=self.etcd,
        )

    def start(self) -> None:
        t0 = time.monotonic()
        self._start_etcd()
        self._start_replicas()
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        argv = [
            sys.executable,
            "-m",
            "router_sidecar",
            "gateway",
            "--listen",
            f"127.0.0.1:{port}",
            "--etcd",
            self.etcd_endpoint,
            "--work-dir",
            str(self.work / "gateway"),
        ]
        for address in self.replica_addresses().values():
            argv += ["--replica", address]
        gw_out = self.work / "gateway.out"
        with open(gw_out, "wb") as stdout, open(self.work / "gateway.err", "wb") as stderr:
            # Own session: Ctrl-C reaches only the demo, which then stops the gateway in order.
            self.gateway = subprocess.Popen(
                argv, stdout=stdout, stderr=stderr, stdin=subprocess.DEVNULL, start_new_session=True
            )
        deadline = time.monotonic() + 40
        while b"ready" not in gw_out.read_bytes():
            if self.gateway.poll() is not None or time.monotonic() > deadline:
                err = (self.work / "gateway.err").read_text(errors="replace")[-3000:]
                raise RuntimeError(f"gateway did not become ready (exit {self.gateway.poll()}):\n{err}")
            time.sleep(0.05)
        out(S.dim(f"  etcd {self.etcd_endpoint}; {self.describe_replicas()}"))
        out(
            S.dim(
                f"  gateway {self.url} (Envoy + sidecar, pid {self.gateway.pid}); "
                f"up in {time.monotonic() - t0:.1f}s"
            )
        )

    def _start_replicas(self) -> None:
        for name in REPLICA_NAMES:
            self.sims[name] = self._spawn_sim(name)

    def replica_addresses(self) -> dict[str, str]:
        return {name: sim.address for name, sim in self.sims.items()}

    def describe_replicas(self) -> str:
        return ", ".join(f"{n} {s.address} (pid {s.pid})" for n, s in self.sims.items())

    def check_gateway(self) -> None:
        """Fail loudly if the gateway process is gone (its exit code tells a crash from a signal)."""
        if self.gateway is not None and (code := self.gateway.poll()) is not None:
            err = (self.work / "gateway.err").read_text(errors="replace")[-2000:]
            raise RuntimeError(
                f"the gateway process exited with {code} (negative = killed by that signal):\n{err}"
            )

    def replica_name(self, address: str | None) -> str:
        for name, replica_address in self.replica_addresses().items():
            if replica_address == address:
                return name
        return str(address)

    def restart_dead_sims(self) -> list[str]:
        """Start again, on the same port, every replica whose process has exited."""
        restarted = []
        for name, sim in self.sims.items():
            if sim.proc.poll() is not None:
                code = sim.stop()
                self.sims[name] = self._spawn_sim(name, sim.port)
                restarted.append(
                    f"{name} (exited with {code}; restarted on {sim.address}, pid {self.sims[name].pid})"
                )
        return restarted

    def journal(self, request_id: str) -> dict[str, Any]:
        """Poll the journal until its phase is terminal and its trace has a closing event."""
        deadline = time.monotonic() + JOURNAL_TIMEOUT
        last: dict[str, Any] = {}
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.HTTPError, ValueError):
                response = httpx.get(f"{self.url}/v1/requests/{request_id}", headers=CREDENTIAL, timeout=2)
                if response.status_code == 200:
                    last = response.json()
                    names = {e.get("event") for e in last.get("events") or []}
                    if last.get("phase") in TERMINAL_PHASES and names & TERMINAL_EVENTS:
                        return last
            time.sleep(0.05)
        return last

    def sim_records(self, request_id: str) -> list[dict[str, Any]]:
        """The replicas' end-of-request log records for this request, from both logs."""
        records = []
        for name in REPLICA_NAMES:
            records += [
                r
                for r in read_log(self.sim_log(name))
                if r.get("request_id") == request_id and r.get("event") == "end"
            ]
        return records

    def stop(self) -> None:
        """Stop the gateway (it stops Envoy), then the replicas, then etcd; each even if another fails."""
        try:
            if self.gateway is not None and self.gateway.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.gateway.pid, signal.SIGTERM)
                try:
                    self.gateway.wait(15)
                except subprocess.TimeoutExpired:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(self.gateway.pid, signal.SIGKILL)
                    self.gateway.wait(5)
        finally:
            for sim in self.sims.values():
                with contextlib.suppress(Exception):
                    sim.stop()
            self._stop_replicas()
            if self.etcd is not None:
                self.etcd.stop()

    def _stop_replicas(self) -> None:
        """Extra replicas of a subclass (the simulators are stopped in ``stop``)."""


# --------------------------------------------------------------------------- scenarios


@dataclass
class Outcome:
    """One scenario's evidence and the checks computed from it."""

    view: ClientView
    journal: dict[str, Any]
    checks: list[tuple[str, bool]] = field(default_factory=list)

    def check(self, label: str, ok: bool) -> None:
        self.checks.append((label, ok))

    @property
    def passed(self) -> bool:
        return bool(self.checks) and all(ok for _, ok in self.checks)

    @property
    def attempts(self) -> list[dict[str, Any]]:
        return list(self.journal.get("attempts") or [])

    @property
    def delivered(self) -> Any:
        return self.journal.get("delivered_output_tokens")


Checker = Callable[[Outcome, "Stack"], None]


@dataclass
class Scenario:
    title: str
    story: str
    fault: str | None
    check: Checker
    max_tokens: int = 8
    disconnect_after: int | None = None
    show_lookup: bool = False
    show_replica_log: bool = False


def _common(o: Outcome, *, phase: str, attempts: int, written: int | None = None) -> None:
    """`written`: for a client that left on its own, what the replica wrote. "Delivered" is what the gateway
    wrote towards the client; the events in flight when the client left were delivered, never read."""
    n_ids = len(o.view.content_ids)
    o.check(f"content from {n_ids} attempt{'' if n_ids == 1 else 's'}", n_ids == 1)
    o.check(f"journal phase={o.journal.get('phase')}", o.journal.get("phase") == phase)
    o.check(
        f"{len(o.attempts)} attempt{'' if len(o.attempts) == 1 else 's'} in journal",
        len(o.attempts) == attempts,
    )
    client_tokens = len(o.view.content_chunks)
    if written is None:
        o.check(
            f"delivered_output_tokens={o.delivered} matches client ({client_tokens})",
            o.delivered == client_tokens,
        )
    else:
        o.check(
            f"delivered_output_tokens={o.delivered}: at least what the client read ({client_tokens}), "
            f"at most what the replica wrote ({written})",
            o.delivered is not None and client_tokens <= o.delivered <= written,
        )


def _complete_answer(o: Outcome, stack: Stack, attempts: int) -> None:
    _common(o, phase="completed", attempts=attempts)
    o.check(
        "one complete answer ending in [DONE]",
        o.view.ends_with_done
        and o.view.done_count == 1
        and not o.view.error_frames
        and o.view.transport_error is None,
    )
    if attempts > 1:
        first, last = o.attempts[0], o.attempts[-1]
        o.check(
            f"attempt 1 on {stack.replica_name(first.get('replica'))} failed, "
            f"attempt {attempts} on {stack.replica_name(last.get('replica'))}",
            first.get("outcome") == "failed" and first.get("replica") != last.get("replica"),
        )
    o.check("first_delta_sent", o.journal.get("first_delta_sent") is True)


def check_healthy(o: Outcome, stack: Stack) -> None:
    _complete_answer(o, stack, attempts=1)


def check_failover(o: Outcome, stack: Stack) -> None:
    _complete_answer(o, stack, attempts=2)


def check_reset_after_delta(o: Outcome, stack: Stack) -> None:
    _common(o, phase="interrupted", attempts=1)
    o.check(
        f"client saw a transport reset after {len(o.view.content_chunks)} deltas",
        o.view.transport_error is not None and o.view.done_count == 0 and len(o.view.content_chunks) == 2,
    )
    # The reset cannot carry an error frame, so the client looks the outcome up by request id.
    looked_up = stack.journal(o.view.request_id) if o.view.request_id else {}
    o.check(
        "look-up by x-request-id answers interrupted",
        looked_up.get("request_id") == o.view.request_id and looked_up.get("phase") == "interrupted",
    )


def check_clean_close(o: Outcome, stack: Stack) -> None:
    _common(o, phase="interrupted", attempts=1)
    frames = o.view.error_frames
    payloads = o.view.payloads
    tail_ok = (
        len(payloads) >= 2
        and isinstance(payloads[-2], dict)
        and "error" in payloads[-2]
        and payloads[-1] == "[DONE]"
    )
    o.check(
        f"{len(frames)} terminal frame, then [DONE]", len(frames) == 1 and tail_ok and o.view.done_count == 1
    )
    code = frames[0].get("code") if frames else None
    o.check(f"code={code}", code == "upstream_decode_interrupted")
    frame_tokens = frames[0].get("delivered_output_tokens") if frames else None
    o.check(
        f"frame delivered_output_tokens={frame_tokens} matches client",
        frame_tokens == len(o.view.content_chunks) == 3,
    )


def check_client_gone(o: Outcome, stack: Stack) -> None:
    records = _wait(lambda: stack.sim_records(o.view.request_id), timeout=5.0)
    written = sum(int(r.get("content_events_written") or 0) for r in records)
    _common(o, phase="cancelled", attempts=1, written=written)
    gone = [r for r in records if r.get("client_gone_at") is not None]
    where = gone[0]["replica"] if gone else "no replica"
    o.check(f"{where}'s log shows the client went away", len(gone) == 1)
    o.check(f"{len(records)} replica request(s) for this id (no second attempt)", len(records) == 1)


def _wait(fetch: Callable[[], list[dict[str, Any]]], timeout: float) -> list[dict[str, Any]]:
    deadline = time.monotonic() + timeout
    while not (found := fetch()) and time.monotonic() < deadline:
        time.sleep(0.05)
    return found


SCENARIOS: list[Scenario] = [
    Scenario("healthy request", "no fault: one complete answer", None, check_healthy),
    Scenario(
        "replica dies during prefill",
        "first attempt resets before any byte reached the client: "
        "retried on the other replica, invisible to the client",
        "reset@role attempt=1",
        check_failover,
    ),
    Scenario(
        "replica dies after computing a token",
        "200 + role event sent, then the process exits before the "
        "first content event: the held headers make it retriable",
        "exit@token:1 attempt=1",
        check_failover,
    ),
    Scenario(
        "replica dies after the first delta",
        "2 deltas delivered, then a TCP reset: no retry, the client "
        "gets the prefix and a reset, the journal keeps the facts",
        "delay@after:2 for=0.3; reset@after:2",
        check_reset_after_delta,
        show_lookup=True,
    ),
    Scenario(
        "upstream ends cleanly without [DONE]",
        "3 deltas, then a clean end of the body: the gateway adds exactly one terminal error frame",
        "close@after:3",
        check_clean_close,
    ),
    Scenario(
        "client disconnects mid-stream",
        "the client leaves after 3 deltas: the attempt is cancelled and no other is started",
        None,
        check_client_gone,
        max_tokens=40,
        disconnect_after=3,
        show_replica_log=True,
    ),
]


# --------------------------------------------------------------------------- journal display


def print_journal(journal: dict[str, Any], stack: Stack) -> None:
    if not journal:
        out(S.red("  journal  (no record)"))
        return
    out(
        f"  journal  phase={journal.get('phase')} outcome={journal.get('outcome')} "
        f"first_delta_sent={journal.get('first_delta_sent')} "
        f"delivered_output_tokens={journal.get('delivered_output_tokens')}"
    )
    for a in journal.get("attempts") or []:
        detail = f" ({a['detail']})" if a.get("detail") else ""
        replica = stack.replica_name(a.get("replica"))
        outcome = f"{a.get('outcome')}{detail}"
        out(f"           attempt {a.get('attempt')} {a.get('attempt_id')} on {replica}: {outcome}")
    events = journal.get("events") or []
    if not events:
        out(S.yellow("           events: (none recorded)"))
        return
    t0 = events[0].get("t", 0.0)
    parts = [f"{e.get('event')} +{(e.get('t', t0) - t0) * 1000:.0f}ms" for e in events]
    out("           events: " + ", ".join(parts))


def run_scenario(n: int, scenario: Scenario, stack: Stack) -> bool:
    out()
    out(S.bold(f"=== {n}/{TOTAL} {scenario.title} ==="))
    out(S.dim(f"  {scenario.story}"))
    if scenario.fault:
        out(f"  x-sim-fault: {scenario.fault}")
    view = stream_request(
        stack.url,
        fault=scenario.fault,
        max_tokens=scenario.max_tokens,
        disconnect_after=scenario.disconnect_after,
    )
    journal = stack.journal(view.request_id) if view.request_id else {}
    if scenario.show_lookup:
        url = f"{stack.url}/v1/requests/{view.request_id}"
        out(f"  look-up  GET {url}  (id from the x-request-id response header)")
    print_journal(journal, stack)
    outcome = Outcome(view, journal)
    try:
        scenario.check(outcome, stack)
    except Exception as exc:  # a malformed answer is a failed check, not a crash of the demo
        outcome.check(f"checks raised {type(exc).__name__}: {exc}", False)
    if scenario.show_replica_log:
        for r in stack.sim_records(view.request_id):
            gone = r.get("client_gone_at")
            seen = (
                f"saw the client go away +{(gone - r['t_start']) * 1000:.0f}ms"
                if gone
                else "never saw the client go"
            )
            out(
                f"  replica  {r.get('replica')} log: outcome={r.get('outcome')}, "
                f"{r.get('content_events_written')} content events written, {seen}"
            )
    verdict = S.green("PASS") if outcome.passed else S.red("FAIL")
    summary = ", ".join(label for label, _ in outcome.checks)
    failed = [label for label, ok in outcome.checks if not ok]
    out(f"VERDICT {n}/{TOTAL} {verdict}  {scenario.title}: {summary}")
    if failed:
        out(S.red(f"  failed: {'; '.join(failed)}"))
    return outcome.passed


# --------------------------------------------------------------------------- main


@contextlib.contextmanager
def _sigterm_as_interrupt() -> Iterator[None]:
    """Turn SIGTERM into KeyboardInterrupt so the ``finally`` still stops every child."""

    def handler(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="router-sidecar demo", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--keep", action="store_true", help="keep the temp dir (logs, journals) and print its path"
    )
    parser.add_argument(
        "--fast", action="store_true", help=f"token interval {FAST_TOKEN_INTERVAL}s (for tests)"
    )
    parser.add_argument(
        "--real-vllm",
        action="store_true",
        help="real vLLM replicas (tiny local model, CPU; needs `make real-setup`) instead of the simulator",
    )
    args = parser.parse_args(argv)
    if args.real_vllm:
        return run_real_demo(keep=args.keep)

    work = Path(tempfile.mkdtemp(prefix="router-sidecar-demo-"))
    stack = Stack(work, token_interval=FAST_TOKEN_INTERVAL if args.fast else TOKEN_INTERVAL)
    results: list[bool] = []
    started = time.monotonic()
    try:
        with _sigterm_as_interrupt():
            out(S.bold("router-sidecar demo: first-delta failover, on etcd + 2 simulated replicas + Envoy"))
            stack.start()
            for n, scenario in enumerate(SCENARIOS, 1):
                results.append(run_scenario(n, scenario, stack))
                stack.check_gateway()
                for note in stack.restart_dead_sims():
                    out(S.yellow(f"  note: replica process gone: {note}"))
    except KeyboardInterrupt:
        out(S.red("\ninterrupted; stopping everything"))
        return 130
    except Exception as exc:
        out(S.red(f"\ndemo could not run: {type(exc).__name__}: {exc}"))
        return 1
    finally:
        stack.stop()
        if args.keep:
            out(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    passed = sum(results)
    ok = passed == TOTAL
    line = f"{passed}/{TOTAL} scenarios passed in {time.monotonic() - started:.1f}s"
    out()
    out(S.green(line) if ok else S.red(line))
    return 0 if ok else 1


# --------------------------------------------------------------------------- --real-vllm

REAL_TOTAL = 4
REAL_START_TIMEOUT = 120.0  # two replicas load at once on 2 cores
USAGE = {"include_usage": True, "continuous_usage_stats": True}


class RealStack(Stack):
    """etcd, two real vLLM replicas (``router_testbed.real_engine``) and the gateway."""

    def __init__(self, work: Path) -> None:
        super().__init__(work, token_interval=0.0)
        from router_testbed.real_engine import VllmReplica

        self.vllm: dict[str, VllmReplica] = {}

    def _start_replicas(self) -> None:
        from router_testbed.real_engine import find_installation, start_replicas

        install, why = find_installation()
        if install is None:
            raise RuntimeError(why)
        out(S.dim("  starting 2 vLLM replicas (tiny random-weight model, CPU): 25-60 s ..."))
        self.vllm = start_replicas(list(REPLICA_NAMES), install, self.work, timeout=REAL_START_TIMEOUT)

    def replica_addresses(self) -> dict[str, str]:
        return {name: r.endpoint for name, r in self.vllm.items()}

    def describe_replicas(self) -> str:
        return ", ".join(
            f"{n} vLLM {r.endpoint} (pid {r.pid}, ready in {r.started_in:.0f}s)" for n, r in self.vllm.items()
        )

    def restart_dead_sims(self) -> list[str]:
        dead = [r for r in self.vllm.values() if not r.healthy()]
        for r in dead:
            r.stop()
            r.start(wait=False)
        return [
            f"{r.name} (restarted on {r.endpoint} in {r.wait_ready(REAL_START_TIMEOUT):.0f}s)" for r in dead
        ]

    def served_by(self, request_id: str) -> Any:
        attempts = self.journal_now(request_id).get("attempts") or []
        address = attempts[-1].get("replica") if attempts else None
        return next((r for r in self.vllm.values() if r.endpoint == address), None)

    def journal_now(self, request_id: str) -> dict[str, Any]:
        with contextlib.suppress(httpx.HTTPError, ValueError):
            response = httpx.get(f"{self.url}/v1/requests/{request_id}", headers=CREDENTIAL, timeout=2)
            if response.status_code == 200:
                return dict(response.json())
        return {}

    def _stop_replicas(self) -> None:
        for r in self.vllm.values():
            with contextlib.suppress(Exception):
                r.stop()


def _usage_tokens(view: ClientView) -> int | None:
    found = None
    for p in view.payloads:
        if isinstance(p, dict) and isinstance(p.get("usage"), dict):
            found = p["usage"].get("completion_tokens")
    return found


def _real_common(o: Outcome, *, phase: str, attempts: int) -> None:
    n_ids = len(o.view.content_ids)
    o.check(f"content from {n_ids} attempt{'' if n_ids == 1 else 's'}", n_ids == 1)
    o.check(f"journal phase={o.journal.get('phase')}", o.journal.get("phase") == phase)
    o.check(f"{len(o.attempts)} attempt(s) in journal", len(o.attempts) == attempts)


def _real_delivered(o: Outcome) -> None:
    client = _usage_tokens(o.view)
    source = o.journal.get("delivered_output_tokens_source")
    o.check(
        f"delivered_output_tokens={o.delivered} ({source}) matches the client's usage ({client})",
        o.delivered == client and source == "usage",
    )


def _real_complete(o: Outcome, attempts: int) -> None:
    _real_common(o, phase="completed", attempts=attempts)
    _real_delivered(o)
    o.check(
        "one complete answer ending in [DONE]",
        o.view.ends_with_done and o.view.done_count == 1 and not o.view.error_frames,
    )


def run_real_demo(*, keep: bool = False) -> int:
    """The demo on real vLLM: healthy, engine death before the first delta, pod death after it, client
    gone."""
    work = Path(tempfile.mkdtemp(prefix="router-sidecar-demo-real-"))
    stack = RealStack(work)
    results: list[bool] = []
    started = time.monotonic()

    def scenario(n: int, title: str, story: str, run: Callable[[], Outcome]) -> None:
        out()
        out(S.bold(f"=== {n}/{REAL_TOTAL} {title} ==="))
        out(S.dim(f"  {story}"))
        try:
            outcome = run()
        except Exception as exc:
            outcome = Outcome(ClientView(), {})
            outcome.check(f"scenario raised {type(exc).__name__}: {exc}", False)
        if outcome.journal:
            print_journal(outcome.journal, stack)
        verdict = S.green("PASS") if outcome.passed else S.red("FAIL")
        out(
            f"VERDICT {n}/{REAL_TOTAL} {verdict}  {title}: " + ", ".join(label for label, _ in outcome.checks)
        )
        failed = [label for label, ok in outcome.checks if not ok]
        if failed:
            out(S.red(f"  failed: {'; '.join(failed)}"))
        results.append(outcome.passed)
        stack.check_gateway()
        for note in stack.restart_dead_sims():
            out(S.yellow(f"  note: replica restarted: {note}"))

    def request(max_tokens: int, **kw: Any) -> ClientView:
        return stream_request(
            stack.url,
            fault=None,
            max_tokens=max_tokens,
            disconnect_after=kw.pop("disconnect_after", None),
            extra_body={"ignore_eos": True, "stream_options": USAGE},
            **kw,
        )

    def healthy() -> Outcome:
        view = request(12)
        o = Outcome(view, stack.journal(view.request_id))
        _real_complete(o, attempts=1)
        return o

    def engine_dies_before_first_delta() -> Outcome:
        victim = stack.vllm["replica-a"]
        worker = victim.engine_worker_pid()
        if worker is None:
            raise RuntimeError("no engine worker process found")
        out(f"  freezing replica-a's engine worker (pid {worker}); its request is killed before any token")
        os.kill(worker, signal.SIGSTOP)
        try:
            for _ in range(4):  # round robin: the request that lands on replica-a is the one we want
                box: dict[str, ClientView] = {}
                seen = len(victim.received_request_ids())
                thread = threading.Thread(target=lambda box=box: box.update(v=request(16)), daemon=True)
                thread.start()
                deadline = time.monotonic() + 5
                while thread.is_alive() and time.monotonic() < deadline:
                    if len(victim.received_request_ids()) > seen:
                        break
                    time.sleep(0.05)
                if thread.is_alive() and len(victim.received_request_ids()) > seen:
                    time.sleep(0.3)
                    out(f"  SIGKILL engine worker pid {worker}: vLLM answers with an in-band error")
                    os.kill(worker, signal.SIGKILL)
                    thread.join(60)
                    view = box["v"]
                    o = Outcome(view, stack.journal(view.request_id))
                    _real_complete(o, attempts=2)
                    first = o.attempts[0] if o.attempts else {}
                    o.check(
                        f"attempt 1 on {stack.replica_name(first.get('replica'))} failed",
                        first.get("outcome") == "failed",
                    )
                    return o
                thread.join(30)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(worker, signal.SIGCONT)
        raise RuntimeError("no request reached replica-a")

    def pod_dies_after_first_delta() -> Outcome:
        killed: list[str] = []

        def kill(view: ClientView) -> None:
            if not killed and view.content_chunks and view.request_id:
                replica = stack.served_by(view.request_id)
                if replica is not None:
                    replica.kill_group()
                    killed.append(replica.name)

        view = request(1000, on_chunk=kill)
        out(f"  killed the process group of {killed[0] if killed else '(nothing)'} after the first delta")
        o = Outcome(view, stack.journal(view.request_id))
        _real_common(o, phase="interrupted", attempts=1)
        _real_delivered(o)
        o.check(
            "prefix then a reset or one terminal frame",
            (view.transport_error is not None and view.done_count == 0) or len(view.error_frames) == 1,
        )
        return o

    def client_gone() -> Outcome:
        before = {n: len(r.aborted_request_ids()) for n, r in stack.vllm.items()}
        received = {n: len(r.received_request_ids()) for n, r in stack.vllm.items()}
        view = request(1000, disconnect_after=3)
        o = Outcome(view, stack.journal(view.request_id))
        _real_common(o, phase="cancelled", attempts=1)
        deadline = time.monotonic() + 10
        aborted: list[str] = []
        while time.monotonic() < deadline and not aborted:
            aborted = [n for n, r in stack.vllm.items() if len(r.aborted_request_ids()) > before[n]]
            time.sleep(0.1)
        time.sleep(0.5)
        new = sum(len(r.received_request_ids()) - received[n] for n, r in stack.vllm.items())
        o.check(
            f"vLLM's own log on {aborted[0] if aborted else 'no replica'} shows the abort", len(aborted) == 1
        )
        o.check(f"{new} request(s) reached vLLM (no second attempt)", new == 1)
        return o

    try:
        with _sigterm_as_interrupt():
            out(
                S.bold("router-sidecar demo --real-vllm: first-delta failover on etcd + 2 real vLLM replicas")
            )
            stack.start()
            scenario(1, "healthy request", "no fault: one complete answer", healthy)
            scenario(
                2,
                "engine dies before the first delta",
                "vLLM sends an in-band error before any content: retried on the other replica",
                engine_dies_before_first_delta,
            )
            scenario(
                3,
                "replica killed after the first delta",
                "the process group is SIGKILLed mid-stream: prefix, then a reset; journal says interrupted",
                pod_dies_after_first_delta,
            )
            scenario(
                4,
                "client disconnects mid-stream",
                "the client leaves after 3 deltas: vLLM aborts the request, no other attempt starts",
                client_gone,
            )
    except KeyboardInterrupt:
        out(S.red("\ninterrupted; stopping everything"))
        return 130
    except Exception as exc:
        out(S.red(f"\ndemo could not run: {type(exc).__name__}: {exc}"))
        return 1
    finally:
        stack.stop()
        if keep:
            out(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    passed = sum(results)
    ok = passed == REAL_TOTAL
    line = f"{passed}/{REAL_TOTAL} scenarios passed in {time.monotonic() - started:.1f}s"
    out()
    out(S.green(line) if ok else S.red(line))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
