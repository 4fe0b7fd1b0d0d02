"""How many of the product's files one request crosses before the client's first byte, and how many calls go
from one file to another on the way: measured in a real gateway (Envoy, etcd, a simulated replica).

The gateway runs with a profiler installed from outside the product (a `sitecustomize` on its PYTHONPATH) that
records every call into `router_sidecar/` with the caller's file and the time. A client sends one streamed
request at a time and notes when it sent it and when the first byte of the response arrived; the calls inside
that window are the request's path. Background loops (lease keep-alive, probes) may fall into a window, so the
request is sent several times and the quietest window is reported, with the files it crossed.

    .venv/bin/python scripts/request_path.py [--requests 7]

"Cross-file calls" counts calls (not coroutine resumptions) whose caller is a product file other than the
callee's; "files" counts the product files whose code ran in the window; "the spine" counts those of them
that call into another product file (the rest are leaves: parsers, records, messages, the store).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from router_sidecar.runtime.supervise import start_etcd  # noqa: E402
from tests.harness import Gateway, Sim  # noqa: E402

PROFILER = r"""
import atexit, json, os, sys, threading, time
_ROOT = os.environ["REQUEST_PATH_ROOT"]
_OUT = os.environ["REQUEST_PATH_OUT"]
_FRESH = 0x20 | 0x80 | 0x200  # generator, coroutine, async generator: a resumption is not a call
_calls = []

def _profile(frame, event, arg):
    if event != "call":
        return
    code = frame.f_code
    callee = code.co_filename
    if not callee.startswith(_ROOT):
        return
    if code.co_flags & _FRESH and frame.f_lasti > 0:
        return
    back = frame.f_back
    caller = back.f_code.co_filename if back is not None else ""
    _calls.append((time.monotonic(), caller if caller.startswith(_ROOT) else "", callee, code.co_name))

def _dump():
    with open(f"{_OUT}.{os.getpid()}", "w") as out:  # each process its own (the parser's worker too)
        json.dump(_calls, out)

if os.environ.get("REQUEST_PATH_ARMED") == "1":
    sys.setprofile(_profile)
    threading.setprofile(_profile)
    atexit.register(_dump)
"""

BODY = json.dumps(
    {"model": "tiny", "stream": True, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
).encode()


def one_request(port: int) -> tuple[float, float]:
    """Send one streamed request; (sent, first byte) in monotonic time."""
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1:{port}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(BODY)}\r\nconnection: close\r\n\r\n"
    ).encode()
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sent = time.monotonic()
        sock.sendall(head + BODY)
        first = sock.recv(1)
        at = time.monotonic()
        assert first, "the gateway closed the connection without a byte"
        while sock.recv(65536):
            pass
    return sent, at


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=7)
    args = parser.parse_args(argv)
    root = str(REPO / "router_sidecar") + os.sep
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        (work / "site").mkdir()
        (work / "site" / "sitecustomize.py").write_text(PROFILER)
        out = work / "calls.json"
        etcd, endpoint = start_etcd(work / "etcd", log_path=work / "etcd.log")
        sim = Sim("a", work, prefill_delay=0.02)
        env = {
            "PYTHONPATH": os.pathsep.join([str(work / "site"), str(REPO), os.environ.get("PYTHONPATH", "")]),
            "REQUEST_PATH_ROOT": root,
            "REQUEST_PATH_OUT": str(out),
            "REQUEST_PATH_ARMED": "1",
        }
        gateway = Gateway(replicas=[sim.endpoint], etcd=endpoint, work=work, env=env)
        try:
            gateway.wait_replicas_healthy([sim.endpoint])
            one_request(gateway.port)  # warm: pools filled, modules imported
            windows = [one_request(gateway.port) for _ in range(args.requests)]
        finally:
            gateway.stop()
            sim.stop()
            etcd.stop()
        calls = [c for part in work.glob("calls.json.*") for c in json.loads(part.read_text())]
    best: tuple[int, set[str], Counter[tuple[str, str]], float] | None = None
    for sent, first in windows:
        inside = [c for c in calls if sent <= c[0] <= first]
        files = {c[2] for c in inside}
        edges = Counter((c[1], c[2]) for c in inside if c[1] and c[1] != c[2])
        crossing = sum(edges.values())
        if best is None or crossing < best[0]:
            best = (crossing, files, edges, first - sent)
    assert best is not None
    crossing, files, edges, seconds = best
    short = lambda path: path[len(root) :]  # noqa: E731
    print(f"one streamed request, sent → first byte ({seconds * 1000:.1f} ms, quietest of {args.requests}):")
    print(f"  product files crossed: {len(files)}")
    print(f"  cross-file calls:      {crossing} ({len(edges)} distinct caller → callee file pairs)")
    spine = sorted({short(caller) for caller, _ in edges})
    print(f"  the spine (files that call into another product file): {len(spine)}: {', '.join(spine)}")
    for path in sorted(files, key=short):
        print(f"    {short(path)}")
    print("  calls by file pair:")
    for (caller, callee), n in edges.most_common():
        print(f"    {n:4d}  {short(caller)} → {short(callee)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
