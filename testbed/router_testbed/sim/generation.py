"""Deterministic output and the exact byte formats of the engines the simulator speaks (pure; no I/O).

Two dialects (:data:`DIALECTS`), chosen per simulator process with ``--dialect``:

* ``vllm`` mirrors the transcripts in ``reference/vllm-0.32-cpu/``: key names, key order, compact JSON,
  where ``finish_reason``/``stop_reason``/``token_ids``/``usage``/``system_fingerprint`` appear, and the one
  in-band error event that vLLM writes with ``json.dumps`` default spacing. The module-level functions and
  :class:`StreamRenderer` are this dialect.
* ``sglang`` mirrors ``reference/sglang-0.5.23-cpu/transcripts/``: bare 32-hex ids (a body ``rid`` sets
  them), ``reasoning_content``/``matched_stop`` everywhere, a separate chat finish event, ``"usage":null`` on
  every completions event, top-level error objects, and an in-band error followed by usage and ``[DONE]``
  (:class:`SglangStreamRenderer`, :class:`SglangDialect`).

The server's flow (faults, timing, the request log) is the same for both; everything that differs on the
wire is a method of :class:`Dialect` or of its renderer, so nothing else branches on the engine.

Four APIs share that flow through :class:`ApiStream` (what to write at each point of a streamed answer):
chat completions and completions here (:class:`ChatStream` over :class:`StreamRenderer`), the Responses API in
:mod:`router_testbed.sim.responses` and the Messages API in :mod:`router_testbed.sim.messages`. Responses and
Messages requests generate chat-shaped pieces (:func:`plan_output`), which their streams translate.

One generated token is one content event (the simulator never coalesces tokens), so counting
content events equals counting tokens for a simulated replica.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import random
import secrets
from dataclasses import dataclass
from typing import Any, Literal

VLLM_VERSION = "0.32.0"
DEFAULT_MAX_TOKENS = 16
DEFAULT_MAX_MODEL_LEN = 1024
ENGINE_DEAD_MESSAGE = "EngineCore encountered an issue. See stack trace (above) for the root cause."

Kind = Literal["chat", "completion", "responses", "messages"]
JSONDict = dict[str, Any]

_LETTERS = "abcdefghijklmnopqrstuvwxyz"
DONE_EVENT = b"data: [DONE]\n\n"


# --------------------------------------------------------------------------- JSON / SSE / chunks


def dumps(obj: Any) -> str:
    """Compact JSON like vLLM's pydantic ``model_dump_json``."""
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False)


def sse(obj: Any) -> bytes:
    return b"data: " + dumps(obj).encode() + b"\n\n"


def chunk(data: bytes) -> bytes:
    """One HTTP/1.1 chunk of a chunked body."""
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


LAST_CHUNK = b"0\r\n\r\n"


def split_events(body: bytes) -> list[bytes]:
    """Split an SSE body into its events (each without the trailing blank line)."""
    return [part for part in body.split(b"\n\n") if part.strip()]


def event_payload(event: bytes) -> Any:
    """The parsed JSON of a ``data: {...}`` event, or the string ``"[DONE]"``."""
    text = event.decode().rstrip("\n")
    if not text.startswith("data: "):
        raise ValueError(f"not a data event: {text[:80]!r}")
    data = text[len("data: ") :]
    return data if data == "[DONE]" else json.loads(data)


# --------------------------------------------------------------------------- errors


def error_body(message: str, type_: str, param: str | None, code: int) -> bytes:
    """vLLM's JSON error body for an HTTP error reply (compact)."""
    return dumps({"error": {"message": message, "type": type_, "param": param, "code": code}}).encode()


def inband_error_event(message: str = ENGINE_DEAD_MESSAGE, type_: str = "InternalServerError") -> bytes:
    """vLLM's in-band error event (status already 200): note the *spaced* JSON, unlike every other event."""
    payload = {"error": {"message": message, "type": type_, "param": None, "code": 500}}
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


def bad_json_error(exc: json.JSONDecodeError) -> bytes:
    """The 400 body vLLM (FastAPI/pydantic) returns for a body that is not valid JSON."""
    detail = (
        "1 validation error:\n"
        f"  {{'type': 'json_invalid', 'loc': 'body.{exc.pos}', 'msg': 'JSON decode error', "
        f"'input': '<dict of 0 items>', 'ctx': {{'error': {exc.msg!r}}}}}"
    )
    return error_body(detail, "Bad Request", f"body.{exc.pos}", 400)


def wrong_model_error(requested: str, served: str) -> bytes:
    return error_body(
        f"The model `{requested}` does not exist. Valid aliases: {served}.", "NotFoundError", "model", 404
    )


def too_long_error(max_tokens: int, max_model_len: int) -> bytes:
    return error_body(
        f"max_tokens={max_tokens} cannot be greater than max_model_len={max_model_len}. "
        f"Please request fewer output tokens. (parameter=max_tokens, value={max_tokens})",
        "BadRequestError",
        "max_tokens",
        400,
    )


def bad_request_error(message: str, param: str | None = None) -> bytes:
    return error_body(message, "BadRequestError", param, 400)


def missing_field_error(field: str, body: dict[str, Any]) -> bytes:
    """vLLM's 400 for a request body without a required field (FastAPI's validation, before the route;
    captured as ``resp_no_input`` and ``msg_no_max_tokens``)."""
    detail = (
        "1 validation error:\n"
        f"  {{'type': 'missing', 'loc': 'body.{field}', 'msg': 'Field required', "
        f"'input': '<dict of {len(body)} items>'}}"
    )
    return error_body(detail, "Bad Request", f"body.{field}", 400)


def unavailable_error() -> bytes:
    return error_body("Service Unavailable", "ServiceUnavailableError", None, 503)


def too_many_requests_error() -> bytes:
    """The ``status429`` fault's body (vLLM itself never answers 429: the shape of its other errors)."""
    return error_body("Too Many Requests", "TooManyRequestsError", None, 429)


def engine_dead_error() -> bytes:
    return error_body(ENGINE_DEAD_MESSAGE, "InternalServerError", None, 500)


