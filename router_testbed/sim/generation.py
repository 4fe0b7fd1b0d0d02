"""Deterministic output and the exact vLLM 0.32 byte formats (pure; no I/O).

Everything here mirrors the transcripts in ``reference/vllm-0.32-cpu/``: key names, key order,
compact JSON, where ``finish_reason``/``stop_reason``/``token_ids``/``usage``/``system_fingerprint``
appear, and the one in-band error event that vLLM writes with ``json.dumps`` default spacing.

One generated token is one content event (the simulator never coalesces tokens), so counting
content events equals counting tokens for a simulated replica.
"""

from __future__ import annotations

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

Kind = Literal["chat", "completion"]
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


def unavailable_error() -> bytes:
    return error_body("Service Unavailable", "ServiceUnavailableError", None, 503)


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
    """A request vLLM would refuse before streaming: ``status`` + JSON ``body``."""

    def __init__(self, status: int, body: bytes) -> None:
        super().__init__(body.decode(errors="replace"))
        self.status = status
        self.body = body


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


def _message_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return ""


def _select_tool(body: JSONDict) -> ToolSpec | None:
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
            raise RequestError(400, bad_request_error(f"Tool '{name}' has not been passed in `tools`.", None))
        chosen = matches[0]
    else:
        return None
    params = chosen.get("parameters")
    return ToolSpec(name=chosen["name"], parameters=params if isinstance(params, dict) else {})


def parse_request(
    kind: Kind, raw: bytes, *, served_model: str, max_model_len: int = DEFAULT_MAX_MODEL_LEN
) -> GenRequest:
    """Validate a request body like vLLM does; raises :class:`RequestError` with vLLM's error reply."""
    try:
        body = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise RequestError(400, bad_json_error(exc)) from None
    except UnicodeDecodeError:
        raise RequestError(400, bad_request_error("request body is not UTF-8")) from None
    if not isinstance(body, dict):
        raise RequestError(400, bad_request_error("request body must be a JSON object"))
    model = body.get("model", served_model)
    if model != served_model:
        raise RequestError(404, wrong_model_error(str(model), served_model))
    max_tokens = body.get("max_tokens", body.get("max_completion_tokens"))
    if max_tokens is not None:
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            raise RequestError(400, bad_request_error("max_tokens must be at least 1", "max_tokens"))
        if max_tokens > max_model_len:
            raise RequestError(400, too_long_error(max_tokens, max_model_len))
    opts = body.get("stream_options") or {}
    include_usage = bool(isinstance(opts, dict) and opts.get("include_usage"))
    continuous = include_usage and bool(opts.get("continuous_usage_stats"))
    seed = body.get("seed")
    if kind == "chat":
        messages = body.get("messages")
        if not isinstance(messages, list):
            raise RequestError(400, bad_request_error("Field required: messages", "messages"))
        prompt = "\n".join(
            f"{m.get('role', '')}: {_message_text(m.get('content'))}" for m in messages if isinstance(m, dict)
        )
        tool = _select_tool(body)
    else:
        raw_prompt = body.get("prompt")
        if isinstance(raw_prompt, list):
            prompt = "".join(str(p) for p in raw_prompt)
        elif isinstance(raw_prompt, str):
            prompt = raw_prompt
        else:
            raise RequestError(400, bad_request_error("Field required: prompt", "prompt"))
        tool = None
    return GenRequest(
        kind=kind,
        model=served_model,
        prompt_text=prompt,
        max_tokens=max_tokens,
        stream=bool(body.get("stream", False)),
        include_usage=include_usage,
        continuous_usage=continuous,
        seed=seed if isinstance(seed, int) and not isinstance(seed, bool) else None,
        tool=tool,
    )


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
    return base + (8 if req.kind == "chat" else 0)


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
    if req.kind == "chat":
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
    """Builds each SSE event of one streamed response, byte-exact with vLLM 0.32."""

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

    def natural_finish(self, n: int) -> str | None:
        """The finish reason content event ``n`` carries in a clean run."""
        if self.output.separate_finish or n != len(self.output.pieces):
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


def clean_stream(renderer: StreamRenderer) -> list[bytes]:
    """All events of a fault-free streamed response, in order (for tests and documentation)."""
    events: list[bytes] = []
    role = renderer.role_event()
    if role is not None:
        events.append(role)
    n = len(renderer.output.pieces)
    for i in range(1, n + 1):
        events.append(renderer.content_event(i, renderer.natural_finish(i)))
    if renderer.output.separate_finish:
        events.append(renderer.empty_event(n, renderer.output.finish_reason))
    usage = renderer.usage_event(n)
    if usage is not None:
        events.append(usage)
    events.append(DONE_EVENT)
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
