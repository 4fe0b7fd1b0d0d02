from __future__ import annotations

import json
import random
import re
from pathlib import Path

import pytest

from router_sidecar.core.sse import DONE_EVENT, EventKind, SseEvent, SseScanner, terminal_error_frame

REFERENCE = Path("/work/shared/reference/vllm-0.32-cpu")
TRANSCRIPTS = sorted(REFERENCE.glob("*.sse"))


def scan(*chunks: bytes) -> tuple[list[SseEvent], bytes]:
    s = SseScanner()
    events: list[SseEvent] = []
    for c in chunks:
        events.extend(s.feed(c))
    return events, s.pending


def one(raw: bytes) -> SseEvent:
    events, pending = scan(raw)
    assert pending == b""
    assert len(events) == 1
    assert events[0].raw == raw
    return events[0]


def chunk(delta: dict | None = None, *, finish: str | None = None, usage: int | None = None, **top) -> bytes:
    obj: dict = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "model": "tiny"}
    obj["choices"] = [] if delta is None else [{"index": 0, "delta": delta, "finish_reason": finish}]
    if usage is not None:
        obj["usage"] = {"prompt_tokens": 3, "total_tokens": 3 + usage, "completion_tokens": usage}
    obj.update(top)
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


# --- reference transcripts: any split gives the same events ------------------------------------


def test_reference_transcripts_exist() -> None:
    assert len(TRANSCRIPTS) >= 7


@pytest.mark.parametrize("path", TRANSCRIPTS, ids=lambda p: p.name)
def test_transcript_every_two_piece_split(path: Path) -> None:
    data = path.read_bytes()
    whole, pending = scan(data)
    assert b"".join(e.raw for e in whole) + pending == data
    if len(data) <= 20_000:
        for i in range(len(data) + 1):
            assert scan(data[:i], data[i:]) == (whole, pending), i
        return
    # The 90 KB transcript: pending is empty at every event boundary of the unsplit parse, so
    # splitting inside a window of three neighbouring events covers every byte position of the
    # file in the same scanner states, in O(n) instead of O(n^2).
    raws = [e.raw for e in whole]
    for k in range(len(raws)):
        window = raws[max(k - 1, 0) : k + 2]
        wdata = b"".join(window)
        expected = whole[max(k - 1, 0) : k + 2]
        lo = len(b"".join(window[: 1 if k else 0]))
        for i in range(lo, lo + len(raws[k]) + 1):
            assert scan(wdata[:i], wdata[i:]) == (expected, b""), (k, i)


@pytest.mark.parametrize("path", TRANSCRIPTS, ids=lambda p: p.name)
def test_transcript_random_many_piece_splits(path: Path) -> None:
    data = path.read_bytes()
    whole, pending = scan(data)
    rng = random.Random(f"sse-{path.name}")
    for _ in range(50):
        cuts = sorted(rng.sample(range(1, len(data)), k=min(len(data) - 1, rng.randint(2, 200))))
        pieces = [data[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)], strict=True)]
        events, pend = scan(*pieces)
        assert events == whole
        assert pend == pending
        assert b"".join(e.raw for e in events) + pend == data


def scan_closed(*chunks: bytes) -> tuple[list[SseEvent], bytes]:
    s = SseScanner()
    events = [e for c in chunks for e in s.feed(c)]
    return events + s.close(), s.pending


def summary(events: list[SseEvent]) -> list[tuple[EventKind, str | None, int | None]]:
    return [(e.kind, e.finish_reason, e.usage_completion_tokens) for e in events]