# --------------------------------------------------------------------------- ids


def chat_id() -> str:
    return f"chatcmpl-{secrets.token_hex(8)}"


def completion_id() -> str:
    return f"cmpl-{secrets.token_hex(8)}"


def fingerprint_for(model: str, seed: int) -> str:
    """``system_fingerprint`` of a simulated replica: stable for (model, server seed)."""
    digest = hashlib.sha256(f"{model}\0{seed}".encode()).hexdigest()[:8]
    return f"vllm-{VLLM_VERSION}-{digest}"


# --------------------------------------------------------------------------- request parsing


class RequestError(Exception):
    """A request the engine refuses before streaming: ``status`` + JSON ``body`` (``plain``: a
    ``text/plain`` body from outside the app's middleware, without ``vary: Origin``, as uvicorn answers an
    unhandled exception)."""

    def __init__(self, status: int, body: bytes, *, plain: bool = False) -> None:
        super().__init__(body.decode(errors="replace"))
        self.status = status
        self.body = body
        self.plain = plain


@dataclass(frozen=True)
class ToolSpec:
    name: str
    parameters: JSONDict


@dataclass(frozen=True)
class GenRequest:
    kind: Kind
    model: str
    prompt_text: str
    max_tokens: int | None
    stream: bool
    include_usage: bool
    continuous_usage: bool
    seed: int | None
    tool: ToolSpec | None = None
    rid: str | None = None  # the body's ``rid`` (SGLang's request id; it becomes the completion id there)
    # Responses/Messages: the parsed request (responses.ResponsesParams / messages.MessagesParams)
    params: Any = None
    # the x-request-id the request arrived with (vLLM names a Messages answer after it), set by the server
    request_id: str | None = None

    @property
    def chat_like(self) -> bool:
        """Whether the prompt is chat-templated and the pieces are chat deltas (all but completions)."""
        return self.kind != "completion"


def _message_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return ""


def _select_tool(body: JSONDict, dialect: Dialect) -> ToolSpec | None:
    tools = body.get("tools")
    choice = body.get("tool_choice")
    if not isinstance(tools, list) or not tools:
        return None
    funcs = [t.get("function", {}) for t in tools if isinstance(t, dict)]
    funcs = [f for f in funcs if isinstance(f, dict) and isinstance(f.get("name"), str)]
    if not funcs:
        return None
    if choice == "required":
        chosen = funcs[0]
    elif isinstance(choice, dict) and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        matches = [f for f in funcs if f["name"] == name]
        if not matches:
            message = f"Tool '{name}' has not been passed in `tools`."
            raise RequestError(400, dialect.bad_request_error(message, None))
        chosen = matches[0]
    else:
        return None
    params = chosen.get("parameters")
    return ToolSpec(name=chosen["name"], parameters=params if isinstance(params, dict) else {})


def parse_request(
    kind: Kind,
    raw: bytes,
    *,
    served_model: str,
    max_model_len: int = DEFAULT_MAX_MODEL_LEN,
    dialect: Dialect | None = None,
) -> GenRequest:
    """Validate a request body like the engine does; raises :class:`RequestError` with its error reply."""
    d = dialect or VLLM
    if kind == "responses":
        from router_testbed.sim import responses

        return responses.parse_request(raw, served_model=served_model, max_model_len=max_model_len, dialect=d)
    if kind == "messages":
        from router_testbed.sim import messages

        return messages.parse_request(raw, served_model=served_model, max_model_len=max_model_len, dialect=d)
    try:
        body = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise RequestError(400, d.bad_json_error(exc)) from None
    except UnicodeDecodeError:
        raise RequestError(400, d.bad_request_error("request body is not UTF-8")) from None
    if not isinstance(body, dict):
        raise RequestError(400, d.bad_request_error("request body must be a JSON object"))
    model = body.get("model", served_model)
    if model != served_model:
        raise RequestError(404, d.wrong_model_error(str(model), served_model))
    max_tokens = body.get("max_tokens", body.get("max_completion_tokens"))
    if max_tokens is not None and (
        not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1
    ):
        raise RequestError(400, d.bad_request_error("max_tokens must be at least 1", "max_tokens"))
    opts = body.get("stream_options") or {}
    include_usage = bool(isinstance(opts, dict) and opts.get("include_usage"))
    continuous = include_usage and d.continuous_usage and bool(opts.get("continuous_usage_stats"))
    seed = body.get("seed")
    rid = body.get("rid")
    if kind == "chat":
        messages = body.get("messages")
        if not isinstance(messages, list):
            raise RequestError(400, d.bad_request_error("Field required: messages", "messages"))
        prompt = "\n".join(
            f"{m.get('role', '')}: {_message_text(m.get('content'))}" for m in messages if isinstance(m, dict)
        )
        tool = _select_tool(body, d)
    else:
        raw_prompt = body.get("prompt")
        if isinstance(raw_prompt, list):
            prompt = "".join(str(p) for p in raw_prompt)
        elif isinstance(raw_prompt, str):
            prompt = raw_prompt
        else:
            raise RequestError(400, d.bad_request_error("Field required: prompt", "prompt"))
        tool = None
    req = GenRequest(
        kind=kind,
        model=served_model,
        prompt_text=prompt,
        max_tokens=max_tokens,
        stream=bool(body.get("stream", False)),
        include_usage=include_usage,
        continuous_usage=continuous,
        seed=seed if isinstance(seed, int) and not isinstance(seed, bool) else None,
        tool=tool,
        rid=rid if isinstance(rid, str) and rid else None,
    )
    if max_tokens is not None:
        too_long = d.too_long_error(prompt_token_count(req), max_tokens, max_model_len)
        if too_long is not None:
            raise RequestError(400, too_long)
    return req


# --------------------------------------------------------------------------- deterministic output


def rng_for(seed: int, prompt: str, model: str) -> random.Random:
    """The PRNG of one generation: sha256 of (seed, model, prompt)."""
    digest = hashlib.sha256(f"{seed}\0{model}\0{prompt}".encode()).digest()
    return random.Random(int.from_bytes(digest, "big"))


