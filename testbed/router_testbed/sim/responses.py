"""The OpenAI Responses API (``POST /v1/responses``) as vLLM 0.32 serves it (pure; no I/O).

Checked against vLLM 0.32's own code (``vllm/entrypoints/openai/responses/``: ``api_router.py``,
``serving.py``, ``streaming_events.py``, ``protocol.py``) and against captures of the real server
(``reference/vllm-0.32-cpu/responses_*`` and ``tests/unit/sim_captures/vllm-0.32/``):

* Named SSE events, ``event: <type>`` + ``data: <compact JSON>``, no ``[DONE]``; every event carries
  ``sequence_number`` from 0. ``response.created`` and ``response.in_progress`` are written as soon as the
  stream starts (before the engine produced anything); a text answer then opens with
  ``response.output_item.added`` (a ``message``) and ``response.content_part.added``, then one
  ``response.output_text.delta`` per token; a tool call opens with ``response.output_item.added`` of a
  ``function_call`` (its name; arguments ``""``), then ``response.function_call_arguments.delta`` events.
  At the end: ``*.done`` events and ``response.completed``, also when ``status`` is ``"incomplete"``
  (``max_output_tokens``): vLLM 0.32 never sends ``response.incomplete`` or ``response.failed``.
* The engine failing mid-stream: no error event, no terminal event, and the connection closes without the
  chunked body's last chunk (the exception escapes the stream; ``StreamingResponsesResponse`` has no error
  event type, so even a ``GenerationError`` ends that way).
* Ids: ``resp_`` + 16 hex (or the body's ``request_id``), items ``msg_``/``fc_`` + 16 hex, call ids
  ``chatcmpl-tool-`` + 16 hex. ``x-request-id`` plays no part.
* The store is off unless the server runs with ``VLLM_ENABLE_RESPONSES_API_STORE=1`` (the simulator's
  ``--responses-store``): without it ``store`` is silently ignored, ``previous_response_id`` and
  ``GET /v1/responses/{id}`` are always 404, and ``background: true`` (with ``store`` left true) is a 400.

Reasoning items (``rs_…``, ``response.reasoning_text.delta``) need a reasoning parser on the server; the
simulated replica has none, as the captured one had none, so it never emits them.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass
from typing import Any

from router_testbed.sim import generation as gen
from router_testbed.sim.generation import JSONDict

NOT_SUPPORTED_BACKGROUND = (
    "This vLLM engine does not support `store=True` and therefore does not support the background mode. "
    "To enable these features, set the environment variable `VLLM_ENABLE_RESPONSES_API_STORE=1` when "
    "launching the vLLM server."
)
CANNOT_CANCEL = "Cannot cancel a synchronous response."

_STATUS_INCOMPLETE = "incomplete"


def new_id(prefix: str) -> str:
    """``resp_``/``msg_``/``fc_`` + 16 hex, like vLLM 0.32's ``random_uuid()``."""
    return f"{prefix}_{secrets.token_hex(8)}"


# --------------------------------------------------------------------------- the request


@dataclass(frozen=True)
class ResponsesParams:
    """What a Responses request says beyond the prompt: the fields the response object echoes, and the
    store/background switches."""

    instructions: str | None
    metadata: Any
    temperature: float
    top_p: float
    tools: list[Any]
    tool_choice: Any
    parallel_tool_calls: bool
    max_output_tokens: int  # as echoed: the request's, capped by the context, else what is left of it
    max_tool_calls: Any
    previous_response_id: str | None
    prompt: Any
    reasoning: Any
    service_tier: str
    text: Any
    truncation: Any
    user: Any
    presence_penalty: float
    frequency_penalty: float
    store: bool
    background: bool
    body_request_id: str | None  # the body's ``request_id``: it becomes the response id
    input_text: str  # this request's own input (the prompt without a previous response's turns)


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return ""


def input_text(value: Any, instructions: Any) -> str:
    """The prompt of a Responses ``input`` (a string or a list of items) and ``instructions``."""
    lines: list[str] = []
    if isinstance(instructions, str) and instructions:
        lines.append(f"system: {instructions}")
    if isinstance(value, str):
        lines.append(f"user: {value}")
    elif isinstance(value, list):
        for item in value:
            if not isinstance(item, dict):
                continue
            if "role" in item:
                lines.append(f"{item.get('role', '')}: {_content_text(item.get('content'))}")
            elif item.get("type") == "function_call_output":
                lines.append(f"tool: {item.get('output', '')}")
            elif item.get("type") == "function_call":
                lines.append(f"assistant: {item.get('name', '')}({item.get('arguments', '')})")
    return "\n".join(lines)


