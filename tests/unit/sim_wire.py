"""Reading the engines' raw replies (tests/unit/sim_captures/, reference/) and the simulator's events, for
structural comparisons: named SSE events, their JSON, shapes with random text reduced to types and ids
reduced to their form."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CAPTURES = Path(__file__).parent / "sim_captures"
VLLM = CAPTURES / "vllm-0.32"
SGLANG = CAPTURES / "sglang-0.5.23"
REF_VLLM = Path("/work/shared/reference/vllm-0.32-cpu")
REF_SGLANG = Path("/work/shared/reference/sglang-0.5.23-cpu/transcripts")

# Values that are part of the format; every other string, number and boolean becomes its type or id form.
VERBATIM = {
    "type",
    "object",
    "role",
    "status",
    "stop_reason",
    "model",
    "service_tier",
    "truncation",
    "tool_choice",
    "phase",
    "reason",
    "param",
    "code",
    "output_index",
    "content_index",
    "index",
    "background",
    "parallel_tool_calls",
}
ID_FORMS = [
    (re.compile(r"^resp_[0-9a-f]{16}$"), "<resp_16hex>"),
    (re.compile(r"^msg_[0-9a-f]{16}$"), "<msg_16hex>"),
    (re.compile(r"^msg_[0-9a-f]{32}$"), "<msg_32hex>"),
    (re.compile(r"^fc_[0-9a-f]{16}$"), "<fc_16hex>"),
    (re.compile(r"^chatcmpl-tool-[0-9a-f]{16}$"), "<chatcmpl-tool-16hex>"),
    (re.compile(r"^chatcmpl-[0-9a-f]{16}$"), "<chatcmpl-16hex>"),
]


def id_form(value: str) -> str | None:
    for pattern, form in ID_FORMS:
        if pattern.match(value):
            return form
    return None


def shape(value: Any, key: str | None = None) -> Any:
    """Key order, nesting, nulls, format-defining values and id forms; other leaves become types."""
    if isinstance(value, dict):
        return [(k, shape(v, k)) for k, v in value.items()]
    if isinstance(value, list):
        return [shape(v) for v in value]
    if value is None:
        return None
    if isinstance(value, str) and (form := id_form(value)) is not None:
        return form
    if key in VERBATIM:
        return value
    return type(value).__name__


@dataclass
class Reply:
    status: int
    headers: list[tuple[str, str]]
    body: bytes  # de-chunked
    chunked: bool
    terminated: bool | None  # the chunked body's last chunk arrived (None: not chunked)
    chunks: list[bytes]

    def header(self, name: str) -> str | None:
        return next((v for k, v in self.headers if k.lower() == name), None)

    def json(self) -> Any:
        return json.loads(self.body)

    def events(self) -> list[tuple[str | None, Any]]:
        return parse_events(self.body)


def parse_reply(raw: bytes) -> Reply:
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split(" ")[1])
    headers = [(k, v.strip()) for k, _, v in (ln.partition(":") for ln in lines[1:])]
    chunked = any(k.lower() == "transfer-encoding" and v == "chunked" for k, v in headers)
    if not chunked:
        return Reply(status, headers, body.split(b"\n<<", 1)[0], False, None, [])
    if not re.match(rb"[0-9a-fA-F]+\r\n", body):  # a transcript that kept the body, not its framing
        return Reply(status, headers, body, True, None, [])
    chunks: list[bytes] = []
    i, terminated = 0, False
    while True:
        j = body.find(b"\r\n", i)
        if j < 0:
            break
        try:
            size = int(body[i:j], 16)
        except ValueError:
            break
        if size == 0:
            terminated = body[j:].startswith(b"\r\n\r\n")
            break
        if len(body) < j + 2 + size + 2:
            break
        chunks.append(body[j + 2 : j + 2 + size])
        i = j + 2 + size + 2
    return Reply(status, headers, b"".join(chunks), True, terminated, chunks)


def capture(directory: Path, name: str) -> Reply:
    return parse_reply((directory / f"{name}.raw").read_bytes())


def parse_events(body: bytes) -> list[tuple[str | None, Any]]:
    """``(event name or None, parsed data)`` per SSE event; ``[DONE]`` stays a string."""
    out: list[tuple[str | None, Any]] = []
    for block in body.split(b"\n\n"):
        if not block.strip():
            continue
        name: str | None = None
        data: list[str] = []
        for line in block.decode().split("\n"):
            if line.startswith("event: "):
                name = line[len("event: ") :]
            elif line.startswith("data: "):
                data.append(line[len("data: ") :])
        text = "\n".join(data)
        out.append((name, text if text == "[DONE]" else json.loads(text)))
    return out


def compressed(names: list[str]) -> list[str]:
    """Runs of one event name collapsed to ``name+`` (the engine may coalesce tokens)."""
    out: list[str] = []
    for n in names:
        if out and out[-1].rstrip("+") == n:
            out[-1] = n + "+"
        else:
            out.append(n)
    return [n.rstrip("+") for n in out]


def first_shapes(events: list[tuple[str | None, Any]]) -> dict[str, Any]:
    """The shape of the first event of each name."""
    shapes: dict[str, Any] = {}
    for name, data in events:
        shapes.setdefault(str(name), shape(data))
    return shapes
