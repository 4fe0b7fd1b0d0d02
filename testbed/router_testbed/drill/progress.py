"""Progress of a drill run on stderr: a bar redrawn in place on a terminal, one plain line per scenario
otherwise (a CI log, a pipe)."""

from __future__ import annotations

from typing import TextIO

BAR_WIDTH = 24


class Progress:
    def __init__(self, total: int, stream: TextIO, *, enabled: bool = True) -> None:
        self.total = total
        self.stream = stream
        self.enabled = enabled
        self.tty = enabled and stream.isatty()
        self.passed = 0
        self.failed = 0
        self.done = 0

    def _bar(self, current: str) -> str:
        filled = BAR_WIDTH * self.done // max(self.total, 1)
        tally = f"{self.passed} passed" + (f", {self.failed} failed" if self.failed else "")
        bar = "#" * filled + "." * (BAR_WIDTH - filled)
        return f"\r\033[K[{bar}] {self.done}/{self.total} {current} ({tally})"

    def start(self, name: str) -> None:
        if self.tty:
            self.stream.write(self._bar(f"running {name}"))
            self.stream.flush()

    def finish(self, name: str, passed: bool, seconds: float) -> None:
        self.done += 1
        if passed:
            self.passed += 1
        else:
            self.failed += 1
        if not self.enabled:
            return
        if self.tty:
            self.stream.write(self._bar(f"{name} {'PASS' if passed else 'FAIL'}"))
        else:
            verdict = "PASS" if passed else "FAIL"
            self.stream.write(f"drill [{self.done}/{self.total}] {name} {verdict} ({seconds:.1f}s)\n")
        self.stream.flush()

    def close(self) -> None:
        if self.tty:
            self.stream.write("\r\033[K")
            self.stream.flush()