def random_word(rng: random.Random) -> str:
    """A short printable token like the tiny model's (``" aq"``, ``"meout"``, ``"fl"``)."""
    word = "".join(rng.choice(_LETTERS) for _ in range(rng.randint(2, 6)))
    return (" " + word) if rng.random() < 0.3 else word


def generate_tokens(seed: int, prompt: str, model: str, n: int) -> list[str]:
    rng = rng_for(seed, prompt, model)
    return [random_word(rng) for _ in range(n)]


def prompt_token_count(req: GenRequest) -> int:
    """A deterministic stand-in for the tokenizer: ~one token per 4 bytes, plus template overhead."""
    base = max(1, (len(req.prompt_text.encode()) + 3) // 4)
    return base + (8 if req.chat_like else 0)


def _tool_arguments(rng: random.Random, params: JSONDict) -> str:
    props = params.get("properties")
    args: JSONDict = {}
    if isinstance(props, dict):
        for name, schema in props.items():
            typ = schema.get("type") if isinstance(schema, dict) else None
            if typ in ("integer", "number"):
                args[name] = rng.randint(0, 99)
            elif typ == "boolean":
                args[name] = rng.random() < 0.5
            else:
                args[name] = random_word(rng).strip()
    return json.dumps(args)


def _fragments(rng: random.Random, text: str) -> list[str]:
    out: list[str] = []
    i = 0
    while i < len(text):
        step = rng.randint(1, 4)
        out.append(text[i : i + step])
        i += step
    return out


@dataclass(frozen=True)
class Output:
    """What one request generates. ``pieces[i]`` is content event ``i + 1``.

    For chat each piece is the ``delta`` object; for completions it is the ``text``. When
    ``separate_finish`` (tool calls) the finish reason goes on an extra ``"delta":{}`` event after
    the pieces; otherwise it goes on the last piece's event.
    """

    pieces: tuple[Any, ...]
    finish_reason: str
    separate_finish: bool
    prompt_tokens: int
    tool_call_id: str | None = None
    tool_name: str | None = None
    tool_arguments: str | None = None

    def text(self, upto: int | None = None) -> str:
        pieces = self.pieces[:upto]
        return "".join(p if isinstance(p, str) else p.get("content") or "" for p in pieces)

    def arguments(self, upto: int | None = None) -> str:
        """The tool call's arguments as far as piece ``upto`` (chat-shaped tool pieces)."""
        return "".join(piece_arguments(p) or "" for p in self.pieces[:upto])


def piece_arguments(piece: Any) -> str | None:
    """The argument fragment a chat-shaped tool piece carries (``None``: not a tool piece, or none)."""
    if not isinstance(piece, dict) or not piece.get("tool_calls"):
        return None
    fragment = piece["tool_calls"][0].get("function", {}).get("arguments")
    return fragment if isinstance(fragment, str) else None


def piece_names_tool(piece: Any) -> bool:
    """Whether a chat-shaped piece opens a tool call (carries its id and name)."""
    return isinstance(piece, dict) and bool(piece.get("tool_calls")) and "id" in piece["tool_calls"][0]


def _padded(text: str, size: int) -> str:
    missing = size - len(text.encode())
    return text + "x" * missing if missing > 0 else text


def with_oversize(output: Output, sizes: dict[int, int]) -> Output:
    """The ``oversize@token:N bytes=S`` fault: content event N's text (a tool piece: its argument fragment)
    padded with ``x`` to at least S bytes, so the one event carrying it is that big. Later events that repeat
    the text (a Responses ``*.done`` event, ``response.completed``) carry it too, as a real engine's would."""
    if not sizes:
        return output
    pieces = list(output.pieces)
    for n, size in sizes.items():
        if not 1 <= n <= len(pieces):
            continue
        piece = pieces[n - 1]
        if isinstance(piece, str):
            pieces[n - 1] = _padded(piece, size)
        elif piece.get("tool_calls"):
            call = dict(piece["tool_calls"][0])
            function = dict(call.get("function", {}))
            function["arguments"] = _padded(function.get("arguments", ""), size)
            call["function"] = function
            pieces[n - 1] = {**piece, "tool_calls": [call]}
        else:
            pieces[n - 1] = {**piece, "content": _padded(piece.get("content") or "", size)}
    arguments = output.tool_arguments
    if output.tool_call_id is not None:
        arguments = "".join(piece_arguments(p) or "" for p in pieces)
    return dataclasses.replace(output, pieces=tuple(pieces), tool_arguments=arguments)


def plan_output(req: GenRequest, server_seed: int) -> Output:
    seed = req.seed if req.seed is not None else server_seed
    prompt_tokens = prompt_token_count(req)
    if req.tool is not None:
        rng = rng_for(seed, req.prompt_text, req.model)
        call_id = f"chatcmpl-tool-{rng.getrandbits(64):016x}"
        arguments = _tool_arguments(rng, req.tool.parameters)
        pieces: list[Any] = [
            {
                "content": None,
                "tool_calls": [
                    {"id": call_id, "type": "function", "index": 0, "function": {"name": req.tool.name}}
                ],
            }
        ]
        pieces += [
            {"content": None, "tool_calls": [{"index": 0, "function": {"arguments": frag}}]}
            for frag in _fragments(rng, arguments)
        ]
        finish = "tool_calls"
        if req.max_tokens is not None and len(pieces) > req.max_tokens:
            pieces, finish = pieces[: req.max_tokens], "length"
        return Output(tuple(pieces), finish, True, prompt_tokens, call_id, req.tool.name, arguments)
    n = req.max_tokens if req.max_tokens is not None else DEFAULT_MAX_TOKENS
    tokens = generate_tokens(seed, req.prompt_text, req.model, n)
    if req.chat_like:
        return Output(tuple({"content": t} for t in tokens), "length", False, prompt_tokens)
    return Output(tuple(tokens), "length", False, prompt_tokens)


# --------------------------------------------------------------------------- streaming events


@dataclass(frozen=True)
class StreamMeta:
    id: str
    created: int
    model: str
    fingerprint: str


class StreamRenderer:
    """Builds each SSE event of one streamed response, byte-exact with vLLM 0.32.

    The server asks a renderer for: the role event, content event N (with a finish reason or not), the
    finish-only event, the usage event and the in-band error sequence; :class:`SglangStreamRenderer`
    answers the same questions in SGLang's bytes.
    """

    def __init__(self, req: GenRequest, output: Output, meta: StreamMeta) -> None:
        self.req = req
        self.output = output
        self.meta = meta
        self.obj = "chat.completion.chunk" if req.kind == "chat" else "text_completion"

    def _head(self) -> JSONDict:
        m = self.meta
        return {"id": m.id, "object": self.obj, "created": m.created, "model": m.model}

    def _running_usage(self, completion_tokens: int) -> JSONDict:
        p = self.output.prompt_tokens
        return {
            "prompt_tokens": p,
            "total_tokens": p + completion_tokens,
            "completion_tokens": completion_tokens,
            "completion_tokens_details": None,
        }

    def _tail(self, ev: JSONDict, completion_tokens: int, finish_reason: str | None) -> JSONDict:
        if self.req.continuous_usage:
            ev["usage"] = self._running_usage(completion_tokens)
        if finish_reason is not None and not self.req.include_usage:
            ev["system_fingerprint"] = self.meta.fingerprint
        return ev

    def role_event(self) -> bytes | None:
        """Chat's role-only first event (``None`` for completions, which have none)."""
        if self.req.kind != "chat":
            return None
        ev = self._head()
        delta = {"role": "assistant", "content": ""}
        ev["choices"] = [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}]
        if self.req.continuous_usage:
            ev["usage"] = self._running_usage(0)
        ev["prompt_token_ids"] = None
        ev["prompt_text"] = None
        return sse(ev)

    def _choice(self, piece: Any, finish_reason: str | None) -> JSONDict:
        if self.req.kind == "chat":
            choice: JSONDict = {"index": 0, "delta": piece, "logprobs": None, "finish_reason": finish_reason}
            if finish_reason is not None:
                choice["stop_reason"] = None
            choice["token_ids"] = None
            return choice
        return {
            "index": 0,
            "text": piece,
            "logprobs": None,
            "finish_reason": finish_reason,
            "stop_reason": None,
            "prompt_token_ids": None,
            "token_ids": None,
        }

    def content_event(self, n: int, finish_reason: str | None = None) -> bytes:
        """Content event ``n`` (1-based). ``finish_reason`` overrides (``"abort"``) or is the natural one."""
        ev = self._head()
        ev["choices"] = [self._choice(self.output.pieces[n - 1], finish_reason)]
        return sse(self._tail(ev, n, finish_reason))

    @property
    def separate_finish(self) -> bool:
        """Whether the finish reason goes on its own event after the pieces (else on the last piece)."""
        return self.output.separate_finish

    def natural_finish(self, n: int) -> str | None:
        """The finish reason content event ``n`` carries in a clean run."""
        if self.separate_finish or n != len(self.output.pieces):
            return None
        return self.output.finish_reason

    def empty_event(self, completion_tokens: int, finish_reason: str) -> bytes:
        """A finish event without content: ``"delta":{}`` (chat) / ``"text":""`` (completions)."""
        ev = self._head()
        ev["choices"] = [self._choice({} if self.req.kind == "chat" else "", finish_reason)]
        return sse(self._tail(ev, completion_tokens, finish_reason))

    def usage_event(self, completion_tokens: int) -> bytes | None:
        if not self.req.include_usage:
            return None
        ev = self._head()
        p = self.output.prompt_tokens
        ev["choices"] = []
        ev["usage"] = {
            "prompt_tokens": p,
            "total_tokens": p + completion_tokens,
            "completion_tokens": completion_tokens,
        }
        ev["system_fingerprint"] = self.meta.fingerprint
        return sse(ev)

    def error_events(self, completion_tokens: int) -> list[bytes]:
        """What the engine writes when it fails mid-stream (status already 200): vLLM's engine-dead event
        and ``[DONE]``, no usage."""
        return [inband_error_event(), DONE_EVENT]


