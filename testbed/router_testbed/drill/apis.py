"""The streaming APIs the drill runs its matrix on, each read by its own rules (pure, no I/O).

* ``chat`` (``POST /v1/chat/completions``) and ``completions`` (``/v1/completions``): ``data:`` events only;
  first content is a non-empty delta (text, a tool call, reasoning); the clean end is ``data: [DONE]``; an
  error is ``data: {"error": …}``, and the gateway's terminal event is one such frame, then ``[DONE]``.
* ``responses`` (OpenAI's Responses API, ``/v1/responses``): named events (``event:`` + ``data:``), each
  with a ``sequence_number`` counted from 0; first content is a non-empty ``*.delta`` or an opened call item
  (it names the tool); the clean end is ``response.completed`` or ``response.incomplete`` and no ``[DONE]``;
  a failure is ``response.failed`` (or an ``error`` event), which must continue the stream the client holds:
  the response id of its ``response.created``, the next sequence number.
* ``messages`` (Anthropic's Messages API, ``/v1/messages``): named events; first content is a non-empty
  ``content_block_delta`` or a ``tool_use`` block; the clean end is ``message_stop``; a failure is ``event:
  error`` with one of Anthropic's error types.

Everything before the first content (``response.created``, ``message_start``, an opened text block) is the
preamble: after a retry the client must hold exactly one of it, one id, sequence numbers without a gap.

This is an oracle independent of the product's dialects (``router_sidecar.core.dialects``) on purpose: the
drill judges them. It reads the APIs as their public references and the engines' code describe them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from router_testbed.oracle import is_content, piece_text

NAMES = ("chat", "completions", "responses", "messages")
ALL = "all"
DEFAULT = "chat"

# Anthropic's documented error types (docs.anthropic.com "Errors"; `billing_error`, `timeout_error` too).
ANTHROPIC_ERROR_TYPES = frozenset(
    {
        "invalid_request_error",
        "authentication_error",
        "billing_error",
        "permission_error",
        "not_found_error",
        "request_too_large",
        "rate_limit_error",
        "api_error",
        "timeout_error",
        "overloaded_error",
    }
)
# The type Anthropic's API uses for a status (its table); what router-sidecar writes for a status it answers.
ANTHROPIC_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    409: "invalid_request_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    502: "api_error",
    503: "overloaded_error",
    504: "timeout_error",
    529: "overloaded_error",
}

# Responses items whose opening shows the model acting (a call): content, as a tool call's first delta is.
_CALL_ITEMS = frozenset(
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
_RESPONSES_END = frozenset({"response.completed", "response.incomplete"})
_RESPONSES_FAILED = frozenset({"response.failed", "error"})
_PROMPT = "Drill: tell me a short story."


@dataclass(frozen=True)
class Api:
    """One API as the drill sends and reads it."""

    name: str  # chat | completions | responses | messages (--api)
    path: str
    title: str
    sim_kind: str  # the simulator's name for the route (router_testbed.sim.generation.Kind)
    named_events: bool  # events carry `event:` lines (Responses, Messages)
    end: str  # the clean end, as the checks name it
    terminal: str  # an interrupted stream's last event, as the checks name it
    anthropic: bool = False  # Anthropic's error shape (`{"type": "error", "error": {"type", "message"}}`)
    sequenced: bool = False  # events carry sequence numbers from 0 (Responses)

    # --- requests ------------------------------------------------------------------------------------

    def body(self, model: str, max_tokens: int, /, **extra: Any) -> dict[str, Any]:
        """A streamed request for `max_tokens` output tokens. `seed: 7` makes a simulated replica's text
        known in advance (the text oracle); `ignore_eos` makes a real engine write all of them (the Messages
        API has no such field)."""
        if self.name == "chat":
            body: dict[str, Any] = {
                "model": model,
                "messages": [{"role": "user", "content": _PROMPT}],
                "stream": True,
                "max_tokens": max_tokens,
                "seed": 7,
                # Usage in every event: the client's own token count, exact on a real engine too.
                "stream_options": {"include_usage": True, "continuous_usage_stats": True},
                "ignore_eos": True,
            }
        elif self.name == "completions":
            body = {
                "model": model,
                "prompt": _PROMPT,
                "stream": True,
                "max_tokens": max_tokens,
                "seed": 7,
                "stream_options": {"include_usage": True, "continuous_usage_stats": True},
                "ignore_eos": True,
            }
        elif self.name == "responses":
            body = {
                "model": model,
                "input": _PROMPT,
                "stream": True,
                "max_output_tokens": max_tokens,
                "seed": 7,
                "ignore_eos": True,
            }
        else:
            body = {
                "model": model,
                "messages": [{"role": "user", "content": _PROMPT}],
                "stream": True,
                "max_tokens": max_tokens,
                "seed": 7,
            }
        return {**body, **extra}

    def huge(self, model: str, max_tokens: int, size: int) -> dict[str, Any]:
        """A request whose prompt is `size` bytes (the body size limit)."""
        if self.name == "completions":
            return self.body(model, max_tokens, prompt="x" * size)
        if self.name == "responses":
            return self.body(model, max_tokens, input="x" * size)
        return self.body(model, max_tokens, messages=[{"role": "user", "content": "x" * size}])

    def truncated_json(self, model: str) -> bytes:
        """A body that is not JSON: it stops inside its list."""
        field = {"chat": "messages", "completions": "prompt", "responses": "input", "messages": "messages"}
        return b'{"model": "' + model.encode() + b'", "' + field[self.name].encode() + b'": ['

    @staticmethod
    def max_tokens_of(body: dict[str, Any]) -> int | None:
        value = body.get("max_output_tokens", body.get("max_tokens"))
        return value if isinstance(value, int) and not isinstance(value, bool) else None

    # --- reading events ------------------------------------------------------------------------------

    def classify(self, name: str | None, data: Any) -> str:
        """An event's kind: content, role (a chat chunk without content), other (any other non-content
        event: a preamble, a closing `.done`), done (the clean end), frame (an error or failure event)."""
        if not self.named_events:
            if isinstance(data, dict) and isinstance(data.get("error"), dict):
                return "frame"
            if is_content(data):
                return "content"
            if isinstance(data, dict) and isinstance(data.get("choices"), list):
                return "role"
            return "other"
        kind = event_type(name, data)
        if not isinstance(data, dict):
            return "other"
        if self.name == "responses":
            if kind.endswith(".delta"):
                delta = data.get("delta")
                return "content" if isinstance(delta, str) and delta else "other"
            if kind == "response.output_item.added":
                item = data.get("item")
                return "content" if isinstance(item, dict) and item.get("type") in _CALL_ITEMS else "other"
            if kind in _RESPONSES_END:
                return "done"
            if kind in _RESPONSES_FAILED:
                return "frame"
            return "other"
        if kind == "content_block_delta":
            delta = data.get("delta")
            visible = isinstance(delta, dict) and any(
                isinstance(delta.get(k), str) and delta.get(k) for k in ("text", "thinking", "partial_json")
            )
            return "content" if visible else "other"
        if kind == "content_block_start":
            block = data.get("content_block")
            tool = isinstance(block, dict) and block.get("type") in ("tool_use", "server_tool_use")
            return "content" if tool else "other"
        if kind == "message_stop":
            return "done"
        if kind == "error":
            return "frame"
        return "other"

    def text(self, data: dict[str, Any]) -> str:
        """The text a content event carries."""
        if self.name in ("chat", "completions"):
            return piece_text(data)
        if self.name == "responses":
            delta = data.get("delta")
            kind = str(data.get("type") or "")
            return delta if kind == "response.output_text.delta" and isinstance(delta, str) else ""
        delta = data.get("delta")
        text = delta.get("text") if isinstance(delta, dict) else None
        return text if isinstance(text, str) else ""

    def frame_error(self, data: dict[str, Any]) -> dict[str, Any]:
        """The error object of an error event: chat's `error`, a `response.failed`'s `response.error` (an
        `error` event is its own object), Anthropic's `error`."""
        if self.name == "responses":
            response = data.get("response")
            if isinstance(response, dict) and isinstance(response.get("error"), dict):
                return dict(response["error"])
            return dict(data)
        error = data.get("error")
        return dict(error) if isinstance(error, dict) else {}

    def output_tokens(self, data: dict[str, Any]) -> int | None:
        """The output-token count an event carries (chat: usage.completion_tokens; Responses: the terminal
        response's usage.output_tokens; Messages: message_delta's usage.output_tokens)."""
        if self.name in ("chat", "completions"):
            usage = data.get("usage")
            value = usage.get("completion_tokens") if isinstance(usage, dict) else None
        elif self.name == "responses":
            response = data.get("response")
            usage = response.get("usage") if isinstance(response, dict) else None
            value = usage.get("output_tokens") if isinstance(usage, dict) else None
        else:
            usage = data.get("usage") if data.get("type") == "message_delta" else None
            value = usage.get("output_tokens") if isinstance(usage, dict) else None
        return value if isinstance(value, int) and not isinstance(value, bool) else None

    def ids(self, data: dict[str, Any]) -> list[str]:
        """The answer ids an event names: chat's `id`; a Responses event's `response.id`; `message_start`'s
        message id. One attempt's answer has one; a second means a second answer reached the client."""
        if self.name in ("chat", "completions"):
            value = data.get("id")
        elif self.name == "responses":
            response = data.get("response")
            value = response.get("id") if isinstance(response, dict) else None
        else:
            message = data.get("message") if data.get("type") == "message_start" else None
            value = message.get("id") if isinstance(message, dict) else None
        return [value] if isinstance(value, str) else []

    def finish(self, data: dict[str, Any]) -> list[str]:
        """How the generation says it finished: chat's finish_reason; the Responses terminal response's
        `status`; Messages' `message_delta` stop_reason (vLLM's abort leaves it null)."""
        if self.name in ("chat", "completions"):
            choices = data.get("choices")
            return (
                [str(c["finish_reason"]) for c in choices if isinstance(c, dict) and c.get("finish_reason")]
                if isinstance(choices, list)
                else []
            )
        if self.name == "responses":
            response = data.get("response")
            if data.get("type") in _RESPONSES_END and isinstance(response, dict) and response.get("status"):
                return [str(response["status"])]
            return []
        delta = data.get("delta") if data.get("type") == "message_delta" else None
        reason = delta.get("stop_reason") if isinstance(delta, dict) else None
        return [str(reason)] if reason else []

    @property
    def preamble(self) -> str | None:
        """The event that opens an answer: one per client stream, whoever served it."""
        return {"responses": "response.created", "messages": "message_start"}.get(self.name)

    # --- error bodies --------------------------------------------------------------------------------

    def error_shape(self, body: Any) -> str | None:
        """What is wrong with an HTTP error body for this API's clients (None: it is in the API's shape):
        OpenAI's `{"error": {"message", …}}`; Anthropic's
        `{"type": "error", "error": {"type", "message"}}`."""
        if not isinstance(body, dict):
            return "not a JSON object"
        error = body.get("error")
        if not isinstance(error, dict):
            return "no `error` object"
        if self.anthropic:
            if body.get("type") != "error":
                return f"top-level type {body.get('type')!r}, not 'error' (Anthropic's shape)"
            if not isinstance(error.get("type"), str) or not isinstance(error.get("message"), str):
                return "its `error` lacks Anthropic's `type` and `message` strings"
            return None
        if not isinstance(error.get("message"), str):
            return "its `error` has no `message` string"
        return None

    @property
    def shape_name(self) -> str:
        return (
            'Anthropic\'s {"type": "error", "error": {"type", "message"}}'
            if self.anthropic
            else 'OpenAI\'s {"error": {"message", …}}'
        )


def event_type(name: str | None, data: Any) -> str:
    """A named event's type: its `event:` line, else its data's `type`."""
    if name:
        return name
    return str(data.get("type") or "") if isinstance(data, dict) else ""


API = {
    "chat": Api("chat", "/v1/chat/completions", "chat completions", "chat", False, "[DONE]", "frame"),
    "completions": Api(
        "completions", "/v1/completions", "completions", "completion", False, "[DONE]", "frame"
    ),
    "responses": Api(
        "responses",
        "/v1/responses",
        "Responses API",
        "responses",
        True,
        "response.completed/response.incomplete",
        "response.failed",
        sequenced=True,
    ),
    "messages": Api(
        "messages",
        "/v1/messages",
        "Messages API",
        "messages",
        True,
        "message_stop",
        "event: error",
        anthropic=True,
    ),
}


def parse(value: str) -> list[str]:
    """`--api NAME` (or `all`): the APIs to run the matrix on, in order."""
    if value == ALL:
        return list(NAMES)
    if value not in API:
        raise ValueError(f"--api {value!r}: expected one of {', '.join(NAMES)} or {ALL}")
    return [value]


def of(name: str | None) -> Api:
    return API[name or DEFAULT]
