"""The drill's HTTP side: send a request, record every byte and when it came, look up the journal.

The client records; it never judges. A transport error is recorded, not raised; leaving a stream early
(a client disconnect) is the caller's decision, taken from a callback after each complete event.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal

import httpx

from router_testbed.drill.evidence import DONE, Exchange, SseEvent, journal_settled, read_events
from router_testbed.sim.log import read_log

POLL_INTERVAL = 0.05
REPLICA_LOG_WAIT = 5.0  # how long a replica's end record may lag behind the gateway's journal
# What router-sidecar's journal look-up answers for an id it does not know (docs/errors.md).
JOURNAL_ANSWERS = frozenset({"request_not_found", "authentication_required", "journal_unavailable"})

# After each complete event: "leave" closes the connection at once (a client disconnect).
Reaction = Literal["leave"] | None
OnEvent = Callable[[Exchange, SseEvent, int], Reaction]


class Client:
    """One drill run's connection to the gateway (and, in sim mode, the replicas' log files)."""

    def __init__(
        self,
        gateway: str,
        *,
        credential: str,
        timeout: float,
        replica_logs: Sequence[Path] = (),
    ) -> None:
        self.gateway = gateway.rstrip("/")
        self.credential = credential
        self.auth = {"authorization": f"Bearer {credential}"}
        self.timeout = timeout
        self.replica_logs = list(replica_logs)
        # Whether the gateway keeps router-sidecar's journal (the pre-flight finds out): without one, a
        # request is not waited for in a journal that will never have it.
        self.journal = True
        self.http = httpx.Client(timeout=httpx.Timeout(timeout, connect=min(timeout, 5.0)))

    def close(self) -> None:
        self.http.close()

    # --- requests ------------------------------------------------------------------------------------

    def send(
        self,
        x: Exchange,
        *,
        json_body: dict[str, Any] | None = None,
        content: bytes | None = None,
        headers: dict[str, str] | None = None,
        on_event: OnEvent | None = None,
    ) -> Exchange:
        """Send `x`'s request and record its response into `x` (also returned)."""
        payload = content if content is not None else json.dumps(json_body).encode()
        sent_headers = {**self.auth, "content-type": "application/json", **(headers or {})}
        if x.request_id is not None:
            sent_headers["idempotency-key"] = x.request_id
        if x.fault is not None:
            sent_headers["x-sim-fault"] = x.fault
        if json_body is not None:
            x.stream = bool(json_body.get("stream"))
            max_tokens = json_body.get("max_tokens")
            x.max_tokens = max_tokens if isinstance(max_tokens, int) else None
        x.request_bytes = len(payload)
        x.sent_at = time.time()
        deadline = time.monotonic() + self.timeout
        pending = b""
        content_events = 0
        try:
            with self.http.stream(
                x.method, self.gateway + x.path, content=payload, headers=sent_headers
            ) as response:
                x.headers_at = time.time()
                x.status = response.status_code
                x.headers = {k.lower(): v for k, v in response.headers.items()}
                for chunk in response.iter_raw():
                    now = time.time()
                    x.body += chunk
                    x.arrivals.append((now, len(x.body)))
                    if on_event is not None:
                        pending += chunk.replace(b"\r\n", b"\n")
                        view = read_events(pending, api=x.api)
                        if view.events:
                            pending = view.torn_tail
                            for event in view.events:
                                event = SseEvent(now, event.raw, event.data, event.kind, event.name)
                                content_events += event.kind == "content"
                                if on_event(x, event, content_events) == "leave":
                                    x.disconnected_at = time.time()
                                    break
                            if x.disconnected_at is not None:
                                break  # leaving the block closes the connection: a client disconnect
                    if time.monotonic() > deadline:
                        x.transport_error = f"DrillTimeout: the response did not end within {self.timeout:g}s"
                        break
        except httpx.HTTPError as exc:
            x.transport_error = f"{type(exc).__name__}: {exc}"
        x.ended_at = time.time()
        return x

    def get(self, path: str) -> httpx.Response:
        return self.http.get(self.gateway + path, headers=self.auth)

    def keeps_journal(self, probe_id: str) -> bool:
        """Whether the gateway is router-sidecar: its journal look-up answers an unknown id with its own JSON
        error (request_not_found; or authentication_required, journal_unavailable), where another gateway
        answers a plain 404 or passes the path on to an engine."""
        status, answer = self.lookup(probe_id)
        error = (answer or {}).get("error")
        return (
            status in (401, 404, 503)
            and isinstance(error, dict)
            and error.get("type") == "gateway_error"
            and error.get("code") in JOURNAL_ANSWERS
        )

    # --- the journal ---------------------------------------------------------------------------------

    def lookup(self, request_id: str) -> tuple[int, dict[str, Any] | None]:
        try:
            response = self.http.get(f"{self.gateway}/v1/requests/{request_id}", headers=self.auth, timeout=5)
        except httpx.HTTPError:
            return 0, None
        try:
            record = response.json()
        except ValueError:
            return response.status_code, None
        return response.status_code, record if isinstance(record, dict) else None

    def settle(self, x: Exchange, *, expect_record: bool = True, timeout: float = 10.0) -> Exchange:
        """Poll the journal until `x`'s record is settled (terminal, with its closing event).

        `expect_record=False`: a request the gateway refused at admission; one look-up says whether a
        record exists, and only an existing, unsettled one is waited for."""
        if x.request_id is None:
            return x
        if not self.journal:
            self.collect_replica_records(x)
            return x
        deadline = time.monotonic() + timeout
        while True:
            x.journal_status, x.journal = self.lookup(x.request_id)
            if x.journal_status == 200 and x.journal is not None and journal_settled(x.journal):
                break
            if x.journal_status == 404 and not expect_record:
                break
            if time.monotonic() > deadline:
                break
            time.sleep(POLL_INTERVAL)
        self.collect_replica_records(x)
        return x

    def serving_replica(self, request_id: str) -> str | None:
        """The replica of the request's latest attempt, from its journal record (readable in flight)."""
        status, record = self.lookup(request_id)
        attempts = (record or {}).get("attempts") or [] if status == 200 else []
        replica = attempts[-1].get("replica") if attempts and isinstance(attempts[-1], dict) else None
        return str(replica) if replica else None

    # --- the simulator's own logs --------------------------------------------------------------------

    def replica_records(self, request_id: str) -> list[dict[str, Any]]:
        records: list[dict[str, Any]] = []
        for path in self.replica_logs:
            # By the id the gateway sent (router-sidecar's x-request-id), or by the client's own key when
            # another gateway passed it on.
            records += [
                r for r in read_log(path) if request_id in (r.get("request_id"), r.get("idempotency_key"))
            ]
        return sorted(records, key=lambda r: (r.get("t_start", 0), r.get("event") != "start"))

    def collect_replica_records(self, x: Exchange) -> None:
        """The replicas' records of `x`, once every attempt they started has ended (or its process is
        gone): the replica side learns of a cancel a moment after the gateway journals it."""
        if not self.replica_logs or x.request_id is None:
            return
        deadline = time.monotonic() + REPLICA_LOG_WAIT
        while True:
            x.replica_records = self.replica_records(x.request_id)
            if not _unfinished(x.replica_records) or time.monotonic() > deadline:
                return
            time.sleep(POLL_INTERVAL)


def _unfinished(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    ended = {(r.get("attempt_id"), r.get("t_start")) for r in records if r.get("event") == "end"}
    return [
        r
        for r in records
        if r.get("event") == "start"
        and (r.get("attempt_id"), r.get("t_start")) not in ended
        and _alive(r.get("pid"))
    ]


def _alive(pid: Any) -> bool:
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


__all__ = ["DONE", "Client", "OnEvent", "Reaction"]
