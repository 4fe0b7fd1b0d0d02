"""The Responses and Messages APIs' streams read as their clients read them: an oracle apart from the product.

Like `tests/invariants.py` (which judges every API with it) this module never imports the product's scanner
or dialects (`router_sidecar.core.sse`, `router_sidecar.core.dialects`): what a content event, a clean end,
an in-band failure and the gateway's terminal event are is written here again, from the wire formats
(docs/design.md#the-streaming-apis, the engines' code as `docs/simulator.md` cites it), so that a mistake
there is not shared here.

* Responses (`POST /v1/responses`): named events `event: <type>` + `data: {"type": <type>, "sequence_number":
  N, …}`, numbered from 0, no `[DONE]`. Content: a `*.delta` event with a non-empty `delta`, or the
  `response.output_item.added` of a call item (it names the tool). Clean end: `response.completed` or
  `response.incomplete`. The gateway's terminal event after content: `response.failed` carrying the id of
  the client's `response.created` and the next sequence number.
* Messages (`POST /v1/messages`): named events, no `[DONE]`. Content: a `content_block_delta` with a
  non-empty text, thinking or input JSON, or the `content_block_start` of a `tool_use` block. Clean end:
  `message_stop`. The gateway's terminal event: `event: error` in Anthropic's shape, our code in
  `error.details.error_code`.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Literal

Api = Literal["chat", "completions", "responses", "messages"]
NAMED_APIS: tuple[Api, ...] = ("responses", "messages")
PATHS: dict[str, str] = {
    "chat": "/v1/chat/completions",
    "completions": "/v1/completions",
    "responses": "/v1/responses",
    "messages": "/v1/messages",
}
INTERRUPTED = "upstream_decode_interrupted"

RESPONSES_CALL_ITEMS = frozenset(
    {
        "function_call",
        "custom_tool_call",
        "mcp_call",
        "web_search_call",
        "code_interpreter_call",
        "file_search_call",
        "computer_call",
        "shell_call",
        "local_shell_call",
        "image_generation_call",
    }
)
RESPONSES_LIFECYCLE = frozenset(
    {
        "response.created",
        "response.in_progress",
        "response.queued",
        "response.completed",
        "response.incomplete",
        "response.failed",
    }
)
RESPONSES_CLEAN_END = frozenset({"response.completed", "response.incomplete"})
# Anthropic's error types (`anthropic.types.shared.ErrorType`, the 2.x SDK): what `error.type` may be.
ANTHROPIC_ERROR_TYPES = frozenset(
    {
        "invalid_request_error",
        "authentication_error",
        "billing_error",
        "permission_error",
        "not_found_error",
        "rate_limit_error",
        "timeout_error",
        "api_error",
        "overloaded_error",
        "request_too_large",
    }
)
# What a replica's own error looks like on these APIs: never what the gateway sends a client.
REPLICA_ERROR_MARKERS = (
    b"internal_error",  # vLLM's Messages in-band error type (not one of Anthropic's)
    b"Request running timeout reached",  # SGLang's in-band error
    b"InternalServerError",  # vLLM's Messages HTTP error type
    b"ServiceUnavailableError",
    b"TooManyRequestsError",
    b"EngineCore encountered an issue",
)


@dataclass(frozen=True)
class NamedEvent:
    """One complete SSE event: its `event:` name (None: none), its data (parsed JSON, or None when the data
    is not JSON), and its bytes as received (without the blank line that ends it)."""

    name: str | None
    data: Any
    raw: bytes
    json_ok: bool
    # Exactly one `event:` line naming the data's own `type` and one `data:` line, nothing else (the form
    # every engine writes and both SDKs read).
    well_formed: bool

    @property
    def type(self) -> str | None:
        t = self.data.get("type") if isinstance(self.data, dict) else None
        return t if isinstance(t, str) else None


def named_events(raw: bytes) -> tuple[list[NamedEvent], bool]:
    """(the complete events in `raw`, whether the bytes end inside an event). Comment-only events are
    skipped, as an SSE client skips them."""
    normalized = raw.replace(b"\r\n", b"\n")
    parts = normalized.split(b"\n\n")
    torn = bool(parts[-1].strip())
    out: list[NamedEvent] = []
    for part in parts[:-1]:
        lines = [ln for ln in part.split(b"\n") if ln]
        if not lines or all(ln.startswith(b":") for ln in lines):
            continue
        names = [ln[6:].strip().decode("utf-8", "replace") for ln in lines if ln.startswith(b"event:")]
        datas = [ln[5:].lstrip() for ln in lines if ln.startswith(b"data:")]
        others = [ln for ln in lines if not ln.startswith((b"event:", b"data:", b":"))]
        data: Any = None
        ok = False
        if datas:
            try:
                data = json.loads(b"\n".join(datas))
                ok = True
            except ValueError:
                data = None
        name = names[-1] if names else None
        well_formed = (
            ok
            and len(names) == 1
            and len(datas) == 1
            and not others
            and isinstance(data, dict)
            and data.get("type") == name
        )
        out.append(NamedEvent(name, data, part, ok, well_formed))
    return out, torn


def event_name(ev: NamedEvent) -> str:
    """What a client dispatches on: the `event:` line, else the data's `type`."""
    return ev.name or ev.type or ""


