"""The simulator's JSONL request log: writer (used by the server) and reader helpers for tests.

Each request produces a ``"event":"start"`` line when it begins and an ``"event":"end"`` line when it
ends. Every line is one ``write`` of a complete ``\\n``-terminated record to a file opened with
``O_APPEND``, so lines from several simulator processes sharing one file never interleave.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

Record = dict[str, Any]
POLL_INTERVAL = 0.02


class RequestLog:
    """Append-only JSONL writer; a no-op when ``path`` is ``None``."""

    def __init__(self, path: str | os.PathLike[str] | None) -> None:
        self._fd: int | None = None
        if path is not None:
            self._fd = os.open(os.fspath(path), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def write(self, record: Record) -> None:
        if self._fd is None:
            return
        line = (json.dumps(record, separators=(",", ":")) + "\n").encode()
        os.write(self._fd, line)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def read_log(path: str | os.PathLike[str]) -> list[Record]:
    """All complete records in the log (a missing file is an empty log; a torn last line is skipped)."""
    try:
        data = Path(path).read_bytes()
    except FileNotFoundError:
        return []
    records: list[Record] = []
    for line in data.split(b"\n"):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def wait_for(
    path: str | os.PathLike[str], predicate: Callable[[Record], bool], timeout: float = 5.0
) -> Record:
    """Poll the log every 20 ms until a record matches ``predicate``; return the first match.

    Raises :class:`TimeoutError` listing the records seen when ``timeout`` seconds pass first.
    """
    deadline = time.monotonic() + timeout
    while True:
        records = read_log(path)
        for record in records:
            if predicate(record):
                return record
        if time.monotonic() >= deadline:
            seen = "\n".join(json.dumps(r) for r in records) or "(no records)"
            raise TimeoutError(f"no matching record in {os.fspath(path)} within {timeout}s; seen:\n{seen}")
        time.sleep(POLL_INTERVAL)
