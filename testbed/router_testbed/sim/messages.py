"""The Anthropic Messages API (``POST /v1/messages``) as vLLM 0.32 and SGLang 0.5.23 serve it (pure; no I/O).

Both engines translate the request into a chat completion and its stream into Anthropic events, so the
simulator does the same: a Messages request generates chat-shaped pieces and :class:`MessagesStream` /
:class:`SglangMessagesStream` write them as the engine's converter does. Checked against the engines' code
(vLLM ``vllm/entrypoints/anthropic/``: ``api_router.py``, ``serving.py``, ``protocol.py``; SGLang
``srt/entrypoints/anthropic/serving.py``, ``protocol.py``, and its ``http_server.py`` error handlers) and
against captures (``reference/*/messages_*``, ``tests/unit/sim_captures/``).

vLLM 0.32:

* ``message_start`` is written with the chat stream's first event (the role event, after prefill); its id is
  the chat completion's, ``chatcmpl-`` + the request's ``x-request-id`` (16 hex without one): every attempt
  of one request that carries the same ``x-request-id`` gets the same id, on any replica. No ``ping``.
* Key order ``type, message|delta|content_block|index|error|usage`` (``exclude_unset``); ``message_delta``
  carries ``stop_reason`` and ``stop_sequence`` and both usage counts. ``stop_reason``: ``length`` →
  ``max_tokens``, ``stop`` → ``end_turn``, tool calls → ``tool_use``, ``abort`` → ``null``.
* The engine failing mid-stream: the chat stream's in-band error event fails the converter's validation and
  comes out as ``event: error`` with ``"type":"internal_error"`` and pydantic's message; the body then ends
  cleanly (no ``message_stop``).
* Errors before the stream: Anthropic's shape ``{"type":"error","error":{"type","message"}}`` with vLLM's
  OpenAI type names (``NotFoundError``, ``BadRequestError``); a body that is not JSON or lacks a field is
  refused by FastAPI before the route, in the OpenAI shape.

SGLang 0.5.23:

* ``message_start`` is deferred to the first content (no ``stop_reason``/``stop_sequence`` keys, the
  requested ``model`` echoed, any model served: SGLang does not check it on this route); ids
  ``msg_`` + 32 hex; key order ``type, index, content_block|delta``; ``message_delta`` is
  ``{"stop_reason"}`` + ``{"output_tokens"}``; an unmapped finish (``abort``) is ``end_turn``.
* An in-band failure (its request timeout) closes the open block, then ``event: error`` with Anthropic's
  type for the status (503 → ``overloaded_error``) and ``message_stop``; the body ends cleanly.
* Errors before the stream, including bad JSON, are Anthropic-shaped with Anthropic's types
  (``invalid_request_error``, …); 5xx messages are scrubbed to ``"Internal server error"``. A request over
  the context is refused inside a 200 stream (``message_start`` with 0 input tokens, ``error``,
  ``message_stop``).
"""

from __future__ import annotations

import dataclasses
import json
import secrets
from dataclasses import dataclass
from typing import Any

from router_testbed.sim import generation as gen
from router_testbed.sim.generation import JSONDict

# What vLLM's converter says when the chat stream it reads carries vLLM's engine-dead event
# (messages_engine_dead_midstream.sse): pydantic's ValidationError, verbatim.
VLLM_INBAND_MESSAGE = (
    "2 validation errors for ChatCompletionStreamResponse\nmodel\n  Field required [type=missing, "
    "input_value={'error': {'message': 'En...am': None, 'code': 500}}, input_type=dict]\n    For further "
    "information visit https://errors.pydantic.dev/2.14/v/missing\nchoices\n  Field required "
    "[type=missing, input_value={'error': {'message': 'En...am': None, 'code': 500}}, input_type=dict]\n    "
    "For further information visit https://errors.pydantic.dev/2.14/v/missing"
)
SGLANG_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "request_timeout_error",
    429: "rate_limit_error",
    500: "api_error",
    502: "api_error",
    503: "overloaded_error",
    504: "api_error",
}
SGLANG_STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}
_REQUIRED = ("model", "messages", "max_tokens")


def error_body(type_: str, message: str) -> bytes:
    """Anthropic's error body (both engines, compact)."""
    return gen.dumps({"type": "error", "error": {"type": type_, "message": message}}).encode()


def sse_event(payload: JSONDict) -> bytes:
    return f"event: {payload['type']}\ndata: ".encode() + gen.dumps(payload).encode() + b"\n\n"


# --------------------------------------------------------------------------- the request


@dataclass(frozen=True)
class MessagesParams:
    requested_model: str  # SGLang echoes it, whatever it is
    refusal: str | None = None  # SGLang: a request over the context, refused inside the stream