def _echo_tool(tool: Any) -> Any:
    """A function tool as vLLM echoes it (its FunctionTool model, in field order); others as given."""
    if not isinstance(tool, dict) or tool.get("type") != "function":
        return tool
    return {
        "name": tool.get("name"),
        "parameters": tool.get("parameters"),
        "strict": tool.get("strict"),
        "type": "function",
        "allowed_callers": tool.get("allowed_callers"),
        "async": tool.get("async"),
        "defer_loading": tool.get("defer_loading"),
        "description": tool.get("description"),
        "output_schema": tool.get("output_schema"),
    }


def _echo_tool_choice(choice: Any, has_tools: bool) -> Any:
    if not has_tools and choice in ("auto", "none"):
        return "none"  # vLLM's check_tool_usage: no tools, no choice
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"name": choice.get("name"), "type": "function"}
    return choice


def _select_tool(tools: list[Any], choice: Any, dialect: gen.Dialect) -> gen.ToolSpec | None:
    funcs = [t for t in tools if isinstance(t, dict) and t.get("type") == "function" and t.get("name")]
    if not funcs:
        return None
    if choice == "required":
        chosen = funcs[0]
    elif isinstance(choice, dict) and choice.get("type") == "function":
        matches = [f for f in funcs if f["name"] == choice.get("name")]
        if not matches:
            message = "Tool choice 'function' not found in 'tools' parameter."
            raise gen.RequestError(400, dialect.bad_request_error(message, "tool_choice"))
        chosen = matches[0]
    else:
        return None
    params = chosen.get("parameters")
    return gen.ToolSpec(name=str(chosen["name"]), parameters=params if isinstance(params, dict) else {})


def _number(value: Any, default: float) -> float:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else default


def parse_request(
    raw: bytes, *, served_model: str, max_model_len: int, dialect: gen.Dialect
) -> gen.GenRequest:
    """Validate a ``POST /v1/responses`` body like vLLM 0.32; raises :class:`gen.RequestError`."""
    d = dialect
    try:
        body = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise gen.RequestError(400, d.responses_bad_json_error(exc)) from None
    except UnicodeDecodeError:
        raise gen.RequestError(400, d.bad_request_error("request body is not UTF-8")) from None
    if not d.serves_responses:
        raise gen.RequestError(500, b"Internal Server Error", plain=True)
    if not isinstance(body, dict):
        raise gen.RequestError(400, d.bad_request_error("request body must be a JSON object"))
    if body.get("background") and body.get("store", True) is False:  # validate_background
        message = "background can only be used when `store` is true"
        raise gen.RequestError(400, d.bad_request_error(message, "background"))
    if "input" not in body:
        # pydantic reports the input its before-validators left: check_tool_usage adds a tool_choice
        seen = dict(body)
        if not body.get("tools") and body.get("tool_choice", "auto") in ("auto", "none"):
            seen["tool_choice"] = "none"
        raise gen.RequestError(400, d.missing_field_error("input", seen))
    model = body.get("model") or served_model
    if model != served_model:
        raise gen.RequestError(404, d.wrong_model_error(str(model), served_model))
    max_tokens = body.get("max_output_tokens")
    if max_tokens is not None and (
        not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1
    ):
        raise gen.RequestError(
            400, d.bad_request_error("max_output_tokens must be at least 1", "max_output_tokens")
        )
    if max_tokens is not None and max_tokens > max_model_len:
        raise gen.RequestError(400, too_long_error(max_tokens, max_model_len))
    tools = body.get("tools") if isinstance(body.get("tools"), list) else []
    choice = body.get("tool_choice", "auto")
    instructions = body.get("instructions")
    prompt = input_text(body.get("input"), instructions)
    seed = body.get("seed")
    request_id = body.get("request_id")
    store = body.get("store", True) is not False
    params = ResponsesParams(
        instructions=instructions if isinstance(instructions, str) else None,
        metadata=body.get("metadata"),
        temperature=_number(body.get("temperature"), 1.0),
        top_p=_number(body.get("top_p"), 1.0),
        tools=[_echo_tool(t) for t in tools],
        tool_choice=_echo_tool_choice(choice, bool(tools)),
        parallel_tool_calls=body.get("parallel_tool_calls") is not False,
        max_output_tokens=0,  # filled in below, once the prompt's length is known
        max_tool_calls=body.get("max_tool_calls"),
        previous_response_id=body.get("previous_response_id"),
        prompt=body.get("prompt"),
        reasoning=body.get("reasoning"),
        service_tier=body.get("service_tier") or "auto",
        text=body.get("text"),
        truncation=body.get("truncation", "disabled"),
        user=body.get("user"),
        presence_penalty=_number(body.get("presence_penalty"), 0.0),
        frequency_penalty=_number(body.get("frequency_penalty"), 0.0),
        store=store,
        background=body.get("background") is True,
        body_request_id=request_id if isinstance(request_id, str) and request_id else None,
        input_text=prompt,
    )
    req = gen.GenRequest(
        kind="responses",
        model=served_model,
        prompt_text=prompt,
        max_tokens=max_tokens,
        stream=body.get("stream") is True,
        include_usage=False,
        continuous_usage=False,
        seed=seed if isinstance(seed, int) and not isinstance(seed, bool) else None,
        tool=_select_tool(tools, choice, d),
        params=params,
    )
    return with_prompt(req, prompt, max_model_len)