def clean_stream(renderer: StreamRenderer) -> list[bytes]:
    """All events of a fault-free streamed response, in order (for tests and documentation)."""
    events: list[bytes] = []
    role = renderer.role_event()
    if role is not None:
        events.append(role)
    n = len(renderer.output.pieces)
    for i in range(1, n + 1):
        events.append(renderer.content_event(i, renderer.natural_finish(i)))
    if renderer.separate_finish:
        events.append(renderer.empty_event(n, renderer.output.finish_reason))
    usage = renderer.usage_event(n)
    if usage is not None:
        events.append(usage)
    events.append(DONE_EVENT)
    return events


# --------------------------------------------------------------------------- one streamed answer, any API


class ApiStream:
    """What one streamed answer writes at each point of the simulator's flow, for one API in one dialect.

    The server (:meth:`router_testbed.sim.server.Exchange.stream`) asks, in this order: :meth:`opening`
    (right after the status line), :meth:`role` (at the ``role`` point, after the prefill delay),
    :meth:`piece` for content event N (with what precedes it, e.g. a Responses ``output_item.added``; each
    event flagged content or not), :meth:`finish_only` (a finish without a token: an abort), then
    :meth:`closing` (at ``done``: finish/usage, ``*.done``, ``content_block_stop`` + ``message_delta``) and
    :meth:`terminal` (at ``terminal``). :meth:`failure` is the engine's in-band failure. Renderers may keep
    state (sequence numbers, open blocks): they are called once per event, in wire order.
    """

    response_id: str = ""

    def opening(self) -> list[bytes]:
        return []

    def role(self) -> list[bytes]:
        return []

    def natural_finish(self, n: int) -> str | None:
        """The finish reason content event ``n`` carries in a clean run (only chat puts it there)."""
        return None

    def piece(self, n: int, finish: str | None) -> list[tuple[bytes, bool]]:
        raise NotImplementedError

    def finish_only(self, produced: int, reason: str) -> list[bytes]:
        return []

    def closing(self, produced: int, finish: str, finish_sent: bool) -> list[bytes]:
        return []

    def terminal(self, produced: int, finish: str) -> list[bytes]:
        raise NotImplementedError

    def failure(self, produced: int) -> tuple[list[bytes], bool]:
        """The events of an in-band engine failure, and whether the chunked body then ends cleanly (else
        the connection is closed without its last chunk)."""
        raise NotImplementedError


