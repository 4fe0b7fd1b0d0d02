from __future__ import annotations

import json
import random
import re
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path

import pytest

from router_sidecar.core import sse
from router_sidecar.core.sse import (
    DONE_EVENT,
    EventKind,
    SseEvent,
    SseScanner,
    UsageTail,
    terminal_error_frame,
)

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
    # Not a JSON object: a broken replica (held: the attempt fails; released: counted as content).
    ("not json: malformed", b"data: hello\n\n", EventKind.MALFORMED, None, None),
    ("json list: malformed", b"data: [1, 2]\n\n", EventKind.MALFORMED, None, None),
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


# --- cost is linear in the input, however it is split ------------------------------------------


def best_cpu_seconds(run: Callable[[], object], repeat: int = 3) -> float:
    """CPU time of the fastest of ``repeat`` runs: robust to other processes on a busy machine."""
    best = float("inf")
    for _ in range(repeat):
        start = time.process_time()
        run()
        best = min(best, time.process_time() - start)
    return best


def feed_pieces(event: bytes, piece: int, **kwargs: int) -> Callable[[], object]:
    pieces = [event[i : i + piece] for i in range(0, len(event), piece)]

    def run() -> None:
        s = SseScanner(**kwargs)
        events = [e for p in pieces for e in s.feed(p)]
        assert [e.raw for e in events] == [event]

    return run


