"""What the picker decides for one request, from its headers and the data plane's subset hint (no I/O).

* ``test-epp-answer: 503`` or ``429`` (or ``--answer``): the picker answers itself, as the protocol lets an
  endpoint picker do when no endpoint is ready (503) or the request is shed (429); with
  ``test-epp-retry-after: VALUE``, its answer carries ``Retry-After: VALUE``.
* ``test-epp-endpoint-selection: A[,B...]``: the list is those endpoints, in the header's order, as GAIE's
  reference pickers honour the header for deterministic tests (an entry is ``IP:PORT``, or a bare ``IP``
  naming every known endpoint on that address; unknown entries are dropped, repeats kept once). None known:
  503, as a reference picker whose candidate set the header emptied.
* otherwise round robin: the known endpoints rotated by one per request, cut to ``list_size``.

A subset hint (``envoy.lb.subset_hint`` / ``x-gateway-destination-endpoint-subset``) restricts every choice to
the endpoints it names; an empty restriction is a 503, as protocol v1.0.0 requires.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

SELECTION_HEADER = "test-epp-endpoint-selection"
ANSWER_HEADER = "test-epp-answer"
RETRY_AFTER_HEADER = "test-epp-retry-after"  # with its own answer: a `Retry-After` of this value
ANSWERS = {503: "no ready endpoint", 429: "request shed"}


@dataclass(frozen=True)
class Endpoint:
    host: str  # an IP literal, without brackets
    port: int

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


def parse_endpoint(text: str) -> Endpoint:
    """`IP:PORT` or `[IPv6]:PORT`. Envoy's override_host policy matches addresses, never names."""
    host, sep, port = text.strip().rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"expected IP:PORT, got {text!r}")
    bracketed = host.startswith("[") and host.endswith("]")
    host = host[1:-1] if bracketed else host
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        raise ValueError(
            f"expected an IP address (Envoy matches addresses, not names), got {text!r}"
        ) from None
    if address.version == 6 and not bracketed:
        raise ValueError(f"write an IPv6 endpoint as [ADDRESS]:PORT, got {text!r}")
    return Endpoint(str(address), int(port))


@dataclass(frozen=True)
class Decision:
    endpoints: tuple[Endpoint, ...] = ()
    status: int | None = None  # the picker's own answer (503, 429) instead of a list
    reason: str = ""  # round_robin, selection_header, answer_header, answer_flag, no_endpoint

    @property
    def value(self) -> str:
        """The `x-gateway-destination-endpoint` value: the list, comma-separated, no spaces."""
        return ",".join(map(str, self.endpoints))


class Picker:
    """Round robin over the configured endpoints, steered per request by the test headers."""

    def __init__(
        self, endpoints: Sequence[Endpoint], *, list_size: int | None = None, answer: int | None = None
    ):
        if not endpoints:
            raise ValueError("at least one endpoint")
        if answer is not None and answer not in ANSWERS:
            raise ValueError(f"the picker answers 503 or 429 itself, not {answer}")
        self.endpoints = tuple(dict.fromkeys(endpoints))
        self.list_size = len(self.endpoints) if list_size is None else max(1, list_size)
        self.answer = answer
        self._next = 0

    def decide(self, headers: dict[str, str], subset: Iterable[str] | None = None) -> Decision:
        wanted = headers.get(ANSWER_HEADER, "").strip()
        if wanted:
            status = int(wanted) if wanted.isdigit() and int(wanted) in ANSWERS else 503
            return Decision(status=status, reason="answer_header")
        if self.answer is not None:
            return Decision(status=self.answer, reason="answer_flag")
        candidates = self.endpoints
        if subset is not None:
            allowed = set(_resolve(subset, self.endpoints))
            candidates = tuple(e for e in self.endpoints if e in allowed)
        selection = headers.get(SELECTION_HEADER, "").strip()
        if selection:
            chosen = tuple(_resolve(selection.split(","), candidates))
            if not chosen:
                return Decision(status=503, reason="no_endpoint")
            return Decision(endpoints=chosen, reason="selection_header")
        if not candidates:
            return Decision(status=503, reason="no_endpoint")
        start = self._next % len(candidates)
        self._next += 1
        rotated = candidates[start:] + candidates[:start]
        return Decision(endpoints=rotated[: self.list_size], reason="round_robin")


def _resolve(entries: Iterable[str], known: Sequence[Endpoint]) -> list[Endpoint]:
    """The known endpoints the entries name, in the entries' order, each once."""
    out: dict[Endpoint, None] = {}
    for raw in entries:
        item = raw.strip()
        if not item:
            continue
        try:
            wanted = [parse_endpoint(item)]
        except ValueError:
            try:
                host = str(ipaddress.ip_address(item.strip("[]")))
            except ValueError:
                continue  # neither IP:PORT nor an IP: names nothing
            wanted = [e for e in known if e.host == host]  # a bare IP: every endpoint on it
        for endpoint in wanted:
            if endpoint in known:
                out.setdefault(endpoint)
    return list(out)