def _block_text(block: Any) -> str:
    if not isinstance(block, dict):
        return ""
    kind = block.get("type")
    if kind == "text":
        return str(block.get("text", ""))
    if kind == "tool_use":
        return f"{block.get('name', '')}({json.dumps(block.get('input') or {})})"
    if kind == "tool_result":
        content = block.get("content")
        return content if isinstance(content, str) else "".join(_block_text(b) for b in content or [])
    return ""


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(_block_text(b) for b in content)
    return ""


def prompt_text(body: JSONDict) -> str:
    lines: list[str] = []
    system = body.get("system")
    if system:
        lines.append(f"system: {_content_text(system)}")
    for message in body.get("messages") or []:
        if isinstance(message, dict):
            lines.append(f"{message.get('role', '')}: {_content_text(message.get('content'))}")
    return "\n".join(lines)


def _select_tool(body: JSONDict) -> tuple[gen.ToolSpec | None, str | None]:
    """The tool a ``tool_choice`` of ``any`` or ``{"type":"tool"}`` forces, or the name it asks for that is
    not among ``tools`` (second item)."""
    tools = [t for t in body.get("tools") or [] if isinstance(t, dict) and isinstance(t.get("name"), str)]
    choice = body.get("tool_choice")
    if not tools or not isinstance(choice, dict):
        return None, None
    if choice.get("type") == "any":
        chosen = tools[0]
    elif choice.get("type") == "tool":
        matches = [t for t in tools if t["name"] == choice.get("name")]
        if not matches:
            return None, str(choice.get("name"))
        chosen = matches[0]
    else:
        return None, None
    schema = chosen.get("input_schema")
    return gen.ToolSpec(name=chosen["name"], parameters=schema if isinstance(schema, dict) else {}), None


def parse_request(
    raw: bytes, *, served_model: str, max_model_len: int, dialect: gen.Dialect
) -> gen.GenRequest:
    """Validate a ``POST /v1/messages`` body like the engine; raises :class:`gen.RequestError`."""
    sglang = dialect.name == "sglang"
    try:
        body = json.loads(raw)
    except json.JSONDecodeError as exc:
        if sglang:
            raise gen.RequestError(
                400, error_body("invalid_request_error", f"{exc.pos}: JSON decode error")
            ) from None
        raise gen.RequestError(400, dialect.bad_json_error(exc)) from None
    except UnicodeDecodeError:
        raise gen.RequestError(
            400, error_body("invalid_request_error", "request body is not UTF-8")
        ) from None
    if not isinstance(body, dict):
        raise gen.RequestError(400, error_body("invalid_request_error", "request body must be a JSON object"))
    missing = [f for f in _REQUIRED if f not in body]
    if missing:
        if sglang:
            message = "; ".join(f"{f}: Field required" for f in missing)
            raise gen.RequestError(400, error_body("invalid_request_error", message))
        raise gen.RequestError(400, dialect.missing_field_error(missing[0], body))
    model = str(body.get("model"))
    max_tokens = body.get("max_tokens")
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        raise gen.RequestError(400, _refuse(sglang, 400, "max_tokens must be at least 1"))
    if not sglang and model != served_model:
        message = f"The model `{model}` does not exist. Valid aliases: {served_model}."
        raise gen.RequestError(404, error_body("NotFoundError", message))
    tool, unknown_tool = _select_tool(body)
    if unknown_tool is not None:
        raise gen.RequestError(
            400, _refuse(sglang, 400, f"Tool '{unknown_tool}' has not been passed in `tools`.")
        )
    seed = body.get("seed")
    req = gen.GenRequest(
        kind="messages",
        model=served_model,
        prompt_text=prompt_text(body),
        max_tokens=max_tokens,
        stream=body.get("stream") is True,
        include_usage=False,
        continuous_usage=False,
        seed=seed if isinstance(seed, int) and not isinstance(seed, bool) else None,
        tool=tool,
        params=MessagesParams(requested_model=model),
    )
    prompt_tokens = gen.prompt_token_count(req)
    if not sglang and max_tokens > max_model_len:
        message = (
            f"max_completion_tokens={max_tokens} cannot be greater than max_model_len={max_model_len}. "
            f"Please request fewer output tokens. (parameter=max_completion_tokens, value={max_tokens})"
        )
        raise gen.RequestError(400, error_body("BadRequestError", message))
    if sglang and prompt_tokens + max_tokens > max_model_len:
        message = gen.sglang_context_message(max_model_len, prompt_tokens, max_tokens)
        if not req.stream:
            raise gen.RequestError(400, error_body("BadRequestError", message))
        return dataclasses.replace(req, params=MessagesParams(requested_model=model, refusal=message))
    return req


def _refuse(sglang: bool, status: int, message: str) -> bytes:
    return error_body(SGLANG_ERROR_TYPES.get(status, "api_error") if sglang else "BadRequestError", message)