LARGE_EVENTS: dict[str, Callable[[int], bytes]] = {
    "lf": lambda n: b'data: {"choices":[{"delta":{"content":"' + b"x" * n + b'"}}]}\n\n',
    "crlf": lambda n: b'data: {"choices":[{"delta":{"content":"' + b"x" * n + b'"}}]}\r\n\r\n',
    "many lines": lambda n: (b"data: " + b"y" * 94 + b"\n") * (n // 100) + b"\n",
    "comment lines, cr": lambda n: (b": " + b"z" * 97 + b"\r") * (n // 100) + b"data: [DONE]\r\r\n",
}


@pytest.mark.parametrize("shape", LARGE_EVENTS)
def test_cost_is_linear_in_the_size_of_a_held_event(shape: str) -> None:
    # 1 MB and 4 MB events in 1 KB chunks: linear is 4x, quadratic 16x (the old scanner: ~17x).
    make = LARGE_EVENTS[shape]
    small = best_cpu_seconds(feed_pieces(make(1 << 20), 1024, max_event_bytes=8 << 20))
    large = best_cpu_seconds(feed_pieces(make(4 << 20), 1024, max_event_bytes=8 << 20))
    assert large < 8 * small, f"1 MB: {small:.4f} s, 4 MB: {large:.4f} s"


def test_cost_is_linear_in_blank_lines_before_an_event() -> None:
    def run(blank: int) -> float:
        return best_cpu_seconds(feed_pieces(b"\n" * blank + b"data: [DONE]\n\n", 256), repeat=5)

    small, large = run(64 << 10), run(256 << 10)
    assert large < 8 * small, f"64 KB: {small:.4f} s, 256 KB: {large:.4f} s"


def test_pending_size_without_a_copy() -> None:
    s = SseScanner()
    assert s.pending_size == 0
    s.feed(b"data: [DO")
    assert s.pending_size == len(b"data: [DO") == len(s.pending)
    s.feed(b"NE]\n\n")
    assert s.pending_size == 0


def test_cr_after_lf_only_held_bytes() -> None:
    # Held bytes without a CR are searched for "\n\n"; a CR arriving later switches to CR/CRLF framing.
    s = SseScanner()
    assert s.feed(b"\n\ndata: [DONE]") == []
    assert s.feed(b"\n") == []
    [ev] = s.feed(b"\r\n")
    assert ev.raw == b"\n\ndata: [DONE]\n\r\n"
    assert ev.kind is EventKind.DONE
    assert s.pending == b""


@pytest.mark.parametrize("seed", range(10))
def test_random_streams_byte_at_a_time(seed: int) -> None:
    rng = random.Random(f"bytewise-{seed}")
    eols = [b"\n", b"\r\n", b"\r"]
    out = bytearray()
    for _ in range(rng.randint(1, 12)):
        out += rng.choice(eols) * rng.randint(0, 2)  # blank lines before the event
        for _ in range(rng.randint(1, 3)):
            out += rng.choice(PIECES) + rng.choice(eols)
        out += rng.choice(eols)
    data = bytes(out)
    expected = scan_closed(data)
    s = SseScanner()
    events = [e for i in range(len(data)) for e in s.feed(data[i : i + 1])]
    assert (events + s.close(), s.pending) == expected


# --- the bound on one event ----------------------------------------------------------------------


def test_oversized_event_stops_the_scanner() -> None:
    a = chunk({"content": "a"})
    s = SseScanner(max_event_bytes=len(a) + 10)
    events = s.feed(a + b"data: " + b"x" * 200)
    assert [e.raw for e in events] == [a]  # completed before the bound was crossed: still returned
    assert s.oversized
    assert s.pending == b""
    assert s.pending_size == 0
    assert s.feed(b"\n\n" + a) == []
    assert s.feed(a) == []
    assert s.close() == []
    assert s.pending == b""


@pytest.mark.parametrize("piece", [1, 7, 64])
@pytest.mark.parametrize(
    "held",
    [b"data: " + b"x" * 300, b"\n" * 300, b"\r\n" * 150, b": ping\r" * 50],
    ids=["data", "blank lf", "blank crlf", "comments cr"],
)
def test_oversized_when_held_bytes_exceed_the_bound(held: bytes, piece: int) -> None:
    s = SseScanner(max_event_bytes=100)
    fed = 0
    for i in range(0, len(held), piece):
        assert s.feed(held[i : i + piece]) == []
        fed += len(held[i : i + piece])
        assert s.oversized == (fed > 100), fed
        assert s.pending_size == (0 if fed > 100 else fed)
    assert s.oversized


def test_an_event_of_exactly_the_bound_is_held_and_one_byte_more_is_not() -> None:
    raw = chunk({"content": "y" * 50})
    s = SseScanner(max_event_bytes=len(raw))
    assert s.feed(raw[:-1]) == []
    assert not s.oversized
    [ev] = s.feed(raw[-1:])
    assert ev.raw == raw
    assert not s.oversized
    over = SseScanner(max_event_bytes=len(raw) - 1)
    assert over.feed(raw[:-1]) == [] and not over.oversized  # held: within the bound so far
    assert over.feed(raw[-1:]) == [] and over.oversized  # complete, one byte over: refused


def test_default_bound_is_one_mebibyte() -> None:
    s = SseScanner()
    s.feed(b"data: " + b"x" * ((1 << 20) - 6))
    assert not s.oversized
    assert s.pending_size == 1 << 20
    s.feed(b"x")
    assert s.oversized


def test_oversized_is_read_only_and_the_bound_positive() -> None:
    s = SseScanner()
    with pytest.raises(AttributeError):
        s.oversized = True  # type: ignore[misc]
    with pytest.raises(ValueError):
        SseScanner(max_event_bytes=0)


# --- close() completes an event ended by a lone CR at the end of input ---------------------------

CR_ENDED = [
    (b"data: [DONE]\r\r", EventKind.DONE),
    (b'data: {"choices":[{"delta":{"content":"a"}}]}\r\r', EventKind.CONTENT),
    (b"data: [DONE]\r\n\r", EventKind.DONE),
    (b'data: {"choices":[{"delta":{"content":"a"}}]}\r\n\r', EventKind.CONTENT),
    (b': ping\r\ndata: {"choices":[{"delta":{"content":""}}]}\r\n\r', EventKind.NON_CONTENT),
]


@pytest.mark.parametrize(("raw", "kind"), CR_ENDED, ids=[r.decode()[-14:] for r, _ in CR_ENDED])
def test_close_completes_an_event_ended_by_a_lone_cr(raw: bytes, kind: EventKind) -> None:
    before = chunk({"content": "b"}).replace(b"\n", b"\r\n")
    for pieces in (
        [raw],
        [raw[i : i + 1] for i in range(len(raw))],
        [before + raw],
        [before, raw[:5], raw[5:]],
    ):
        s = SseScanner()
        fed = [e for p in pieces for e in s.feed(p)]
        assert [e.raw for e in fed] == ([before] if b"".join(pieces).startswith(before) else [])
        assert s.pending == raw  # a "\n" could still follow: held
        [ev] = s.close()
        assert (ev.raw, ev.kind) == (raw, kind)
        assert s.pending == b""
        assert s.close() == []


@pytest.mark.parametrize("raw", [b"data: [DONE]\r\n\r\n", b"data: [DONE]\n\r\n", b"data: [DONE]\r\r\n"])
def test_an_event_ended_by_crlf_needs_no_close(raw: bytes) -> None:
    s = SseScanner()
    [ev] = s.feed(raw)
    assert (ev.raw, ev.kind) == (raw, EventKind.DONE)
    assert s.close() == []


# --- "error": null is not an error -----------------------------------------------------------------

ERROR_NULL_CASES: list[tuple[str, bytes, EventKind]] = [
    (
        "error null last",
        b'data: {"id":"x","choices":[{"index":0,"delta":{"content":"hi"}}],"error":null}\n\n',
        C,
    ),
    (
        "error null first",
        b'data: {"error": null, "choices": [{"index": 0, "delta": {"content": "hi"}}]}\n\n',
        C,
    ),
    (
        "error null first, role only",
        b'data: {"error":null,"choices":[{"delta":{"role":"assistant"}}]}\n\n',
        N,
    ),
    ("error null, spaces", b'data: {"error" :\tnull , "choices": [{"delta": {"content": "hi"}}]}\n\n', C),
    ("error null, crlf", b'data: {"error":null,"choices":[{"delta":{"content":"hi"}}]}\r\n\r\n', C),
    (
        "error null top-level, set nested (json fallback)",
        b'data: {"error":null,"choices":[{"delta":{"content":"hi"},"error":{"message":"m"}}]}\n\n',
        C,
    ),
    (
        "error set after error null key text in a string",
        b'data: {"choices":[{"delta":{"content":"\\"error\\":null"}}],"error":{"message":"m"}}\n\n',
        EventKind.ERROR,
    ),
    ("error false is set", b'data: {"error":false,"choices":[]}\n\n', EventKind.ERROR),
    ("error string is set", b'data: {"choices":[],"error":"boom"}\n\n', EventKind.ERROR),
]


@pytest.mark.parametrize(
    ("raw", "kind"), [c[1:] for c in ERROR_NULL_CASES], ids=[c[0] for c in ERROR_NULL_CASES]
)
def test_error_null_is_classified_by_content(raw: bytes, kind: EventKind) -> None:
    assert one(raw).kind is kind
    assert scan_closed(*[raw[i : i + 3] for i in range(0, len(raw), 3)])[0][0].kind is kind


@pytest.mark.parametrize(
    ("payload", "kind"),
    [
        (b'{"error": null, "choices": [{"delta": {"content": "hi"}}]}', C),
        (b'{"choices": [{"delta": {"content": ""}}], "error": null}', N),
        (b'{"error": {"message": "m"}}', EventKind.ERROR),
    ],
)
def test_json_fallback_error_null(payload: bytes, kind: EventKind) -> None:
    assert sse._classify_by_json(payload)[0] is kind


# --- no replica bytes raise from the scanner -------------------------------------------------------

# Nesting no engine writes is a broken replica: ERROR (retried before the first delta, a frame after).
E = EventKind.ERROR
HOSTILE_EVENTS: dict[str, tuple[bytes, EventKind, str | None, int | None]] = {
    "100k [": (b"data: " + b"[" * 100_000 + b"\n\n", E, None, None),
    '100k {"a":': (b"data: " + b'{"a":' * 100_000 + b"\n\n", E, None, None),
    "100k [ closed": (b"data: " + b"[" * 100_000 + b"]" * 100_000 + b"\n\n", E, None, None),
    "deep object with an error key": (
        b'data: {"choices":[],"x":' + b"[" * 100_000 + b"]" * 100_000 + b',"error":{"message":"m"}}\n\n',
        E,
        None,
        None,
    ),
    "deep, over two data lines": (b"data: [\ndata: " + b"[" * 100_000 + b"\n\n", E, None, None),
    "65 levels (over the event bound)": (
        b'data: {"choices":[],"error":' + b"[" * 64 + b"]" * 64 + b"}\n\n",
        E,
        None,
        None,
    ),
    "invalid escape in finish_reason": (
        b'data: {"choices":[{"delta":{},"finish_reason":"st\\qp"}]}\n\n',
        N,
        "st\\qp",
        None,
    ),
    "5000-digit completion_tokens": (
        b'data: {"choices":[],"usage":{"completion_tokens":' + b"9" * 5000 + b"}}\n\n",
        N,
        None,
        None,
    ),
    # Python refuses to parse an int of over 4300 digits: read by its bytes (no content key: not content).
    "5000-digit completion_tokens, json fallback": (
        b'data: {"choices":[],"usage":{"completion_tokens":'
        + b"9" * 5000
        + b'},"error":null,"x":{"error":1}}\n\n',
        N,
        None,
        None,
    ),
    "NaN": (b'data: {"choices":[],"x":NaN,"y":{"error":1}}\n\n', N, None, None),
    "NaN beside content": (
        b'data: {"choices":[{"delta":{"content":"a"}}],"x":NaN,"y":{"error":1}}\n\n',
        C,
        None,
        None,
    ),
    "not utf-8": (b'data: {"choices":[{"delta":{"content":"\xff"}}],"y":{"error":1}}\n\n', C, None, None),
}


@pytest.mark.parametrize("name", HOSTILE_EVENTS)
def test_hostile_events_are_classified_without_raising(name: str) -> None:
    raw, kind, finish, usage = HOSTILE_EVENTS[name]
    ev = one(raw)
    assert (ev.kind, ev.finish_reason, ev.usage_completion_tokens) == (kind, finish, usage)


@pytest.mark.parametrize("seed", range(20))
def test_random_hostile_bytes_never_raise(seed: int) -> None:
    rng = random.Random(f"hostile-{seed}")
    alphabet = [
        b"data: ",
        b"data:",
        b": ",
        b"[",
        b"]",
        b"{",
        b"}",
        b'"error":',
        b'"error": null',
        b'{"error":',
        b"\\",
        b'"',
        b"null",
        b":",
        b",",
        b"\n",
        b"\r",
        b"\r\n",
        b'"finish_reason":"',
        b'"completion_tokens":',
        b"9" * 30,
        b"\\u12",
        b"\xff",
        b"[" * 300,
        b'{"a":' * 300,
        b'"content":"x"',
        b"NaN",
        b"[DONE]",
    ]
    data = b"".join(rng.choice(alphabet) for _ in range(rng.randint(10, 400)))
    events, pending = scan_closed(data)
    assert b"".join(e.raw for e in events) + pending == data
    cuts = sorted(rng.sample(range(1, len(data)), k=min(len(data) - 1, 30)))
    pieces = [data[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)], strict=True)]
    assert scan_closed(*pieces) == (events, pending)


