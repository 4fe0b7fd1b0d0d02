"""Parsing and validation of inference requests at the edge (sans-IO, once per request): OpenAI's chat
completions, completions and Responses APIs, and Anthropic's Messages API, as vLLM and SGLang serve them.

The gateway checks only what it needs for its own decisions (routing, first-delta accounting,
the re-prefill cost cap, replay); everything else is the engine's business and passes through.
A :class:`RequestRejected` is answered by the gateway before any attempt starts.
"""

from __future__ import annotations

import enum
import hashlib
import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NoReturn

from router_sidecar.core import bounded_json

__all__ = [
    "ParsedRequest",
    "RequestRejected",
    "RouteKind",
    "estimate_prompt_tokens",
    "parse_request",
]


class RouteKind(enum.Enum):
    CHAT = "chat.completions"
    COMPLETIONS = "completions"
    RESPONSES = "responses"  # OpenAI's Responses API
    MESSAGES = "messages"  # Anthropic's Messages API


@dataclass(frozen=True, slots=True)
class ParsedRequest:
    kind: RouteKind
    model: str
    stream: bool
    include_usage: bool  # stream_options.include_usage
    # stream_options.continuous_usage_stats (vLLM): running usage on every event. vLLM honours it
    # only together with include_usage, so it is false without it.
    continuous_usage: bool
    seed: int | None
    max_tokens: int | None  # max_tokens, else max_completion_tokens (chat)
    has_tools: bool
    estimated_prompt_tokens: int  # see estimate_prompt_tokens
    input_digest: str  # "sha256:<hex>" of the raw body bytes (for replay)
    # Why the request refers to state that lives on one replica (a Responses `previous_response_id`,
    # `background`): it may not be re-run on another replica. None: any compatible replica may serve it.
    stateful: str | None = None
    # Responses: the stored response it continues (served only by the replica holding it), and whether its
    # own response is to be stored (`store`, true unless the client says false) where it is made.
    previous_response_id: str | None = None
    stores_response: bool = False
    # Chained hashes of the prompt's blocks: where it is warm (core/placement.py).
    prefix_blocks: tuple[int, ...] = ()


# Request ids, idempotency keys and stored response ids: what may appear in an etcd key segment and a header.
_KEY = re.compile(r"[A-Za-z0-9._:~-]{1,200}")


def valid_key(value: str) -> bool:
    """A request id, idempotency key or response id the gateway accepts: 1-200 of A-Z a-z 0-9 . _ : ~ -"""
    return _KEY.fullmatch(value) is not None


# vLLM answers with exception class names in "type"; the gateway does the same.
_ERROR_TYPES = {400: "BadRequestError", 404: "NotFoundError", 413: "RequestTooLargeError"}


class RequestRejected(Exception):
    """The HTTP answer the gateway sends before any attempt: a client error, never retried."""

    def __init__(self, status: int, code: str, message: str, param: str | None = None) -> None:
        super().__init__(f"{status} {code}: {message}")
        self.status = status
        self.code = code
        self.message = message
        self.param = param

    def __reduce__(self) -> tuple[Any, ...]:
        # Raised in the parsing worker process too: it must survive pickling with its fields.
        return (RequestRejected, (self.status, self.code, self.message, self.param))

    def body(self, request_id: str) -> bytes:
        """Same shape as vLLM/OpenAI errors, plus the request id the journal knows it by."""
        err = {
            "message": self.message,
            "type": _ERROR_TYPES.get(self.status, "BadRequestError"),
            "param": self.param,
            "code": self.code,
            "request_id": request_id,
        }
        return json.dumps({"error": err}).encode("utf-8")


def _reject(status: int, code: str, message: str, param: str | None = None) -> NoReturn:
    raise RequestRejected(status, code, message, param)


def _opt_int(v: Any) -> int | None:
    # Informational fields (seed, max_tokens): the engine validates them; we only record ints.
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def _utf8_len(s: str) -> int:
    return len(s.encode("utf-8", "surrogatepass"))