def with_prompt(req: gen.GenRequest, prompt: str, max_model_len: int) -> gen.GenRequest:
    """The request with its prompt set (a previous response's turns prepended) and the echoed
    ``max_output_tokens`` computed from it."""
    import dataclasses

    req = dataclasses.replace(req, prompt_text=prompt)
    room = max(1, max_model_len - gen.prompt_token_count(req))
    echoed = min(req.max_tokens, room) if req.max_tokens is not None else room
    return dataclasses.replace(req, params=dataclasses.replace(req.params, max_output_tokens=echoed))


def too_long_error(max_tokens: int, max_model_len: int) -> bytes:
    return gen.error_body(
        f"max_output_tokens={max_tokens} cannot be greater than max_model_len={max_model_len}. "
        f"Please request fewer output tokens. (parameter=max_output_tokens, value={max_tokens})",
        "BadRequestError",
        "max_output_tokens",
        400,
    )


def not_found_error(response_id: str) -> bytes:
    """vLLM's 404 for a ``previous_response_id``/``GET``/``cancel`` of a response it does not hold."""
    return gen.error_body(
        f"Response with id '{response_id}' not found.", "invalid_request_error", "response_id", 404
    )


def background_without_store_error() -> bytes:
    return gen.error_body(NOT_SUPPORTED_BACKGROUND, "invalid_request_error", "background", 400)


def cannot_cancel_error() -> bytes:
    return gen.error_body(CANNOT_CANCEL, "invalid_request_error", "response_id", 400)


# --------------------------------------------------------------------------- the response object


def usage_object(prompt_tokens: int, output_tokens: int) -> JSONDict:
    return {
        "input_tokens": prompt_tokens,
        "input_tokens_details": {
            "cached_tokens": 0,
            "cache_write_tokens": 0,
            "input_tokens_per_turn": [],
            "cached_tokens_per_turn": [],
        },
        "output_tokens": output_tokens,
        "output_tokens_details": {
            "reasoning_tokens": 0,
            "tool_output_tokens": 0,
            "output_tokens_per_turn": [],
            "tool_output_tokens_per_turn": [],
        },
        "total_tokens": prompt_tokens + output_tokens,
    }


def response_object(
    p: ResponsesParams,
    *,
    response_id: str,
    created: int,
    model: str,
    status: str,
    output: list[Any],
    usage: JSONDict | None,
) -> JSONDict:
    """vLLM's ``ResponsesResponse`` in its field order (``from_request``)."""
    return {
        "id": response_id,
        "created_at": created,
        "incomplete_details": {"reason": "max_output_tokens"} if status == _STATUS_INCOMPLETE else None,
        "instructions": p.instructions,
        "metadata": p.metadata,
        "model": model,
        "object": "response",
        "output": output,
        "parallel_tool_calls": p.parallel_tool_calls,
        "temperature": p.temperature,
        "tool_choice": p.tool_choice,
        "tools": p.tools,
        "top_p": p.top_p,
        "background": p.background,
        "max_output_tokens": p.max_output_tokens,
        "max_tool_calls": p.max_tool_calls,
        "previous_response_id": p.previous_response_id,
        "prompt": p.prompt,
        "reasoning": p.reasoning,
        "service_tier": p.service_tier,
        "status": status,
        "text": p.text,
        "top_logprobs": None,
        "truncation": p.truncation,
        "usage": usage,
        "user": p.user,
        "presence_penalty": p.presence_penalty,
        "frequency_penalty": p.frequency_penalty,
        "kv_transfer_params": None,
        "ec_transfer_params": None,
        "input_messages": None,
        "output_messages": None,
    }