class ChatStream(ApiStream):
    """Chat completions and completions (both dialects) over a :class:`StreamRenderer`."""

    def __init__(self, renderer: StreamRenderer) -> None:
        self.renderer = renderer
        self.output = renderer.output
        self.response_id = renderer.meta.id

    def role(self) -> list[bytes]:
        role = self.renderer.role_event()
        return [] if role is None else [role]

    def natural_finish(self, n: int) -> str | None:
        return self.renderer.natural_finish(n)

    def piece(self, n: int, finish: str | None) -> list[tuple[bytes, bool]]:
        return [(self.renderer.content_event(n, finish), True)]

    def finish_only(self, produced: int, reason: str) -> list[bytes]:
        return [self.renderer.empty_event(produced, reason)]

    def closing(self, produced: int, finish: str, finish_sent: bool) -> list[bytes]:
        events = [] if finish_sent else [self.renderer.empty_event(produced, finish)]
        usage = self.renderer.usage_event(produced)
        return events if usage is None else [*events, usage]

    def terminal(self, produced: int, finish: str) -> list[bytes]:
        return [DONE_EVENT]

    def failure(self, produced: int) -> tuple[list[bytes], bool]:
        return self.renderer.error_events(produced), True


def api_clean_stream(stream: ApiStream, *, carries_finish: bool = True) -> list[bytes]:
    """All events of a fault-free streamed answer of any API, in order (for tests and documentation)."""
    output: Output = stream.output  # type: ignore[attr-defined]
    events = [*stream.opening(), *stream.role()]
    n = len(output.pieces)
    finish_sent = False
    for i in range(1, n + 1):
        natural = stream.natural_finish(i) if carries_finish else None
        events += [event for event, _ in stream.piece(i, natural)]
        finish_sent = finish_sent or natural is not None
    events += stream.closing(n, output.finish_reason, finish_sent)
    events += stream.terminal(n, output.finish_reason)
    return events


# --------------------------------------------------------------------------- non-streamed bodies


def _usage_full(prompt_tokens: int, completion_tokens: int) -> JSONDict:
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
        "prompt_tokens_details": None,
        "completion_tokens_details": None,
    }


def response_body(
    req: GenRequest, output: Output, meta: StreamMeta, completion_tokens: int, finish_reason: str
) -> bytes:
    """The non-streamed JSON body (chat.json / completions.json shape) after ``completion_tokens``."""
    text = output.text(completion_tokens)
    if req.kind == "chat":
        message: JSONDict = {
            "role": "assistant",
            "content": text,
            "refusal": None,
            "annotations": None,
            "audio": None,
            "function_call": None,
        }
        if output.tool_call_id is not None:
            args = "".join(
                p["tool_calls"][0]["function"].get("arguments", "") for p in output.pieces[:completion_tokens]
            )
            message["content"] = ""
            message["tool_calls"] = [
                {
                    "id": output.tool_call_id,
                    "type": "function",
                    "function": {"name": output.tool_name, "arguments": args},
                }
            ]
        message["reasoning"] = None
        choice: JSONDict = {
            "index": 0,
            "message": message,
            "logprobs": None,
            "finish_reason": finish_reason,
            "stop_reason": None,
            "token_ids": None,
            "routed_experts": None,
        }
        body: JSONDict = {"id": meta.id, "object": "chat.completion", "created": meta.created}
        body["model"] = meta.model
        body["choices"] = [choice]
        body["service_tier"] = None
        body["system_fingerprint"] = meta.fingerprint
        body["usage"] = _usage_full(output.prompt_tokens, completion_tokens)
        body["prompt_logprobs"] = None
        body["prompt_token_ids"] = None
        body["prompt_text"] = None
    else:
        choice = {
            "index": 0,
            "text": text,
            "logprobs": None,
            "finish_reason": finish_reason,
            "stop_reason": None,
            "token_ids": None,
            "prompt_logprobs": None,
            "prompt_token_ids": None,
            "routed_experts": None,
        }
        body = {"id": meta.id, "object": "text_completion", "created": meta.created, "model": meta.model}
        body["choices"] = [choice]
        body["service_tier"] = None
        body["system_fingerprint"] = meta.fingerprint
        body["usage"] = _usage_full(output.prompt_tokens, completion_tokens)
    body["kv_transfer_params"] = None
    body["ec_transfer_params"] = None
    body["metrics"] = None
    return dumps(body).encode()


# --------------------------------------------------------------------------- other endpoints


def models_body(model: str, created: int, max_model_len: int) -> bytes:
    return dumps(
        {
            "object": "list",
            "data": [
                {
                    "id": model,
                    "object": "model",
                    "created": created,
                    "owned_by": "vllm",
                    "root": model,
                    "parent": None,
                    "max_model_len": max_model_len,
                    "permission": [
                        {
                            "id": f"modelperm-{secrets.token_hex(16)}",
                            "object": "model_permission",
                            "created": created,
                            "allow_create_engine": False,
                            "allow_sampling": True,
                            "allow_logprobs": True,
                            "allow_search_indices": False,
                            "allow_view": True,
                            "allow_fine_tuning": False,
                            "organization": "*",
                            "group": None,
                            "is_blocking": False,
                        }
                    ],
                }
            ],
        }
    ).encode()


def version_body() -> bytes:
    return dumps({"version": VLLM_VERSION}).encode()


# --------------------------------------------------------------------------- SGLang 0.5.23 formats

SGLANG_TIMEOUT_MESSAGE = "Request running timeout reached."
_SGLANG_CONTEXT_MESSAGE = (
    "Requested token count exceeds the model's maximum context length of {limit} tokens. You requested a "
    "total of {total} tokens: {prompt} tokens from the input messages and {max_tokens} tokens for the "
    "completion. Please reduce the number of tokens in the input messages or the completion to fit within "
    "the limit."
)