def estimate_prompt_tokens(kind: RouteKind, req: dict[str, Any]) -> int:
    """A deliberately cheap, upper-ish estimate of the prompt's token count.

    ceil(UTF-8 bytes of all prompt text / 4): message contents (strings or ``text`` parts),
    assistant tool-call arguments, the tool definitions' JSON, or the completions prompt(s).
    About 4 bytes per token holds for English with a BPE vocabulary; it over-estimates for code
    and under-estimates for CJK. Prompts given as token ids count one token per id. Non-text parts
    (images, audio) are not counted. The estimate is used only to decide whether a re-prefill
    is allowed (``reprefill_cost_cap``), never for billing or admission.
    """
    text_bytes = 0
    token_ids = 0
    if kind is RouteKind.RESPONSES:
        text_bytes += _text_bytes(req.get("input")) + _text_bytes(req.get("instructions"))
    elif kind is RouteKind.MESSAGES:
        text_bytes += _text_bytes(req.get("messages")) + _text_bytes(req.get("system"))
    elif kind is RouteKind.CHAT:
        messages = req.get("messages")
        for msg in messages if isinstance(messages, list) else ():
            if not isinstance(msg, dict):
                continue
            content = msg.get("content")
            if isinstance(content, str):
                text_bytes += _utf8_len(content)
            elif isinstance(content, list):
                for part in content:
                    if isinstance(part, dict) and isinstance(part.get("text"), str):
                        text_bytes += _utf8_len(part["text"])
            calls = msg.get("tool_calls")
            for call in calls if isinstance(calls, list) else ():
                fn = call.get("function") if isinstance(call, dict) else None
                if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
                    text_bytes += _utf8_len(fn["arguments"])
    else:
        prompt = req.get("prompt")
        prompts = prompt if isinstance(prompt, list) and prompt and not _is_token_ids(prompt) else [prompt]
        for p in prompts:
            if isinstance(p, str):
                text_bytes += _utf8_len(p)
            elif isinstance(p, list):
                token_ids += len(p)
    for key in ("tools", "functions"):
        defs = req.get(key)
        if defs:
            text_bytes += _utf8_len(json.dumps(defs, ensure_ascii=False, separators=(",", ":")))
    return math.ceil(text_bytes / 4) + token_ids


def _text_bytes(v: Any, depth: int = 0) -> int:
    """UTF-8 bytes of the text in a Responses `input` or a Messages `messages`/`system`: strings, and the
    `text`/`content`/`input`/`arguments` of their items and content blocks."""
    if isinstance(v, str):
        return _utf8_len(v)
    if depth > 6:
        return 0  # item → content → block: deeper is not prompt text
    if isinstance(v, list):
        return sum(_text_bytes(x, depth + 1) for x in v)
    if isinstance(v, dict):
        return sum(_text_bytes(v.get(k), depth + 1) for k in ("text", "content", "arguments", "output"))
    return 0


def _is_token_ids(v: list[Any]) -> bool:
    return all(isinstance(x, int) and not isinstance(x, bool) for x in v)


def _prompt_count(prompt: Any) -> int:
    """How many prompts a completions request carries (each streams its own choice)."""
    if isinstance(prompt, list) and prompt and not _is_token_ids(prompt):
        return len(prompt)
    return 1


# Parts of a request body that make up its prompt, in the order the engines' templates put them first.
_PROMPT_KEYS: dict[str, tuple[str, ...]] = {
    "chat.completions": ("tools", "functions", "messages"),
    "completions": ("prompt",),
    "responses": ("tools", "instructions", "input"),
    "messages": ("tools", "system", "messages"),
}