def vllm_stop_reason(finish: str, tool_used: bool, arguments: str) -> str | None:
    """vLLM's ``_to_anthropic_stop_reason`` (no stop strings: the simulator never matches one)."""
    if finish == "length":
        return "max_tokens"
    if finish not in ("stop", "tool_calls"):
        return None
    if tool_used and _is_json(arguments):
        return "tool_use"
    if finish == "tool_calls" or tool_used:
        return "tool_use"
    return "end_turn"


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except json.JSONDecodeError:
        return False
    return True


# --------------------------------------------------------------------------- non-streamed bodies


def _hermes_text(name: str, arguments: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {arguments}'


def response_body(
    req: gen.GenRequest, output: gen.Output, meta: gen.StreamMeta, produced: int, finish: str, *, sglang: bool
) -> JSONDict:
    """A non-streamed Messages answer (``messages.json``; ``exclude_none``)."""
    content: list[JSONDict] = []
    tool_used = False
    if output.tool_call_id is None:
        text = output.text(produced)
        if text:
            content.append({"type": "text", "text": text})
    elif produced:
        arguments = output.arguments(produced)
        if _is_json(arguments):
            tool_used = True
            block = {
                "type": "tool_use",
                "id": output.tool_call_id,
                "name": output.tool_name,
                "input": json.loads(arguments),
            }
            content.append(block)
        elif sglang:  # SGLang's chat layer reports the call; the converter defaults bad arguments to {}
            tool_used = True
            content.append(
                {"type": "tool_use", "id": output.tool_call_id, "name": output.tool_name, "input": {}}
            )
        else:  # vLLM's tool parser gives up on incomplete JSON: the raw text stays content
            content.append({"type": "text", "text": _hermes_text(output.tool_name or "", arguments)})
    if not content:
        content.append({"type": "text", "text": ""})
    body: JSONDict = {
        "id": meta.id,
        "type": "message",
        "role": "assistant",
        "content": content,
        "model": meta.model,
    }
    if sglang:
        body["stop_reason"] = SGLANG_STOP_REASONS.get(finish, "end_turn")
    else:
        stop_reason = vllm_stop_reason(finish, tool_used, output.arguments(produced))
        if stop_reason is not None:
            body["stop_reason"] = stop_reason
    body["usage"] = {"input_tokens": output.prompt_tokens, "output_tokens": produced}
    return body


# --------------------------------------------------------------------------- streams


class MessagesStream(gen.ApiStream):
    """vLLM 0.32's streamed Messages answer (``message_stream_converter``)."""

    def __init__(self, req: gen.GenRequest, output: gen.Output, meta: gen.StreamMeta) -> None:
        self.req = req
        self.output = output
        self.meta = meta
        self.response_id = meta.id
        self.started = False
        self.block: str | None = None  # "text" | "tool_use" while a block is open
        self.index = 0  # of the next block
        self.tool_used = False

    # -- event bodies (overridden for SGLang's key order)
    def _message_start(self, input_tokens: int) -> JSONDict:
        message = {
            "id": self.meta.id,
            "type": "message",
            "role": "assistant",
            "content": [],
            "model": self.meta.model,
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": input_tokens, "output_tokens": 0},
        }
        return {"type": "message_start", "message": message}

    def _block_start(self, block: JSONDict) -> JSONDict:
        return {"type": "content_block_start", "content_block": block, "index": self.index}

    def _block_delta(self, delta: JSONDict) -> JSONDict:
        return {"type": "content_block_delta", "delta": delta, "index": self.index}

    def _message_delta(self, produced: int, finish: str) -> JSONDict:
        stop_reason = vllm_stop_reason(finish, self.tool_used, self.output.arguments(produced))
        usage = {"input_tokens": self.output.prompt_tokens, "output_tokens": produced}
        return {
            "type": "message_delta",
            "delta": {"stop_reason": stop_reason, "stop_sequence": None},
            "usage": usage,
        }

    # -- the flow
    def _start(self) -> list[bytes]:
        if self.started:
            return []
        self.started = True
        return [sse_event(self._message_start(self.output.prompt_tokens))]

    def role(self) -> list[bytes]:
        return self._start()  # vLLM: with the chat stream's role event

    def _close_block(self) -> list[bytes]:
        if self.block is None:
            return []
        event = sse_event({"type": "content_block_stop", "index": self.index})
        self.block = None
        self.index += 1
        return [event]

    def _open(self, kind: str, block: JSONDict) -> list[bytes]:
        events = self._close_block()
        events.append(sse_event(self._block_start(block)))
        self.block = kind
        return events

    def piece(self, n: int, finish: str | None) -> list[tuple[bytes, bool]]:
        piece = self.output.pieces[n - 1]
        events: list[tuple[bytes, bool]] = [(e, False) for e in self._start()]
        fragment = gen.piece_arguments(piece)
        if gen.piece_names_tool(piece):
            self.tool_used = True
            block = {
                "type": "tool_use",
                "id": self.output.tool_call_id,
                "name": self.output.tool_name,
                "input": {},
            }
            opened = self._open("tool_use", block)
            events += [(e, False) for e in opened[:-1]]
            events.append((opened[-1], True))  # names the tool: first content
            if fragment:
                events.append(
                    (
                        sse_event(self._block_delta({"type": "input_json_delta", "partial_json": fragment})),
                        True,
                    )
                )
            return events
        if fragment is not None:
            delta = {"type": "input_json_delta", "partial_json": fragment}
            return [*events, (sse_event(self._block_delta(delta)), True)]
        if self.block != "text":
            events += [(e, False) for e in self._open("text", {"type": "text", "text": ""})]
        delta = {"type": "text_delta", "text": piece.get("content") or ""}
        return [*events, (sse_event(self._block_delta(delta)), True)]

    def closing(self, produced: int, finish: str, finish_sent: bool) -> list[bytes]:
        return [*self._close_block(), sse_event(self._message_delta(produced, finish))]

    def terminal(self, produced: int, finish: str) -> list[bytes]:
        return [sse_event({"type": "message_stop"})]

    def failure(self, produced: int) -> tuple[list[bytes], bool]:
        error = {"type": "error", "error": {"type": "internal_error", "message": VLLM_INBAND_MESSAGE}}
        return [sse_event(error)], True


class SglangMessagesStream(MessagesStream):
    """SGLang 0.5.23's streamed Messages answer (``_generate_anthropic_stream``)."""

    def _message_start(self, input_tokens: int) -> JSONDict:
        message = {
            "id": self.meta.id,
            "type": "message",
            "role": "assistant",
            "content": [],
            "model": self.req.params.requested_model,
            "usage": {"input_tokens": input_tokens, "output_tokens": 0},
        }
        return {"type": "message_start", "message": message}

    def _block_start(self, block: JSONDict) -> JSONDict:
        return {"type": "content_block_start", "index": self.index, "content_block": block}

    def _block_delta(self, delta: JSONDict) -> JSONDict:
        return {"type": "content_block_delta", "index": self.index, "delta": delta}

    def _message_delta(self, produced: int, finish: str) -> JSONDict:
        stop_reason = SGLANG_STOP_REASONS.get(finish, "end_turn")
        return {
            "type": "message_delta",
            "delta": {"stop_reason": stop_reason},
            "usage": {"output_tokens": produced},
        }

    def role(self) -> list[bytes]:
        return []  # deferred to the first content

    def finish_only(self, produced: int, reason: str) -> list[bytes]:
        return self._start()

    def failure(self, produced: int) -> tuple[list[bytes], bool]:
        error = {
            "type": "error",
            "error": {"type": "overloaded_error", "message": gen.SGLANG_TIMEOUT_MESSAGE},
        }
        events = [*self._start(), *self._close_block(), sse_event(error), sse_event({"type": "message_stop"})]
        return events, True

    def refusal(self, message: str) -> list[bytes]:
        """A request over the context: refused inside the 200 stream."""
        self.started = True
        error = {"type": "error", "error": {"type": "invalid_request_error", "message": message}}
        return [sse_event(self._message_start(0)), sse_event(error), sse_event({"type": "message_stop"})]


def new_id(req: gen.GenRequest, *, sglang: bool) -> str:
    if sglang:
        return f"msg_{secrets.token_hex(16)}"
    return f"chatcmpl-{req.request_id}" if req.request_id else f"chatcmpl-{secrets.token_hex(8)}"


def stream_for(
    req: gen.GenRequest, output: gen.Output, meta: gen.StreamMeta, *, sglang: bool
) -> MessagesStream:
    return (SglangMessagesStream if sglang else MessagesStream)(req, output, meta)


# --------------------------------------------------------------------------- error replies of the faults


def unavailable_error(sglang: bool) -> bytes:
    return (
        error_body("overloaded_error", "Internal server error")
        if sglang
        else error_body("ServiceUnavailableError", "Service Unavailable")
    )


def too_many_requests_error(sglang: bool) -> bytes:
    return error_body("rate_limit_error" if sglang else "TooManyRequestsError", "Too Many Requests")


def failed_reply(sglang: bool) -> tuple[int, bytes]:
    """The ``error`` fault without a stream: vLLM's engine-dead 500 translated; SGLang's timeout 503 scrubbed
    (captured as ``sgl_msg_timeout_ns``)."""
    if sglang:
        return 503, error_body("overloaded_error", "Internal server error")
    return 500, error_body("InternalServerError", gen.ENGINE_DEAD_MESSAGE)