@pytest.mark.parametrize("eol", [b"\r\n", b"\r"], ids=["crlf", "cr"])
@pytest.mark.parametrize("path", TRANSCRIPTS, ids=lambda p: p.name)
def test_transcript_crlf_and_cr_variants(path: Path, eol: bytes) -> None:
    data = path.read_bytes()
    whole, _ = scan(data)
    variant = data.replace(b"\n", eol)
    ref, pending = scan_closed(variant)
    assert summary(ref) == summary(whole)
    assert b"".join(e.raw for e in ref) + pending == variant
    rng = random.Random(f"eol-{path.name}")
    for _ in range(20):
        cuts = sorted(rng.sample(range(1, len(variant)), k=min(len(variant) - 1, 40)))
        pieces = [variant[a:b] for a, b in zip([0, *cuts], [*cuts, len(variant)], strict=True)]
        assert scan_closed(*pieces) == (ref, pending)


def test_reference_classification_chat_usage() -> None:
    events, pending = scan((REFERENCE / "chat_stream_usage.sse").read_bytes())
    assert pending == b""
    kinds = [e.kind for e in events]
    assert kinds[0] is EventKind.NON_CONTENT  # role-only
    assert kinds[-1] is EventKind.DONE
    assert kinds[-2] is EventKind.NON_CONTENT  # usage-only, choices: []
    assert events[-2].usage_completion_tokens == 12
    assert events[-3].finish_reason == "length"
    assert events[-3].kind is EventKind.CONTENT
    assert all(k is EventKind.CONTENT for k in kinds[1:-2])
    assert [e.finish_reason for e in events].count("length") == 1


def test_reference_continuous_usage() -> None:
    events, _ = scan((REFERENCE / "chat_stream_continuous_usage.sse").read_bytes())
    assert [e.usage_completion_tokens for e in events] == [0, 1, 2, 2, None]
    assert [e.kind for e in events] == [
        EventKind.NON_CONTENT,
        EventKind.CONTENT,
        EventKind.CONTENT,
        EventKind.NON_CONTENT,
        EventKind.DONE,
    ]


def test_reference_tool_calls() -> None:
    events, _ = scan((REFERENCE / "chat_stream_tool_required.sse").read_bytes())
    assert events[0].kind is EventKind.NON_CONTENT
    assert events[1].kind is EventKind.CONTENT  # "content":null + tool_calls with the function name
    assert events[-2].kind is EventKind.NON_CONTENT  # "delta":{} + finish_reason tool_calls
    assert events[-2].finish_reason == "tool_calls"
    assert events[-1].kind is EventKind.DONE


def test_reference_engine_dead_error() -> None:
    events, _ = scan((REFERENCE / "engine_dead_midstream_error.sse").read_bytes())
    assert [e.kind for e in events] == [EventKind.ERROR, EventKind.DONE]


def test_reference_killed_midstream_has_no_done() -> None:
    events, pending = scan((REFERENCE / "chat_stream_killed_midstream.sse").read_bytes())
    assert events[-1].kind is EventKind.CONTENT
    assert EventKind.DONE not in {e.kind for e in events}
    assert pending == b""


def test_reference_completions() -> None:
    events, _ = scan((REFERENCE / "completions_stream_usage.sse").read_bytes())
    assert [e.kind for e in events] == [EventKind.CONTENT] * 3 + [EventKind.NON_CONTENT, EventKind.DONE]
    assert events[2].finish_reason == "length"
    assert events[3].usage_completion_tokens == 3


# --- classification table ---------------------------------------------------------------------

C, N = EventKind.CONTENT, EventKind.NON_CONTENT

