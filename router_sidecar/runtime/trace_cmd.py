"""`router-sidecar trace REQUEST_ID`: a request's journal as a readable timeline (stub, being built)."""

from __future__ import annotations

from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    raise SystemExit("router-sidecar trace: not built yet")