def sglang_context_message(limit: int, prompt_tokens: int, max_tokens: int) -> str:
    return _SGLANG_CONTEXT_MESSAGE.format(
        limit=limit, total=prompt_tokens + max_tokens, prompt=prompt_tokens, max_tokens=max_tokens
    )


def sglang_error_body(message: str, type_: str, code: int) -> bytes:
    """SGLang's HTTP error body: a top-level error object (no ``error`` wrapper), ``param`` always null."""
    return dumps({"object": "error", "message": message, "type": type_, "param": None, "code": code}).encode()


def sglang_inband_error_event() -> bytes:
    """SGLang's mid-stream error (request running timeout): spaced ``json.dumps`` like vLLM's, but a
    different object (``object``, a string ``type``, code 503)."""
    payload = {
        "error": {
            "object": "error",
            "message": SGLANG_TIMEOUT_MESSAGE,
            "type": "SERVICE_UNAVAILABLE",
            "param": None,
            "code": 503,
        }
    }
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


def sglang_id() -> str:
    return secrets.token_hex(16)


def _sglang_usage(kind: Kind, prompt_tokens: int, completion_tokens: int) -> JSONDict:
    usage: JSONDict = {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
    }
    if kind == "chat":  # chat's usage carries the two details keys, completions' does not
        usage["prompt_tokens_details"] = None
        usage["reasoning_tokens"] = 0
        usage["completion_tokens_details"] = None
    else:
        usage["reasoning_tokens"] = 0
    return usage


def _sglang_delta(piece: JSONDict) -> JSONDict:
    """A chat delta as SGLang writes it: ``reasoning_content`` first, null values other than it dropped."""
    return {"reasoning_content": None, **{k: v for k, v in piece.items() if v is not None}}


class SglangStreamRenderer(StreamRenderer):
    """SGLang 0.5.23's streamed events: chat has a role event and a finish-only event; completions have
    neither, carry ``"usage":null`` on every event and the finish on the last text event; no fingerprint."""

    def role_event(self) -> bytes | None:
        if self.req.kind != "chat":
            return None
        ev = self._head()
        delta = {"reasoning_content": None, "role": "assistant", "content": ""}
        ev["choices"] = [
            {"index": 0, "delta": delta, "logprobs": None, "finish_reason": None, "matched_stop": None}
        ]
        return sse(ev)

    @property
    def separate_finish(self) -> bool:
        return self.req.kind == "chat" or self.output.separate_finish

    def _choice(self, piece: Any, finish_reason: str | None) -> JSONDict:
        if self.req.kind == "chat":
            return {
                "index": 0,
                "delta": _sglang_delta(piece),
                "logprobs": None,
                "finish_reason": finish_reason,
                "matched_stop": None,
            }
        return {
            "index": 0,
            "text": piece,
            "logprobs": None,
            "finish_reason": finish_reason,
            "matched_stop": None,
        }

    def _tail(self, ev: JSONDict, completion_tokens: int, finish_reason: str | None) -> JSONDict:
        if self.req.kind != "chat":
            ev["usage"] = None
        return ev

    def usage_event(self, completion_tokens: int) -> bytes | None:
        if not self.req.include_usage:
            return None
        ev = self._head()
        ev["choices"] = []
        ev["usage"] = _sglang_usage(self.req.kind, self.output.prompt_tokens, completion_tokens)
        return sse(ev)

    def error_events(self, completion_tokens: int) -> list[bytes]:
        """The error event, then the usage event if asked for, then ``[DONE]``: a stream that ends with
        ``[DONE]`` and is still an interruption (no finish event)."""
        usage = self.usage_event(completion_tokens)
        return [sglang_inband_error_event(), *([usage] if usage is not None else []), DONE_EVENT]


def sglang_response_body(
    req: GenRequest, output: Output, meta: StreamMeta, completion_tokens: int, finish_reason: str
) -> bytes:
    """SGLang's non-streamed body (chat_nonstream.txt; completions by analogy, not recorded)."""
    choice: JSONDict = {"index": 0}
    if req.kind == "chat":
        message: JSONDict = {"role": "assistant", "content": output.text(completion_tokens)}
        message["reasoning_content"] = None
        if output.tool_call_id is not None:
            args = "".join(
                p["tool_calls"][0]["function"].get("arguments", "") for p in output.pieces[:completion_tokens]
            )
            message["content"] = None
            message["tool_calls"] = [
                {
                    "id": output.tool_call_id,
                    "index": 0,
                    "type": "function",
                    "function": {"name": output.tool_name, "arguments": args},
                }
            ]
        choice["message"] = message
        obj = "chat.completion"
    else:
        choice["text"] = output.text(completion_tokens)
        obj = "text_completion"
    choice.update(logprobs=None, finish_reason=finish_reason, matched_stop=None)
    body: JSONDict = {"id": meta.id, "object": obj, "created": meta.created, "model": meta.model}
    body["choices"] = [choice]
    body["usage"] = _sglang_usage(req.kind, output.prompt_tokens, completion_tokens)
    body["metadata"] = {
        "weight_version": "default",
        "weight_versions": [{"version": "default", "start": 0, "end": completion_tokens}],
    }
    return dumps(body).encode()


def sglang_models_body(model: str, created: int, max_model_len: int) -> bytes:
    item = {
        "id": model,
        "object": "model",
        "created": created,
        "owned_by": "sglang",
        "root": model,
        "parent": None,
        "max_model_len": max_model_len,
    }
    return dumps({"object": "list", "data": [item]}).encode()


# SGLang's batch sizes for its (here disabled) graph capture, as /get_model_info lists them.
_SGLANG_CAPTURE_BATCH_SIZES = [
    *range(4, 33, 4),
    *range(48, 257, 16),
    *range(288, 513, 32),
    *range(576, 1025, 64),
    *range(1280, 4097, 256),
]