CASES: list[tuple[str, bytes, EventKind, str | None, int | None]] = [
    ("role-only", chunk({"role": "assistant", "content": ""}), N, None, None),
    ("empty content", chunk({"content": ""}), N, None, None),
    ("empty delta", chunk({}), N, None, None),
    ("null content", chunk({"content": None}), N, None, None),
    ("content", chunk({"content": "hi"}), C, None, None),
    ("content is an escaped quote", chunk({"content": '"'}), C, None, None),
    ("content is a newline", chunk({"content": "\n"}), C, None, None),
    ("null content + tool_calls", chunk({"content": None, "tool_calls": [{"index": 0}]}), C, None, None),
    ("empty tool_calls", chunk({"content": None, "tool_calls": []}), N, None, None),
    ("reasoning_content", chunk({"reasoning_content": "think"}), C, None, None),
    ("empty reasoning_content", chunk({"reasoning_content": ""}), N, None, None),
    ("reasoning (newer vLLM)", chunk({"reasoning": "think"}), C, None, None),
    ("finish only", chunk({}, finish="stop"), N, "stop", None),
    ("abort with content", chunk({"content": "x"}, finish="abort"), C, "abort", None),
    ("usage only", chunk(None, usage=7), N, None, 7),
    ("continuous usage", chunk({"content": "a"}, usage=4), C, None, 4),
    (
        "completions text",
        b'data: {"object":"text_completion","choices":[{"index":0,"text":"fp","finish_reason":null}]}\n\n',
        C,
        None,
        None,
    ),
    (
        "completions empty text",
        b'data: {"object":"text_completion","choices":[{"index":0,"text":"","finish_reason":"stop"}]}\n\n',
        N,
        "stop",
        None,
    ),
    (
        "spaces after colons",
        b'data: {"choices": [{"delta": {"content": "x"}, "finish_reason": "length"}],'
        b' "usage": {"completion_tokens": 5}}\n\n',
        C,
        "length",
        5,
    ),
    (
        "spaces, role only",
        b'data: {"choices": [{"delta": {"role": "assistant", "content": ""}, "finish_reason": null}]}\n\n',
        N,
        None,
        None,
    ),
    (
        "key text inside a string is not a key",
        b'data: {"choices":[{"delta":{"content":"","role":"say \\"content\\":\\"x"}}]}\n\n',
        N,
        None,
        None,
    ),
    (
        "escaped quote before key name",
        b'data: {"choices":[{"delta":{"x\\"content":"y"}}]}\n\n',
        N,
        None,
        None,
    ),
    ("done", b"data: [DONE]\n\n", EventKind.DONE, None, None),
    ("done without space", b"data:[DONE]\n\n", EventKind.DONE, None, None),
    (
        "error with spaces (vLLM)",
        b'data: {"error": {"message": "EngineCore encountered an issue.", "type": "InternalServerError",'
        b' "param": null, "code": 500}}\n\n',
        EventKind.ERROR,
        None,
        None,
    ),
    ("error compact", b'data: {"error":{"message":"boom","code":500}}\n\n', EventKind.ERROR, None, None),
    (
        "error key not first (json fallback)",
        b'data: {"object":"error","error":{"message":"boom"}}\n\n',
        EventKind.ERROR,
        None,
        None,
    ),
    (
        "nested error key is not an error event",
        b'data: {"choices":[{"delta":{"content":"a"},"error":null}]}\n\n',
        C,
        None,
        None,
    ),
    ("comment", b": keep-alive\n\n", EventKind.COMMENT, None, None),
    ("two comments", b": a\n:b\n\n", EventKind.COMMENT, None, None),
    ("comment mentioning content", b': "content":"x"\n\n', EventKind.COMMENT, None, None),
    ("comment + role-only data", b': ping\ndata: {"choices":[{"delta":{"content":""}}]}\n\n', N, None, None),
    (
        "event field ignored",
        b'event: message\ndata: {"choices":[{"delta":{"content":"a"}}]}\n\n',
        C,
        None,
        None,
    ),
    ("id only", b"id: 7\n\n", N, None, None),
    ("empty data", b"data:\n\n", N, None, None),
    ("data without colon", b"data\n\n", N, None, None),
    ("not json: counted as visible", b"data: hello\n\n", C, None, None),
    ("json list: counted as visible", b"data: [1, 2]\n\n", C, None, None),
    (
        "multi-line data",
        b'data: {"choices":[{"delta":\ndata: {"content":"hi"},\ndata: "finish_reason":"stop"}]}\n\n',
        C,
        "stop",
        None,
    ),
    ("multi-line role-only", b'data: {"choices":[{"delta":\ndata:{"content":""}}]}\n\n', N, None, None),
    ("crlf", b'data: {"choices":[{"delta":{"content":"a"}}]}\r\n\r\n', C, None, None),
    ("cr+lf mix", b': x\rdata: {"choices":[{"delta":{"content":"a"}}]}\r\n\n', C, None, None),
    ("crlf done", b"data: [DONE]\r\n\r\n", EventKind.DONE, None, None),
    (
        "escaped finish_reason",
        b'data: {"choices":[{"delta":{},"finish_reason":"st\\u006fp"}]}\n\n',
        N,
        "stop",
        None,
    ),
    (
        "first choice with a finish_reason",
        b'data: {"choices":[{"index":0,"delta":{},"finish_reason":null},'
        b'{"index":1,"delta":{},"finish_reason":"length"}]}\n\n',
        N,
        "length",
        None,
    ),
    (
        "completion_tokens_details is not completion_tokens",
        b'data: {"choices":[],"usage":{"completion_tokens_details":null,"completion_tokens":9}}\n\n',
        N,
        None,
        9,
    ),
]


