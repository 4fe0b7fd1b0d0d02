"""Tool-call idempotency: a side effect happens at most once, however many attempts call it.

A worker derives the key from the logical action, `{request_id}:call_{n}` (see `tool_keys`), never from
its GPU attempt, so an attempt that replaces a dead one presents the same key and gets the earlier
result instead of a second execution. The gateway keeps one record per (tenant, key):

    (absent) ──claim──▶ in_progress ──tool answered──▶ completed        (replayed to later calls)
                             │        ──result too big─▶ not_stored       (later calls: clear error)
                             │        ──reset/timeout──▶ outcome_unknown  (later calls: clear error)
                             └──definite failure (4xx, retriable 5xx, never connected)──▶ (absent)

The pure part (decisions on records and on the tool's response) is here; `coordination.tool_ledger` does
the store IO.
"""

from __future__ import annotations

import base64
import enum
import hashlib
from dataclasses import dataclass, field
from typing import Any

REPLAY_HEADER = "x-idempotent-replay"
RETRIABLE_HEADER = "x-tool-retriable"  # a tool's way to say "this 5xx did not execute anything"
STORED_HEADERS = ("content-type",)


class ToolState(enum.StrEnum):
    IN_PROGRESS = "in_progress"
    COMPLETED = "completed"
    OUTCOME_UNKNOWN = "outcome_unknown"
    NOT_STORED = "not_stored"


@dataclass(frozen=True, slots=True)
class Replay:
    """Answer with the stored response; the tool is not called."""

    status: int
    headers: tuple[tuple[str, str], ...]
    body: bytes


@dataclass(frozen=True, slots=True)
class Refuse:
    status: int
    code: str
    message: str
    retry_after_seconds: int | None = None


@dataclass(frozen=True, slots=True)
class StillRunning:
    """Another call with this key is in progress and within its deadline."""

    deadline: float


def call_digest(method: str, path: str, body: bytes) -> str:
    """What one key names: the whole call, not only its body. The same body sent to another path
    (`/refund` after `/charge`), with another query string or method, is another action."""
    h = hashlib.sha256()
    for part in (method.encode(), path.encode("utf-8", "surrogateescape"), body):
        h.update(len(part).to_bytes(8, "big"))  # length-prefixed: no two calls share a serialisation
        h.update(part)
    return "sha256:" + h.hexdigest()


def claim_record(
    *,
    key: str,
    request_id: str | None,
    attempt_id: str | None,
    digest: str,
    call: str,
    now: float,
    deadline: float,
    gateway: str,
) -> dict[str, Any]:
    return {
        "state": ToolState.IN_PROGRESS.value,
        "key": key,
        "call": call,  # "METHOD /path?query", to name the action a key is bound to in a 422
        "request_id": request_id,
        "attempt_id": attempt_id,
        "call_digest": digest,
        "claimed_at": round(now, 6),
        "deadline": round(deadline, 6),
        "gateway": gateway,
    }


def answer_for_existing(record: dict[str, Any], digest: str, now: float) -> Replay | Refuse | StillRunning:
    """What a call finds when its key is already taken (by the same tenant)."""
    if record.get("call_digest") != digest:
        return Refuse(
            422,
            "idempotency_key_reused",
            f"this Idempotency-Key is bound to another call ({record.get('call', 'unknown')}): a key names "
            "one action, i.e. one method, path, query string and body. Use a new key for another action.",
        )
    state = record.get("state")
    if state == ToolState.COMPLETED:
        headers = tuple((k, v) for k, v in record.get("headers", []))
        return Replay(int(record["status"]), headers, base64.b64decode(record.get("body_b64", "")))
    if state == ToolState.IN_PROGRESS and now < float(record.get("deadline", 0)):
        return StillRunning(float(record["deadline"]))
    if state == ToolState.NOT_STORED:
        return Refuse(
            409,
            "tool_result_not_stored",
            f"the call with this key executed, but its result ({record.get('size')} bytes) was too large "
            "to keep; it is not executed again. Ask the tool for the result by other means.",
        )
    # outcome_unknown, or an in_progress whose gateway never reported back before the deadline.
    return Refuse(
        409,
        "tool_outcome_unknown",
        "a call with this key may or may not have executed (the tool reset, timed out, or the gateway "
        "handling it went away); it is not executed again. Check the tool's own state, then use a new key.",
    )


class ResponseFate(enum.Enum):
    STORE = "store"  # the tool answered: keep the answer for replays
    FREE = (
        "free"  # definitely not executed (4xx, declared-retriable 5xx, no connection): the key is free again
    )
    UNKNOWN = "unknown"  # may have executed: never run it again automatically
    TOO_LARGE = "too_large"


@dataclass(slots=True)
class ToolResponse:
    """The tool's response as the downstream filter sees it (sans-IO)."""

    max_stored_bytes: int
    status: int = 0
    headers: list[tuple[str, str]] = field(default_factory=list)
    from_upstream: bool = False
    connection_failed: bool = False
    retriable: bool = False
    size: int = 0
    _body: bytearray = field(default_factory=bytearray)

    def on_headers(self, headers: dict[str, str], code_details: str) -> None:
        self.status = int(headers.get(":status", "0") or 0)
        # Envoy's own replies (reset, timeout, no host) carry other details than "via_upstream".
        self.from_upstream = code_details == "via_upstream"
        self.connection_failed = "connection_failure" in code_details or "no_healthy_upstream" in code_details
        self.retriable = headers.get(RETRIABLE_HEADER, "").lower() == "true"
        self.headers = [(k, v) for k, v in headers.items() if k in STORED_HEADERS]

    def on_body(self, chunk: bytes) -> None:
        self.size += len(chunk)
        if self.size <= self.max_stored_bytes:
            self._body += chunk

    def fate(self, *, complete: bool) -> ResponseFate:
        if not self.from_upstream:
            return ResponseFate.FREE if self.connection_failed else ResponseFate.UNKNOWN
        if 400 <= self.status < 500 or (self.status >= 500 and self.retriable):
            return ResponseFate.FREE
        if not complete:
            return ResponseFate.UNKNOWN
        return ResponseFate.TOO_LARGE if self.size > self.max_stored_bytes else ResponseFate.STORE

    def completed_record(self, claimed: dict[str, Any], now: float) -> dict[str, Any]:
        return {
            **claimed,
            "state": ToolState.COMPLETED.value,
            "status": self.status,
            "headers": self.headers,
            "body_b64": base64.b64encode(bytes(self._body)).decode(),
            "size": self.size,
            "completed_at": round(now, 6),
        }

    def final_record(self, claimed: dict[str, Any], fate: ResponseFate, now: float) -> dict[str, Any]:
        if fate is ResponseFate.STORE:
            return self.completed_record(claimed, now)
        state = ToolState.NOT_STORED if fate is ResponseFate.TOO_LARGE else ToolState.OUTCOME_UNKNOWN
        return {
            **claimed,
            "state": state.value,
            "status": self.status or None,
            "size": self.size,
            "completed_at": round(now, 6),
        }