def sglang_server_info_body(model: str) -> bytes:
    """``GET /get_server_info``: the fields of it the replica agent reads (not in the recorded transcripts;
    the real server's answer carries these among its server arguments, values as the CPU launch sets them)."""
    info: JSONDict = {
        "model_path": model,
        "version": "0.5.23",
        "weight_version": "default",
        "revision": None,
        "quantization": None,
        "attention_backend": "torch_native",
        "prefill_attention_backend": None,
        "decode_attention_backend": None,
        "kv_cache_dtype": "auto",
        "page_size": 1,
        "tp_size": 1,
        "pp_size": 1,
        "dp_size": 1,
    }
    return json.dumps(info).encode()


def sglang_model_info_body(model: str) -> bytes:
    """``GET /get_model_info`` of a plain Llama generation model (get_model_info.txt)."""
    embedding: JSONDict = {
        "family": "none",
        "task": "none",
        "execution": "none",
        "attention": "none",
        "pooling": "model_defined",
        "normalize": False,
        "postprocessor": "none",
        "tokenizer_special_tokens": "model_default",
        "supports_dimensions": False,
        "supports_token_embeddings": False,
        "supports_multimodal": False,
        "requires_embedding_flag": False,
        "auto_enable_embedding": False,
        "bcg_eligibility": "disabled",
        "safe_disable_kv_cache": False,
        "safe_disable_radix_cache": False,
        "safe_disable_chunked_prefill": False,
        "enabled": False,
        "matryoshka_dimensions": [],
        "bcg": {
            "prefill_backend": "disabled",
            "enabled": False,
            "capture_token_budget": 4096,
            "capture_batch_sizes": _SGLANG_CAPTURE_BATCH_SIZES,
        },
        "cache": {
            "kv_cache_disabled": False,
            "radix_cache_disabled": False,
            "chunked_prefill_disabled": False,
        },
    }
    info: JSONDict = {
        "model_path": model,
        "served_model_name": model,
        "tokenizer_path": model,
        "is_generation": True,
        "preferred_sampling_params": None,
        "weight_version": "default",
        "load_format": "auto",
        "reasoning_parser": None,
        "tool_call_parser": None,
        "disaggregation_mode": "null",
        "has_image_understanding": False,
        "has_audio_understanding": False,
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "embedding": embedding,
    }
    return dumps(info).encode()


# --------------------------------------------------------------------------- dialects


@dataclass(frozen=True)
class InfoReply:
    """A ``GET`` endpoint's 200 answer: ``content_type`` ``None`` is an empty body without one."""

    body: bytes
    content_type: str | None = "application/json"


class Dialect:
    """One engine's OpenAI server on the wire: ids, error replies, streamed events, bodies, endpoints.

    The simulator's flow is the same for every dialect and asks this object whatever differs, so adding an
    engine is one subclass. This base class is vLLM 0.32.
    """

    name = "vllm"
    # Whether an abort fault's finish event carries the token it interrupts (vLLM) or is finish-only.
    abort_carries_token = True
    # Whether ``stream_options.continuous_usage_stats`` puts running usage on every event.
    continuous_usage = True
    # The chunked-encoding header's spelling (SGLang's uvicorn/starlette writes it capitalised).
    transfer_encoding_header = "transfer-encoding"
    info_paths: frozenset[str] = frozenset({"/health", "/version", "/v1/models"})
    # Whether POST /v1/responses is served (SGLang 0.5.23 disables it for non-Harmony models).
    serves_responses = True

    def new_id(self, req: GenRequest) -> str:
        if req.kind == "responses":
            from router_testbed.sim import responses

            return req.params.body_request_id or responses.new_id("resp")
        if req.kind == "messages":
            from router_testbed.sim import messages

            return messages.new_id(req, sglang=self.name == "sglang")
        return chat_id() if req.kind == "chat" else completion_id()

    def error_body(self, message: str, type_: str, param: str | None, code: int) -> bytes:
        return error_body(message, type_, param, code)

    def bad_request_error(self, message: str, param: str | None = None) -> bytes:
        return self.error_body(message, "BadRequestError", param, 400)

    def bad_json_error(self, exc: json.JSONDecodeError) -> bytes:
        return bad_json_error(exc)

    def responses_bad_json_error(self, exc: json.JSONDecodeError) -> bytes:
        return bad_json_error(exc)

    def missing_field_error(self, field: str, body: dict[str, Any]) -> bytes:
        return missing_field_error(field, body)

    def wrong_model_error(self, requested: str, served: str) -> bytes:
        return wrong_model_error(requested, served)

    def too_long_error(self, prompt_tokens: int, max_tokens: int, max_model_len: int) -> bytes | None:
        """The refusal of a request that cannot fit, or ``None``. vLLM compares max_tokens alone."""
        return too_long_error(max_tokens, max_model_len) if max_tokens > max_model_len else None

    def unavailable_error(self) -> bytes:
        """The body of the ``status503`` fault."""
        return unavailable_error()

    def too_many_requests_error(self) -> bytes:
        """The body of the ``status429`` fault."""
        return too_many_requests_error()

    def failed_reply(self) -> tuple[int, bytes]:
        """The ``error`` fault when no stream is open (a non-stream request, or before the status line)."""
        return 500, engine_dead_error()

    def renderer(self, req: GenRequest, output: Output, meta: StreamMeta) -> StreamRenderer:
        return StreamRenderer(req, output, meta)

    def stream(self, req: GenRequest, output: Output, meta: StreamMeta) -> ApiStream:
        """The streamed answer of any API."""
        if req.kind == "responses":
            from router_testbed.sim import responses

            return responses.ResponsesStream(req, output, meta)
        if req.kind == "messages":
            from router_testbed.sim import messages

            return messages.stream_for(req, output, meta, sglang=self.name == "sglang")
        return ChatStream(self.renderer(req, output, meta))

    def response_body(
        self, req: GenRequest, output: Output, meta: StreamMeta, completion_tokens: int, finish_reason: str
    ) -> bytes:
        if req.kind == "responses":
            from router_testbed.sim import responses

            return dumps(
                responses.response_body(req, output, meta, completion_tokens, finish_reason)
            ).encode()
        if req.kind == "messages":
            from router_testbed.sim import messages

            body = messages.response_body(
                req, output, meta, completion_tokens, finish_reason, sglang=self.name == "sglang"
            )
            return dumps(body).encode()
        return self._chat_body(req, output, meta, completion_tokens, finish_reason)

    def _chat_body(
        self, req: GenRequest, output: Output, meta: StreamMeta, completion_tokens: int, finish_reason: str
    ) -> bytes:
        return response_body(req, output, meta, completion_tokens, finish_reason)

    def api_error(self, req_kind: Kind, which: str) -> tuple[int, bytes]:
        """A fault's error reply in the API's own shape: ``which`` is ``unavailable`` (status503),
        ``too_many`` (status429) or ``failed`` (the ``error`` fault before the stream / without one)."""
        if req_kind == "messages":
            from router_testbed.sim import messages

            sglang = self.name == "sglang"
            if which == "unavailable":
                return 503, messages.unavailable_error(sglang)
            if which == "too_many":
                return 429, messages.too_many_requests_error(sglang)
            return messages.failed_reply(sglang)
        if which == "unavailable":
            return 503, self.unavailable_error()
        if which == "too_many":
            return 429, self.too_many_requests_error()
        return self.failed_reply()

    def info_reply(self, path: str, model: str, created: int, max_model_len: int) -> InfoReply:
        """The answer to ``GET path`` for a path in :attr:`info_paths`."""
        if path == "/version":
            return InfoReply(version_body())
        if path == "/v1/models":
            return InfoReply(models_body(model, created, max_model_len))
        return InfoReply(b"", None)