def prompt_blocks(
    route: str, request: Mapping[str, Any], *, block_bytes: int, max_blocks: int
) -> tuple[int, ...]:
    """Chained hashes of the prompt's whole `block_bytes` blocks (its first `max_blocks`). The text is the
    model and the prompt's parts, each list item on a line of its own, so a conversation that grows by turns
    keeps its earlier blocks; a trailing part-block is left out (it changes as the prompt grows)."""
    wanted = block_bytes * max_blocks  # what is hashed at most: the rest of a long prompt is not serialized
    parts: list[bytes] = [_canonical(request.get("model", ""))]
    size = len(parts[0])
    for key in _PROMPT_KEYS.get(route, ()):
        value = request.get(key)
        if value is None or size >= wanted:
            continue
        parts.append(key.encode())
        for item in value if isinstance(value, list) and key != "prompt" else [value]:
            parts.append(_canonical(item))
            size += len(parts[-1]) + 1
            if size >= wanted:
                break
    text = b"\n".join(parts)
    count = min(len(text) // block_bytes, max_blocks)
    blocks: list[int] = []
    previous = b""
    for i in range(count):
        digest = hashlib.blake2b(
            previous + text[i * block_bytes : (i + 1) * block_bytes], digest_size=8
        ).digest()
        blocks.append(int.from_bytes(digest))
        previous = digest
    return tuple(blocks)


def with_model(body: bytes, model: str) -> bytes:
    """The request body with `model` naming another model (a fallback's), everything else as it was sent.
    The body was parsed at admission, so it is a JSON object; keys keep their order."""
    request = json.loads(body)
    request["model"] = model
    return json.dumps(request, ensure_ascii=False, separators=(",", ":")).encode("utf-8", "surrogatepass")


def _canonical(value: Any) -> bytes:
    # surrogatepass: JSON may carry a lone surrogate escape ("\ud800"), which strict UTF-8 cannot encode.
    if isinstance(value, str):
        return value.encode("utf-8", "surrogatepass")
    text = json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return text.encode("utf-8", "surrogatepass")


# A model name is copied into the journal record (twice) and the telemetry: bounded, so that no request can
# make its record too large for etcd (1.5 MiB per request). Hugging Face ids and served names are far shorter.
MAX_MODEL_NAME_CHARS = 1024


def parse_request(
    kind: RouteKind,
    body: bytes,
    *,
    max_body_bytes: int,
    max_json_depth: int = 64,
    known_models: frozenset[str] | None = None,
    prefix_block_bytes: int = 256,
    prefix_max_blocks: int = 512,
) -> ParsedRequest:
    """Validate a request body; raise :class:`RequestRejected` with what is wrong and what to do."""
    if len(body) > max_body_bytes:
        _reject(
            413,
            "request_too_large",
            f"the request body is {len(body)} bytes; this gateway accepts at most {max_body_bytes} bytes "
            "(limits.max_request_body_bytes). Send a shorter prompt or ask the operator to raise the limit.",
        )
    try:
        body.decode("utf-8")
    except UnicodeDecodeError as exc:
        _reject(
            400,
            "invalid_json",
            f"the request body is not UTF-8 (invalid byte at offset {exc.start}); "
            "send JSON encoded as UTF-8.",
        )
    try:
        req = bounded_json.loads(body, max_depth=max_json_depth)
    except bounded_json.JsonTooDeep:
        _reject(
            400,
            "json_too_deep",
            f"the request body nests arrays/objects deeper than {max_json_depth} levels "
            "(limits.max_json_depth); flatten it.",
        )
    except json.JSONDecodeError as exc:
        _reject(
            400,
            "invalid_json",
            f"the request body is not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno} "
            f"(char {exc.pos}); send one JSON object.",
        )
    except ValueError as exc:  # NaN / Infinity: Python accepts them, JSON does not
        _reject(400, "invalid_json", f"the request body is not valid JSON: {exc}; send one JSON object.")
    if not isinstance(req, dict):
        _reject(
            400,
            "invalid_request",
            f"the request body must be a JSON object, got a JSON {_json_type(req)}; "
            'send an object like {"model": ..., ...}.',
        )

    model = req.get("model")
    if not isinstance(model, str) or not model:
        _reject(400, "missing_model", "`model` must be a non-empty string naming a served model.", "model")
    if len(model) > MAX_MODEL_NAME_CHARS:
        _reject(
            400,
            "invalid_parameter",
            f"`model` is {len(model)} characters long; this gateway accepts at most {MAX_MODEL_NAME_CHARS}. "
            "Name a served model.",
            "model",
        )
    if known_models is not None and model not in known_models:
        known = ", ".join(sorted(known_models)) or "(none)"
        _reject(
            404, "model_not_found", f"the model `{model}` does not exist. Known models: {known}.", "model"
        )

    stateful: str | None = None
    previous: str | None = None
    stores_response = False
    if kind in (RouteKind.CHAT, RouteKind.MESSAGES):
        messages = req.get("messages")
        if not isinstance(messages, list) or not messages:
            what = "a chat completion" if kind is RouteKind.CHAT else "a Messages request"
            _reject(
                400,
                "missing_messages",
                f"{what} needs `messages`: a non-empty list of message objects.",
                "messages",
            )
        prompts = 1
    elif kind is RouteKind.RESPONSES:
        given = req.get("input")
        if not isinstance(given, str | list) or not given:
            _reject(
                400,
                "missing_input",
                "a Responses request needs `input`: a string or a non-empty list of input items.",
                "input",
            )
        previous = req.get("previous_response_id")
        if previous is not None and not isinstance(previous, str):
            _reject(
                400, "invalid_parameter", "`previous_response_id` must be a string.", "previous_response_id"
            )
        if previous and not valid_key(previous):
            _reject(
                400,
                "invalid_parameter",
                "`previous_response_id` must be a response id (1-200 of A-Z a-z 0-9 . _ : ~ -).",
                "previous_response_id",
            )
        stores_response = req.get("store") is not False
        if previous:
            stateful = f"it continues the stored response {previous} (previous_response_id)"
        elif req.get("background") is True:
            stateful = "it runs in the background on the replica that stores it (background: true)"
        prompts = 1
    else:
        if "prompt" not in req or req["prompt"] is None:
            _reject(
                400,
                "missing_prompt",
                "a completion needs `prompt`: a string, a list of strings or a list of token ids.",
                "prompt",
            )
        prompts = _prompt_count(req["prompt"])

    stream = req.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        _reject(400, "invalid_parameter", "`stream` must be true or false.", "stream")

    n = req.get("n")
    if n is not None and (not isinstance(n, int) or isinstance(n, bool)):
        _reject(400, "invalid_parameter", "`n` must be an integer.", "n")
    if stream and n is not None and n > 1:
        _reject(
            400,
            "unsupported",
            f"streaming with n={n} is not supported by this gateway: its first-delta accounting "
            "(failover before the first delta, terminal error after it) is per single choice. "
            "Send n=1, or send separate requests.",
            "n",
        )
    if stream and prompts > 1:
        _reject(
            400,
            "unsupported",
            f"streaming a completion of {prompts} prompts is not supported by this gateway: its "
            "first-delta accounting is per single choice. Send one prompt per streamed request.",
            "prompt",
        )

    opts = req.get("stream_options") if kind in (RouteKind.CHAT, RouteKind.COMPLETIONS) else None
    if opts is not None and not isinstance(opts, dict):
        _reject(400, "invalid_parameter", "`stream_options` must be an object.", "stream_options")
    opts = opts or {}
    include_usage = opts.get("include_usage") is True

    seed = _opt_int(req.get("seed"))
    if seed is not None and not -(2**63) <= seed < 2**63:
        # vLLM takes a 64-bit seed and answers 400 for any other; the journal records it as one.
        _reject(400, "invalid_parameter", "`seed` must be a 64-bit signed integer.", "seed")
    tools = req.get("tools")
    functions = req.get("functions")
    max_tokens = req.get("max_output_tokens" if kind is RouteKind.RESPONSES else "max_tokens")
    if max_tokens is None:
        max_tokens = req.get("max_completion_tokens")
    return ParsedRequest(
        kind=kind,
        model=model,
        stream=stream,
        include_usage=include_usage,
        continuous_usage=include_usage and opts.get("continuous_usage_stats") is True,
        seed=seed,
        max_tokens=_opt_int(max_tokens),
        has_tools=bool(tools) or bool(functions),
        estimated_prompt_tokens=estimate_prompt_tokens(kind, req),
        input_digest="sha256:" + hashlib.sha256(body).hexdigest(),
        stateful=stateful,
        previous_response_id=previous or None,
        stores_response=stores_response,
        prefix_blocks=prompt_blocks(
            kind.value, req, block_bytes=prefix_block_bytes, max_blocks=prefix_max_blocks
        ),
    )


def _json_type(v: Any) -> str:
    if isinstance(v, list):
        return "array"
    if isinstance(v, str):
        return "string"
    if isinstance(v, bool):
        return "boolean"
    if v is None:
        return "null"
    return "number"