# --- content ------------------------------------------------------------------------------------------------


def is_content(api: Api, ev: NamedEvent) -> bool:
    d = ev.data if isinstance(ev.data, dict) else {}
    name = event_name(ev)
    if api == "responses":
        if name.endswith(".delta"):
            return isinstance(d.get("delta"), str) and d["delta"] != ""
        if name == "response.output_item.added":
            item = d.get("item")
            return isinstance(item, dict) and item.get("type") in RESPONSES_CALL_ITEMS
        return False
    if api == "messages":
        if name == "content_block_delta":
            delta = d.get("delta") if isinstance(d.get("delta"), dict) else {}
            return any(
                isinstance(delta.get(k), str) and delta[k] != "" for k in ("text", "thinking", "partial_json")
            )
        if name == "content_block_start":
            block = d.get("content_block")
            return isinstance(block, dict) and block.get("type") in ("tool_use", "server_tool_use")
        return False
    raise ValueError(f"not a named-event API: {api}")


def piece_text(api: Api, ev: NamedEvent) -> str:
    """The visible text a content event carries (a text delta's; a call's opening carries none)."""
    d = ev.data if isinstance(ev.data, dict) else {}
    if api == "responses":
        name = event_name(ev)
        return d["delta"] if name == "response.output_text.delta" and isinstance(d.get("delta"), str) else ""
    delta = d.get("delta") if isinstance(d.get("delta"), dict) else {}
    text = delta.get("text")
    return text if isinstance(text, str) else ""


@dataclass
class ApiStream:
    """One client's view of a Responses or Messages stream."""

    api: Api
    events: list[NamedEvent]
    torn: bool

    @classmethod
    def read(cls, api: Api, raw: bytes) -> ApiStream:
        events, torn = named_events(raw)
        return cls(api, events, torn)

    @property
    def names(self) -> list[str]:
        return [event_name(e) for e in self.events]

    @property
    def content(self) -> list[NamedEvent]:
        return [e for e in self.events if is_content(self.api, e)]

    @property
    def text(self) -> str:
        return "".join(piece_text(self.api, e) for e in self.content)

    def count(self, name: str) -> int:
        return self.names.count(name)

    @property
    def preambles(self) -> int:
        """How many answers were opened: `response.created` / `message_start` events."""
        return self.count("response.created" if self.api == "responses" else "message_start")

    @property
    def clean_ends(self) -> int:
        if self.api == "responses":
            return sum(self.count(n) for n in RESPONSES_CLEAN_END)
        return self.count("message_stop")

    def response_ids(self) -> list[str]:
        """The ids the stream names its answer by (Responses: every lifecycle event's `response.id`;
        Messages: `message_start`'s `message.id`), in order."""
        out: list[str] = []
        for e in self.events:
            d = e.data if isinstance(e.data, dict) else {}
            if self.api == "responses" and event_name(e) in RESPONSES_LIFECYCLE:
                response = d.get("response") if isinstance(d.get("response"), dict) else {}
                out.append(str(response.get("id")))
            elif self.api == "messages" and event_name(e) == "message_start":
                message = d.get("message") if isinstance(d.get("message"), dict) else {}
                out.append(str(message.get("id")))
        return out

    def sequence_numbers(self) -> list[Any]:
        return [e.data.get("sequence_number") if isinstance(e.data, dict) else None for e in self.events]

    def usage_output_tokens(self) -> int | None:
        """The output tokens the stream's own usage reports (Responses: the terminal response's usage;
        Messages: the last `message_delta`'s), None when it carries none."""
        found: int | None = None
        for e in self.events:
            d = e.data if isinstance(e.data, dict) else {}
            usage: Any = None
            if self.api == "responses" and event_name(e) in RESPONSES_CLEAN_END:
                response = d.get("response") if isinstance(d.get("response"), dict) else {}
                usage = response.get("usage")
            elif self.api == "messages" and event_name(e) == "message_delta":
                usage = d.get("usage")
            if isinstance(usage, dict) and isinstance(usage.get("output_tokens"), int):
                found = usage["output_tokens"]
        return found

    def terminal_events(self) -> list[NamedEvent]:
        """The events that end a stream as a failure: Responses `response.failed` and `error`, Messages
        `error` (the gateway's own or, where it should never be, a replica's)."""
        failing = ("response.failed", "error") if self.api == "responses" else ("error",)
        return [e for e in self.events if event_name(e) in failing]


