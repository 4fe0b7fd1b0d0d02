"""Helpers for the hostile-input tests: a gateway whose only replica is the hostile one, a raw HTTP/1.1
client (exact bytes on the wire, both ways), process facts from /proc, and a time budget for the module."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import pytest

from tests.harness import Gateway
from tests.hostile_replica import HostileReplica

AUTH = {"authorization": "Bearer test-tenant"}
TERMINAL = {"completed", "interrupted", "cancelled", "rejected", "failed"}


# --------------------------------------------------------------------------- time budget


class Budget:
    """The whole module gets `seconds`; every client timeout is cut to what is left of it."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.started: float | None = None

    def start(self) -> None:
        if self.started is None:
            self.started = time.monotonic()

    def left(self) -> float:
        if self.started is None:
            return self.seconds
        return self.seconds - (time.monotonic() - self.started)

    def timeout(self, wanted: float) -> float:
        return max(1.0, min(wanted, self.left()))

    def check(self) -> None:
        if self.left() <= 0:
            pytest.fail(
                f"the hostile-input module's time budget ({self.seconds:.0f}s, HOSTILE_BUDGET_SECONDS) "
                "is spent: earlier tests waited on answers that never came"
            )


# --------------------------------------------------------------------------- processes


def child_pids(pid: int) -> list[int]:
    out: list[int] = []
    with contextlib.suppress(OSError):
        for task in Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(OSError):
                out += [int(x) for x in (task / "children").read_text().split()]
    return out


def envoy_child(pid: int) -> int | None:
    """The Envoy process the gateway supervises (a direct child of the gateway's Python process)."""
    for child in child_pids(pid):
        with contextlib.suppress(OSError):
            if Path(f"/proc/{child}/comm").read_text().strip() == "envoy":
                return child
            if b"envoy" in Path(f"/proc/{child}/cmdline").read_bytes().split(b"\0")[0]:
                return child
    return None


def status_kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