# --- usage of a non-stream body --------------------------------------------------------------------


def vllm_chat_body(completion_tokens: int, size: int) -> bytes:
    """vLLM's non-stream chat body (reference chat.json) padded to ``size`` with logprobs."""
    obj = json.loads((REFERENCE / "chat.json").read_bytes())
    obj["usage"]["completion_tokens"] = completion_tokens
    obj["usage"]["total_tokens"] = obj["usage"]["prompt_tokens"] + completion_tokens
    top = [{"token": " b", "logprob": -1.25, "bytes": [32, 98]}]
    entries = [
        {"token": " a", "logprob": -0.5, "bytes": [32, 97], "top_logprobs": top},
        # Token text that looks like the key: escaped inside a string, so not a key.
        {"token": '"completion_tokens": 7', "logprob": -3.0, "bytes": [34], "top_logprobs": top},
        {"token": "\\", "logprob": -2.0, "bytes": [92], "top_logprobs": top},
    ]
    entry_size = len(json.dumps(entries, separators=(",", ":")))
    # In the long list, each group of entries costs its length less the 2 brackets plus 1 comma.
    obj["choices"][0]["logprobs"] = {"content": entries * (size // (entry_size - 1) + 1)}
    return json.dumps(obj, separators=(",", ":")).encode()


BIG_BODY = vllm_chat_body(4096, 4 << 20)
USAGE_AT = BIG_BODY.index(b'"usage":')
USAGE_END = BIG_BODY.index(b"}", USAGE_AT) + 1


def usage_of(*pieces: bytes, keep_bytes: int = 65536) -> int | None:
    tail = UsageTail(keep_bytes)
    for p in pieces:
        tail.feed(p)
    return tail.completion_tokens()


def test_usage_tail_reference_body() -> None:
    body = (REFERENCE / "chat.json").read_bytes()
    assert usage_of(body) == 4
    for i in range(len(body) + 1):
        assert usage_of(body[:i], body[i:]) == 4, i


def test_usage_tail_4mb_body_in_random_chunks() -> None:
    assert len(BIG_BODY) >= 4 << 20
    assert BIG_BODY.index(b'"usage":') > len(BIG_BODY) - 1000  # vLLM: usage at the end
    rng = random.Random("usage-tail")
    for _ in range(5):
        cuts = sorted(rng.sample(range(1, len(BIG_BODY)), k=rng.randint(1, 300)))
        pieces = [BIG_BODY[a:b] for a, b in zip([0, *cuts], [*cuts, len(BIG_BODY)], strict=True)]
        assert usage_of(*pieces) == 4096


def test_usage_tail_chunk_boundary_inside_usage() -> None:
    body = memoryview(BIG_BODY)
    start = USAGE_AT - 100
    for i in range(USAGE_AT - 3, USAGE_END + 3):
        assert usage_of(body[:start], body[start:i], body[i:]) == 4096, bytes(body[USAGE_AT:i])
        assert usage_of(body[:start], body[start:i], body[i:], keep_bytes=256) == 4096


def test_usage_tail_memory_is_bounded() -> None:
    pieces = [BIG_BODY[i : i + 65536] for i in range(0, len(BIG_BODY), 65536)]
    tail = UsageTail()
    tracemalloc.start()
    try:
        for p in pieces:
            tail.feed(p)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert tail.completion_tokens() == 4096
    assert peak < 512 << 10, peak  # a 4 MB body, 64 KB chunks, 64 KB kept


def test_usage_tail_cost_is_linear() -> None:
    def run(size: int) -> float:
        body = vllm_chat_body(12, size)
        pieces = [body[i : i + 1024] for i in range(0, len(body), 1024)]
        return best_cpu_seconds(lambda: usage_of(*pieces))

    small, large = run(1 << 20), run(4 << 20)
    assert large < 8 * small, f"1 MB: {small:.4f} s, 4 MB: {large:.4f} s"


def test_usage_tail_key_followed_by_megabytes() -> None:
    # vLLM writes prompt_logprobs after usage: the key leaves the tail and is still the answer.
    body = (
        b'{"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":12},"prompt_logprobs":['
        + b'{"1":{"logprob":-0.5,"rank":1,"decoded_token":"\\"completion_tokens\\": 9"}},' * 20_000
        + b"null]}"
    )
    assert len(body) > 1 << 20
    assert usage_of(body) == 12
    assert usage_of(*[body[i : i + 1000] for i in range(0, len(body), 1000)]) == 12


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        (b'{"usage":{"completion_tokens":12},"x":"\\"completion_tokens\\": 99"}', 12),
        (b'{"a":{"completion_tokens":1},"b":{"completion_tokens":2}}', 2),
        (b'{"usage":{"completion_tokens_details":null,"completion_tokens" : 5}}', 5),
        (b'{"usage":{"completion_tokens":5},"b":{"completion_tokens":null}}', 5),
        (b'{"choices":[],"usage":null}', None),
        (b"", None),
        (b'{"usage":{"completion_tokens":' + b"9" * 5000 + b"}}", None),
    ],
    ids=["escaped key after", "last of two", "spaces", "null after", "usage null", "empty", "5000 digits"],
)
def test_usage_tail_last_key(body: bytes, expected: int | None) -> None:
    assert usage_of(body) == expected
    assert usage_of(*[body[i : i + 5] for i in range(0, len(body), 5)], keep_bytes=256) == expected


def test_usage_tail_escaped_key_at_the_start_of_the_tail() -> None:
    # The tail starts exactly at a quote whose escaping backslash has just left the tail.
    keep = 256
    key = b'"completion_tokens\\": 7'
    body = b'{"x":"' + b"a" * 1000 + b"\\" + key + b"b" * (keep - len(key) - 2) + b'"}'
    assert body[-keep:].startswith(b'"completion_tokens')
    for piece in (1, 7, 100, len(body)):
        pieces = [body[i : i + piece] for i in range(0, len(body), piece)]
        assert usage_of(*pieces, keep_bytes=keep) is None, piece


def test_usage_tail_keep_bytes_lower_bound() -> None:
    with pytest.raises(ValueError):
        UsageTail(keep_bytes=16)