def status_for(finish: str) -> str:
    """A finished generation's status: ``incomplete`` on ``length``, else the catch-all ``completed``
    (also for ``abort``: vLLM's simple path checks only ``length``)."""
    return _STATUS_INCOMPLETE if finish == "length" else "completed"


def message_item(item_id: str, text: str, status: str, *, done: bool) -> JSONDict:
    content = [_part(text, done=True)] if done and text else []
    return {
        "id": item_id,
        "content": content,
        "role": "assistant",
        "status": status,
        "type": "message",
        "phase": None,
    }


def _part(text: str, *, done: bool) -> JSONDict:
    return {"annotations": [], "text": text, "type": "output_text", "logprobs": None if done else []}


def function_call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> JSONDict:
    return {
        "arguments": arguments,
        "call_id": call_id,
        "name": name,
        "type": "function_call",
        "id": item_id,
        "async": None,
        "caller": None,
        "namespace": None,
        "status": status,
    }


def _hermes_text(name: str, arguments: str) -> str:
    """The raw text the tool parser leaves as a message when a call's arguments never completed (a
    non-streamed answer cut by ``max_output_tokens``: captured as ``resp_tool_named_nonstream``)."""
    return f'<tool_call>\n{{"name": "{name}", "arguments": {arguments}'


def nonstream_output(output: gen.Output, produced: int) -> list[JSONDict]:
    """A non-streamed answer's output items (fresh ids, as vLLM builds them after generation)."""
    if output.tool_call_id is None:
        text = output.text(produced)
        return [message_item(new_id("msg"), text, "completed", done=True)] if text else []
    if produced == 0:
        return []
    arguments = output.arguments(produced)
    try:
        json.loads(arguments)
    except json.JSONDecodeError:
        text = _hermes_text(output.tool_name or "", arguments)
        return [message_item(new_id("msg"), text, "completed", done=True)]
    return [
        function_call_item(new_id("fc"), output.tool_call_id, output.tool_name or "", arguments, "completed")
    ]


def response_body(
    req: gen.GenRequest, output: gen.Output, meta: gen.StreamMeta, produced: int, finish: str
) -> JSONDict:
    """The non-streamed answer (``responses.json``) after ``produced`` tokens."""
    return response_object(
        req.params,
        response_id=meta.id,
        created=meta.created,
        model=meta.model,
        status=status_for(finish),
        output=nonstream_output(output, produced),
        usage=usage_object(output.prompt_tokens, produced),
    )


def queued_object(req: gen.GenRequest, meta: gen.StreamMeta) -> JSONDict:
    """What ``background: true`` answers at once, and what the store holds until the run ends."""
    return response_object(
        req.params,
        response_id=meta.id,
        created=meta.created,
        model=meta.model,
        status="queued",
        output=[],
        usage=None,
    )


# --------------------------------------------------------------------------- the stream


def sse_event(payload: JSONDict) -> bytes:
    """``event: <type>`` + ``data: <compact JSON>`` (``_convert_stream_to_sse_events``)."""
    return f"event: {payload['type']}\ndata: ".encode() + gen.dumps(payload).encode() + b"\n\n"