@pytest.mark.parametrize(
    ("raw", "kind", "finish", "usage"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_classification(raw: bytes, kind: EventKind, finish: str | None, usage: int | None) -> None:
    ev = one(raw)
    assert (ev.kind, ev.finish_reason, ev.usage_completion_tokens) == (kind, finish, usage)
    # Every byte split of a single event gives the same event.
    for i in range(1, len(raw)):
        s = SseScanner()
        got = s.feed(raw[:i]) + s.feed(raw[i:])
        assert got == [ev], i


# --- framing ----------------------------------------------------------------------------------


def test_many_events_in_one_chunk_and_partial_tail() -> None:
    a = chunk({"content": "a"})
    b = b": ping\n\n"
    c = chunk({"content": "c"})
    events, pending = scan(a + b + c[:10])
    assert [e.raw for e in events] == [a, b]
    assert pending == c[:10]


def test_pending_then_completed() -> None:
    s = SseScanner()
    assert s.feed(b"data: [DO") == []
    assert s.pending == b"data: [DO"
    assert s.feed(b"NE]\n") == []
    [ev] = s.feed(b"\n")
    assert ev.kind is EventKind.DONE
    assert s.pending == b""


def test_blank_lines_before_an_event_belong_to_it() -> None:
    data = b"\n\ndata: [DONE]\n\n\n"
    events, pending = scan(data)
    assert [e.raw for e in events] == [b"\n\ndata: [DONE]\n\n"]
    assert pending == b"\n"


def test_split_between_cr_and_lf() -> None:
    # "\r" then "\n" in the next chunk is one CRLF, not a lone CR + a blank line.
    s = SseScanner()
    assert s.feed(b"data: [DONE]\r") == []
    assert s.feed(b"\n") == []
    [ev] = s.feed(b"\r") + s.feed(b"\n")
    assert ev.raw == b"data: [DONE]\r\n\r\n"
    assert s.pending == b""


def test_lone_cr_event_end_waits_for_next_byte_or_close() -> None:
    s = SseScanner()
    assert s.feed(b"data: [DONE]\r\r") == []  # the next byte might be "\n" of this event
    [ev] = s.feed(b"data: [DONE]\r\r")
    assert ev.raw == b"data: [DONE]\r\r"
    [ev2] = s.close()
    assert ev2.raw == b"data: [DONE]\r\r"
    assert s.pending == b""
    assert s.close() == []


def test_close_leaves_incomplete_event_pending() -> None:
    s = SseScanner()
    s.feed(b'data: {"choices":[{"delta":{"content":"a"')
    assert s.close() == []
    assert s.pending == b'data: {"choices":[{"delta":{"content":"a"'


def test_accepts_bytearray_and_memoryview() -> None:
    raw = chunk({"content": "a"})
    s = SseScanner()
    [a] = s.feed(bytearray(raw))
    [b] = s.feed(memoryview(raw))
    assert isinstance(a.raw, bytes)
    assert a == b


def test_byte_at_a_time() -> None:
    data = (REFERENCE / "chat_stream_tool_required.sse").read_bytes()
    whole, _ = scan(data)
    s = SseScanner()
    got = [e for i in range(len(data)) for e in s.feed(data[i : i + 1])]
    assert got == whole


def test_fast_path_returns_chunk_object_itself() -> None:
    raw = chunk({"content": "a"})
    [ev] = SseScanner().feed(raw)
    assert ev.raw is raw  # whole-event chunk: no copy


# --- terminal error frame ---------------------------------------------------------------------


def test_terminal_error_frame_exact_bytes() -> None:
    frame = terminal_error_frame("req-1", 17)
    assert frame == (
        b'data: {"error": {"code": "upstream_decode_interrupted", "message": "generation was interrupted'
        b" after part of the answer was delivered; the gateway does not retry automatically"
        b'", "request_id": "req-1", "partial_output": true, "delivered_output_tokens": 17,'
        b' "retryable": false}}\n\ndata: [DONE]\n\n'
    )
    assert frame.endswith(DONE_EVENT)
    events, pending = scan(frame)
    assert [e.kind for e in events] == [EventKind.ERROR, EventKind.DONE]
    assert pending == b""


def test_terminal_error_frame_escapes() -> None:
    frame = terminal_error_frame('r"1\n', 0, message="line1\nline2 \u00e9")
    first, _, rest = frame.partition(b"\n\n")
    assert rest == DONE_EVENT
    obj = json.loads(first.removeprefix(b"data: "))
    assert obj["error"]["request_id"] == 'r"1\n'
    assert obj["error"]["message"] == "line1\nline2 \u00e9"
    assert obj["error"]["delivered_output_tokens"] == 0


# --- randomized streams against a line-by-line reference framer -------------------------------

_LINE_RE = re.compile(rb"[^\r\n]*(?:\r\n|\r|\n)")


def reference_frames(data: bytes) -> tuple[list[bytes], bytes]:
    """Spec-style framing, one line at a time, on the complete input."""
    frames: list[bytes] = []
    start = pos = 0
    seen_line = False
    for m in _LINE_RE.finditer(data):
        pos = m.end()
        if m.group().strip(b"\r\n"):
            seen_line = True
        elif seen_line:
            frames.append(data[start:pos])
            start, seen_line = pos, False
    return frames, data[start:]


PIECES = [
    b'data: {"choices":[{"delta":{"content":"a"}}]}',
    b'data: {"choices":[{"delta":{"role":"assistant","content":""}}]}',
    b"data: [DONE]",
    b": keep-alive",
    b"event: message",
    b"id: 3",
    b'data: {"choices":[{"delta":',
    b'data: {"content":"x"}}]}',
    b'data: {"error": {"message": "boom"}}',
    b"",  # extra blank line
]


@pytest.mark.parametrize("seed", range(40))
def test_random_streams(seed: int) -> None:
    rng = random.Random(seed)
    eols = [b"\n", b"\r\n", b"\r"]
    out = bytearray()
    for _ in range(rng.randint(1, 30)):
        for _ in range(rng.randint(1, 3)):
            out += rng.choice(PIECES) + rng.choice(eols)
        out += rng.choice(eols)  # blank line
    if rng.random() < 0.5:
        out += rng.choice(PIECES)[: rng.randint(0, 20)]  # an incomplete tail
    data = bytes(out)
    frames, tail = reference_frames(data)
    events, pending = scan_closed(data)
    assert [e.raw for e in events] == frames
    assert pending == tail
    for _ in range(20):
        cuts = sorted(rng.sample(range(1, len(data)), k=min(len(data) - 1, rng.randint(1, 50))))
        pieces = [data[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)], strict=True)]
        assert scan_closed(*pieces) == (events, pending)
        s = SseScanner()
        fed = [e for p in pieces for e in s.feed(p)]
        assert b"".join(e.raw for e in fed) + s.pending == data
