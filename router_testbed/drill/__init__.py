"""`router-sidecar drill --gateway URL`: the failure scenarios against a running deployment (stub)."""

from __future__ import annotations

from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    raise SystemExit("router-sidecar drill: not built yet")