class ResponsesStream(gen.ApiStream):
    """vLLM 0.32's streamed Responses answer (``SimpleStreamingEventProcessor``), numbered as written."""

    def __init__(self, req: gen.GenRequest, output: gen.Output, meta: gen.StreamMeta) -> None:
        self.req = req
        self.params: ResponsesParams = req.params
        self.output = output
        self.meta = meta
        self.response_id = meta.id
        self.seq = 0
        self.state: str | None = None  # "message" | "function_call" while an item is open
        self.item_id = ""
        self.accumulated = ""
        self.items: list[JSONDict] = []  # the closed items (response.completed's output)
        self.final: JSONDict | None = None  # response.completed's response, once written

    def _event(self, payload: JSONDict) -> bytes:
        """Number the event and order its keys as the openai types do: alphabetically, except that
        ``response.function_call_arguments.done`` has ``name`` (a later field) after ``type``."""
        payload["sequence_number"] = self.seq
        self.seq += 1
        ordered = {k: payload[k] for k in sorted(payload)}
        if payload["type"] == "response.function_call_arguments.done":
            ordered["name"] = ordered.pop("name")
        return sse_event(ordered)

    def _response(self, status: str, output: list[Any], usage: JSONDict | None) -> JSONDict:
        m = self.meta
        return response_object(
            self.params,
            response_id=m.id,
            created=m.created,
            model=m.model,
            status=status,
            output=output,
            usage=usage,
        )

    def opening(self) -> list[bytes]:
        initial = self._response("in_progress", [], None)
        return [
            self._event({"response": initial, "type": "response.created"}),
            self._event({"response": initial, "type": "response.in_progress"}),
        ]

    def _open_message(self) -> list[bytes]:
        self.state, self.item_id, self.accumulated = "message", new_id("msg"), ""
        item = message_item(self.item_id, "", "in_progress", done=False)
        return [
            self._event(
                {"item": item, "output_index": len(self.items), "type": "response.output_item.added"}
            ),
            self._event(
                {
                    "content_index": 0,
                    "item_id": self.item_id,
                    "output_index": len(self.items),
                    "part": _part("", done=False),
                    "type": "response.content_part.added",
                }
            ),
        ]

    def _arguments_delta(self, fragment: str) -> bytes:
        self.accumulated += fragment
        return self._event(
            {
                "delta": fragment,
                "item_id": self.item_id,
                "output_index": len(self.items),
                "type": "response.function_call_arguments.delta",
            }
        )

    def piece(self, n: int, finish: str | None) -> list[tuple[bytes, bool]]:
        piece = self.output.pieces[n - 1]
        fragment = gen.piece_arguments(piece)
        if gen.piece_names_tool(piece):
            events: list[tuple[bytes, bool]] = [(e, False) for e in self.closing_events()]
            self.state, self.item_id, self.accumulated = "function_call", new_id("fc"), ""
            item = function_call_item(
                self.item_id, self.output.tool_call_id or "", self.output.tool_name or "", "", "in_progress"
            )
            added = {"item": item, "output_index": len(self.items), "type": "response.output_item.added"}
            events.append((self._event(added), True))  # names the tool: first content
            if fragment:
                events.append((self._arguments_delta(fragment), True))
            return events
        if fragment is not None:
            return [(self._arguments_delta(fragment), True)]
        text = piece.get("content") or ""
        opened = [] if self.state == "message" else [*self.closing_events(), *self._open_message()]
        self.accumulated += text
        delta = {
            "content_index": 0,
            "delta": text,
            "item_id": self.item_id,
            "logprobs": [],
            "output_index": len(self.items),
            "type": "response.output_text.delta",
        }
        return [*((e, False) for e in opened), (self._event(delta), True)]

    def closing_events(self) -> list[bytes]:
        """The ``*.done`` events of the open item, if any (``close_current``)."""
        index = len(self.items)
        if self.state == "message":
            text = self.accumulated
            item = message_item(self.item_id, text, "completed", done=True)
            events = [
                self._event(
                    {
                        "content_index": 0,
                        "item_id": self.item_id,
                        "logprobs": [],
                        "output_index": index,
                        "text": text,
                        "type": "response.output_text.done",
                    }
                ),
                self._event(
                    {
                        "content_index": 0,
                        "item_id": self.item_id,
                        "output_index": index,
                        "part": _part(text, done=True),
                        "type": "response.content_part.done",
                    }
                ),
                self._event({"item": item, "output_index": index, "type": "response.output_item.done"}),
            ]
        elif self.state == "function_call":
            item = function_call_item(
                self.item_id,
                self.output.tool_call_id or "",
                self.output.tool_name or "",
                self.accumulated,
                "completed",
            )
            events = [
                self._event(
                    {
                        "arguments": self.accumulated,
                        "item_id": self.item_id,
                        "output_index": index,
                        "type": "response.function_call_arguments.done",
                        "name": self.output.tool_name or "",
                    }
                ),
                self._event({"item": item, "output_index": index, "type": "response.output_item.done"}),
            ]
        else:
            return []
        self.items.append(item)
        self.state = None
        return events

    def closing(self, produced: int, finish: str, finish_sent: bool) -> list[bytes]:
        return self.closing_events()

    def terminal(self, produced: int, finish: str) -> list[bytes]:
        self.final = self._response(
            status_for(finish), list(self.items), usage_object(self.output.prompt_tokens, produced)
        )
        return [self._event({"response": self.final, "type": "response.completed"})]

    def failure(self, produced: int) -> tuple[list[bytes], bool]:
        return [], False  # the exception escapes the stream: no event, no last chunk