class RssSampler:
    """Samples a process's VmRSS every 20 ms in a thread; `peak_kib` is the largest seen."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.peak_kib = status_kib(pid, "VmRSS")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            with contextlib.suppress(OSError, KeyError, ValueError):
                self.peak_kib = max(self.peak_kib, status_kib(self.pid, "VmRSS"))

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(2)


# --------------------------------------------------------------------------- the gateway + hostile replica


class HostileStack:
    """One hostile replica and a gateway whose ONLY replica it is: every attempt, retries included, lands on
    it (Envoy's previous_hosts predicate falls back to the same host). A gateway found dead before a test
    is restarted (and counted), so one crash does not hide the outcome of every later test; the test that
    caused it still fails on its own Envoy-pid check."""

    def __init__(self, etcd: str, work: Path, replica: HostileReplica, budget: Budget) -> None:
        self.etcd = etcd
        self.work = work
        self.replica = replica
        self.budget = budget
        self.restarts = 0
        self.gateway = self._start_gateway()

    def _start_gateway(self) -> Gateway:
        work = self.work / f"gw{self.restarts}"
        work.mkdir(parents=True, exist_ok=True)
        # Its one replica answers 429 with Retry-After 7 in some tests: ejected for that long, every later
        # test would get the gateway's own 429. Ejections have tests of their own (test_retry_placement.py).
        policy = work / "policy.yaml"
        policy.write_text("placement:\n  max_retry_after_seconds: 0\n")
        return Gateway(replicas=[self.replica.endpoint], etcd=self.etcd, work=work, config=policy)

    @property
    def url(self) -> str:
        return self.gateway.url

    @property
    def port(self) -> int:
        return self.gateway.port

    def alive(self) -> bool:
        return self.gateway.proc.poll() is None and self.envoy_pid() is not None

    def envoy_pid(self) -> int | None:
        if self.gateway.proc.poll() is not None:
            return None
        return envoy_child(self.gateway.proc.pid)

    def ensure(self) -> None:
        self.replica.ensure_running()
        if not self.alive():
            self.gateway.stop()
            self.restarts += 1
            self.gateway = self._start_gateway()

    def stop(self) -> None:
        self.gateway.stop()

    def journal(self, request_id: str) -> tuple[int, dict[str, Any]]:
        return self.gateway.journal(request_id, AUTH)

    def finished(self, request_id: str, timeout: float = 10.0) -> dict[str, Any]:
        return self.gateway.wait_journal(
            request_id,
            lambda j: j.get("phase") in TERMINAL,
            timeout=self.budget.timeout(timeout),
            headers=AUTH,
        )


# --------------------------------------------------------------------------- raw HTTP/1.1


def dechunk(data: bytes) -> tuple[bytes, bool, str | None]:
    """(payload, complete, error) of a chunked body; lenient: stops at the first framing problem."""
    out = bytearray()
    pos = 0
    while True:
        idx = data.find(b"\r\n", pos)
        if idx < 0:
            return bytes(out), False, None
        line = data[pos:idx].split(b";", 1)[0].strip()
        try:
            size = int(line, 16)
        except ValueError:
            return bytes(out), False, "bad chunk size"
        if size == 0:
            return bytes(out), True, None
        start = idx + 2
        out += data[start : start + size]
        if len(data) < start + size + 2:
            return bytes(out), False, None
        if data[start + size : start + size + 2] != b"\r\n":
            return bytes(out), False, "bad chunk terminator"
        pos = start + size + 2


@dataclass
class RawResponse:
    raw: bytes  # everything received, head included
    error: str | None  # "reset", "timeout" or another transport error; None: the peer closed cleanly
    elapsed: float

    @cached_property
    def _split(self) -> tuple[bytes, bytes]:
        idx = self.raw.find(b"\r\n\r\n")
        if idx < 0:
            return self.raw, b""
        return self.raw[:idx], self.raw[idx + 4 :]

    @property
    def status_line(self) -> bytes:
        return self._split[0].split(b"\r\n", 1)[0]

    @property
    def status(self) -> int | None:
        parts = self.status_line.split(b" ")
        if len(parts) >= 2 and parts[0].startswith(b"HTTP/1.") and parts[1].isdigit() and len(parts[1]) == 3:
            return int(parts[1])
        return None

    @cached_property
    def headers(self) -> list[tuple[str, str]]:
        out: list[tuple[str, str]] = []
        for line in self._split[0].split(b"\r\n")[1:]:
            name, _, value = line.decode("latin-1").partition(":")
            out.append((name.strip().lower(), value.strip()))
        return out

    def header(self, name: str) -> str | None:
        return next((v for k, v in self.headers if k == name), None)

    @property
    def body_raw(self) -> bytes:
        return self._split[1]

    @property
    def chunked(self) -> bool:
        return "chunked" in (self.header("transfer-encoding") or "").lower()

    def payload(self) -> tuple[bytes, bool, str | None]:
        """(entity body, framing complete, framing error)."""
        if self.chunked:
            return dechunk(self.body_raw)
        length = self.header("content-length")
        if length is not None and length.isdigit():
            body = self.body_raw[: int(length)]
            return body, len(body) == int(length), None
        return self.body_raw, self.error is None, None

    @property
    def body(self) -> bytes:
        return self.payload()[0]

    def json(self) -> Any:
        return json.loads(self.body)


def build_request(
    method: str,
    target: str,
    *,
    host: str,
    body: bytes = b"",
    headers: list[tuple[str, str]] | None = None,
    content_length: int | None = None,
) -> bytes:
    lines = [f"{method} {target} HTTP/1.1", f"host: {host}", "connection: close"]
    lines += [f"{k}: {v}" for k, v in headers or []]
    if body or content_length is not None or method in ("POST", "PUT"):
        lines.append(f"content-length: {len(body) if content_length is None else content_length}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


def raw_request(
    port: int,
    data: bytes,
    *,
    timeout: float = 10.0,
    host: str = "127.0.0.1",
) -> RawResponse:
    """Send `data` as is and read until the peer closes (requests carry `connection: close`)."""
    started = time.monotonic()
    received = bytearray()
    error: str | None = None
    deadline = started + timeout
    with socket.create_connection((host, port), timeout=timeout) as sock:
        try:
            sock.sendall(data)
            while True:
                sock.settimeout(max(0.05, deadline - time.monotonic()))
                piece = sock.recv(65536)
                if not piece:
                    break
                received += piece
        except ConnectionResetError:
            error = "reset"
        except TimeoutError:
            error = "timeout"
        except OSError as exc:
            error = f"{type(exc).__name__}: {exc}"
    return RawResponse(bytes(received), error, time.monotonic() - started)


def first_difference(got: bytes, want: bytes) -> str:
    if got == want:
        return "identical"
    n = next((i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), min(len(got), len(want)))
    return (
        f"lengths got={len(got)} want={len(want)}; first difference at byte {n}:\n"
        f"  got : {got[max(0, n - 80) : n + 120]!r}\n  want: {want[max(0, n - 80) : n + 120]!r}"
    )


def assert_same_bytes(got: bytes, want: bytes, what: str = "bytes") -> None:
    if got != want:
        pytest.fail(f"{what} differ: {first_difference(got, want)}", pytrace=False)