def terminal_error(api: Api, ev: NamedEvent) -> dict[str, Any]:
    """The error object of a terminal event: `response.failed`'s `response.error`, or the Anthropic
    `error` event's `error` (an `error` event on Responses: the event itself)."""
    d = ev.data if isinstance(ev.data, dict) else {}
    if api == "responses" and event_name(ev) == "response.failed":
        response = d.get("response") if isinstance(d.get("response"), dict) else {}
        error = response.get("error")
        return error if isinstance(error, dict) else {}
    if api == "messages":
        error = d.get("error")
        return error if isinstance(error, dict) else {}
    return d


def error_code(api: Api, error: dict[str, Any]) -> Any:
    """Our code in an error object: `code` (both shapes), or Anthropic's `details.error_code`."""
    if api == "messages" and not isinstance(error.get("code"), str):
        details = error.get("details") if isinstance(error.get("details"), dict) else {}
        return details.get("error_code")
    return error.get("code")


# --- non-streamed answers -----------------------------------------------------------------------------------


def unary_text(api: Api, answer: dict[str, Any]) -> str:
    """The text of a non-streamed answer (Responses: its message items' output_text; Messages: its text
    blocks)."""
    if api == "responses":
        out = []
        for item in answer.get("output") or []:
            if isinstance(item, dict) and item.get("type") == "message":
                out += [
                    p.get("text", "")
                    for p in item.get("content") or []
                    if isinstance(p, dict) and p.get("type") == "output_text"
                ]
        return "".join(out)
    return "".join(
        b.get("text", "")
        for b in answer.get("content") or []
        if isinstance(b, dict) and b.get("type") == "text"
    )


def unary_output_tokens(api: Api, answer: dict[str, Any]) -> int | None:
    usage = answer.get("usage")
    if not isinstance(usage, dict):
        return None
    key = "completion_tokens" if api in ("chat", "completions") else "output_tokens"
    value = usage.get(key)
    return value if isinstance(value, int) else None


def unary_is_answer(api: Api, answer: Any) -> bool:
    if not isinstance(answer, dict):
        return False
    if api == "responses":
        return answer.get("object") == "response"
    if api == "messages":
        return answer.get("type") == "message"
    return isinstance(answer.get("choices"), list)


def unary_complete(api: Api, answer: dict[str, Any]) -> bool:
    """A whole generation that ran to max tokens (what every fault-free simulated request does)."""
    if api == "responses":
        details = answer.get("incomplete_details")
        return answer.get("status") == "incomplete" and (
            isinstance(details, dict) and details.get("reason") == "max_output_tokens"
        )
    if api == "messages":
        return answer.get("stop_reason") == "max_tokens"
    choices = answer.get("choices") or [{}]
    return isinstance(choices[0], dict) and choices[0].get("finish_reason") == "length"


# --- comparing a stream with what the replica writes --------------------------------------------------------

_IDS = re.compile(rb"(?:resp|msg|fc|rs)_[0-9a-f]{16,32}|chatcmpl-[A-Za-z0-9_-]+")
_CREATED = re.compile(rb'"created_at":\s*\d+')


def normalized(raw: bytes) -> bytes:
    """The bytes with the per-run parts replaced: every id (`resp_…`, `msg_…`, `fc_…`, `chatcmpl-…`) by its
    order of first appearance, `created_at` by 0. Two runs of one request on simulated replicas differ only
    in these."""
    seen: dict[bytes, bytes] = {}

    def name(m: re.Match[bytes]) -> bytes:
        return seen.setdefault(m.group(0), b"<id%d>" % len(seen))

    return _CREATED.sub(b'"created_at":0', _IDS.sub(name, raw))