class SglangDialect(Dialect):
    """SGLang 0.5.23 (reference/sglang-0.5.23-cpu). Not recorded there, and so inferred from what is: the
    bodies of bad JSON, an unknown model and the ``status503`` fault (SGLang's top-level shape), non-stream
    completions (chat's shape with completions' usage), tool-call deltas, and ``continuous_usage_stats``
    (ignored: usage only at the end)."""

    name = "sglang"
    abort_carries_token = False  # /abort_request ends with a finish-only event (abort_request_midstream.txt)
    continuous_usage = False
    transfer_encoding_header = "Transfer-Encoding"
    info_paths = frozenset(
        {"/health", "/health_generate", "/v1/models", "/get_model_info", "/get_server_info"}
    )

    serves_responses = False  # OpenAIServingResponses fails to initialise without openai_harmony

    def new_id(self, req: GenRequest) -> str:
        if req.kind in ("responses", "messages"):
            return super().new_id(req)
        # The body's rid is the id; x-request-id is never used.
        return req.rid if req.rid is not None else sglang_id()

    def error_body(self, message: str, type_: str, param: str | None, code: int) -> bytes:
        return sglang_error_body(message, type_, code)

    def bad_json_error(self, exc: json.JSONDecodeError) -> bytes:
        detail = f"[{{'type': 'json_invalid', 'loc': ('body', {exc.pos}), 'msg': 'JSON decode error'}}]"
        return sglang_error_body(detail, "Bad Request", 400)

    def responses_bad_json_error(self, exc: json.JSONDecodeError) -> bytes:
        """/v1/responses's own handler (sgl_resp_bad_json): the OpenAI nesting, str(exc) and the errors
        list (the decoder's message is orjson's there, Python's here)."""
        error = (
            f"{{'type': 'json_invalid', 'loc': ('body', {exc.pos}), 'msg': 'JSON decode error', "
            f"'input': {{}}, 'ctx': {{'error': {exc.msg!r}}}}}"
        )
        message = (
            f'1 validation error:\n  {error}\n\n  File "sglang/srt/entrypoints/http_server.py", line 2066, '
            f"in v1_responses_request\n    POST /v1/responses [{error}]"
        )
        body = {"error": {"message": message, "type": "Bad Request", "param": None, "code": 400}}
        return dumps(body).encode()

    def missing_field_error(self, field: str, body: dict[str, Any]) -> bytes:
        return sglang_error_body(f"{field}: Field required", "Bad Request", 400)

    def wrong_model_error(self, requested: str, served: str) -> bytes:
        return sglang_error_body(f"The model `{requested}` does not exist.", "NotFoundError", 404)

    def too_long_error(self, prompt_tokens: int, max_tokens: int, max_model_len: int) -> bytes | None:
        """SGLang refuses prompt + max_tokens beyond the context length (chat_stream_badreq.txt)."""
        total = prompt_tokens + max_tokens
        if total <= max_model_len:
            return None
        message = _SGLANG_CONTEXT_MESSAGE.format(
            limit=max_model_len, total=total, prompt=prompt_tokens, max_tokens=max_tokens
        )
        return sglang_error_body(message, "BadRequestError", 400)

    def unavailable_error(self) -> bytes:
        return sglang_error_body("Service Unavailable", "503", 503)

    def too_many_requests_error(self) -> bytes:
        return sglang_error_body("Too Many Requests", "429", 429)

    def failed_reply(self) -> tuple[int, bytes]:
        # inband_error_running_timeout_nonstream.txt: the same timeout as an HTTP 503, type "503".
        return 503, sglang_error_body(SGLANG_TIMEOUT_MESSAGE, "503", 503)

    def renderer(self, req: GenRequest, output: Output, meta: StreamMeta) -> StreamRenderer:
        return SglangStreamRenderer(req, output, meta)

    def _chat_body(
        self, req: GenRequest, output: Output, meta: StreamMeta, completion_tokens: int, finish_reason: str
    ) -> bytes:
        return sglang_response_body(req, output, meta, completion_tokens, finish_reason)

    def info_reply(self, path: str, model: str, created: int, max_model_len: int) -> InfoReply:
        if path == "/v1/models":
            return InfoReply(sglang_models_body(model, created, max_model_len))
        if path == "/get_model_info":
            return InfoReply(sglang_model_info_body(model))
        if path == "/get_server_info":
            return InfoReply(sglang_server_info_body(model))
        return InfoReply(b"", None)  # /health, /health_generate: 200, empty body


VLLM = Dialect()
SGLANG = SglangDialect()
DIALECTS: dict[str, Dialect] = {d.name: d for d in (VLLM, SGLANG)}
