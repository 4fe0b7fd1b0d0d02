"""The gateway behind an endpoint picker (`gateway --endpoint-picker`), through real Envoy, etcd, the testbed's
picker and simulated replicas: the picker's list is the order of attempts, then ours; a replica that fails
before the first content is followed by the picker's next endpoint; after it, the terminal frame as always;
streams and large bodies pass whole through both filters; the picker's own answers reach the client as our
JSON errors, journaled; the picker down fails closed, or open when configured so."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.harness import Gateway, Sim, chat, poll, post
from tests.integration.epp_helpers import PickerProcess
from tests.integration.first_delta_helpers import assert_terminal_frame, finished, terminal_frames

pytestmark = pytest.mark.integration

SELECT = "test-epp-endpoint-selection"


@pytest.fixture(scope="module")
def sims(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Sim]]:
    work = tmp_path_factory.mktemp("sims")
    pool = {name: Sim(name, work) for name in ("a", "b", "c")}
    try:
        yield pool
    finally:
        for sim in pool.values():
            sim.stop()


@pytest.fixture(scope="module")
def picker(sims: dict[str, Sim], tmp_path_factory: pytest.TempPathFactory) -> Iterator[PickerProcess]:
    work = tmp_path_factory.mktemp("picker")
    process = PickerProcess(work, [s.endpoint for s in sims.values()], extra=("--log-header", "x-request-id"))
    try:
        yield process
    finally:
        process.stop()


@pytest.fixture(scope="module")
def gateway(
    etcd: str, sims: dict[str, Sim], picker: PickerProcess, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Gateway]:
    work: Path = tmp_path_factory.mktemp("gateway")
    gw = Gateway(
        replicas=[s.endpoint for s in sims.values()],
        etcd=etcd,
        work=work,
        extra_args=("--endpoint-picker", f"127.0.0.1:{picker.port}"),
    )
    try:
        yield gw
    finally:
        gw.stop()


@pytest.fixture(autouse=True)
def _all_up(sims: dict[str, Sim], gateway: Gateway) -> None:
    restarted = [sim.ensure_running() for sim in sims.values()]
    gateway.wait_replicas_healthy((s.endpoint for s in sims.values()), fresh=any(restarted))


def served_on(sims: dict[str, Sim], request_id: str, n: int) -> list[str]:
    """The replicas that saw the request's `n` attempts, by their own logs, in start order."""

    def logged() -> list[tuple[float, str]] | None:
        starts = [(r["t_start"], s.endpoint) for s in sims.values() for r in s.requests_for(request_id)]
        return sorted(starts) if len(starts) == n else None

    return [endpoint for _, endpoint in poll(logged, what=f"{n} attempt(s) in the replica logs")]


def complete(result: Any, tokens: int) -> None:
    data = result.data()
    assert result.status == 200 and result.transport_error is None, (result.status, result.transport_error)
    assert data[-1] == "[DONE]" and data.count("[DONE]") == 1
    assert len(result.content_chunks()) == tokens


def test_the_pickers_first_endpoint_serves_and_every_stream_arrives_whole(
    gateway: Gateway, sims: dict[str, Sim]
) -> None:
    endpoints = [s.endpoint for s in sims.values()]
    for i in range(12):
        chosen = endpoints[i % 3]
        result = post(f"{gateway.url}/v1/chat/completions", chat(max_tokens=6), headers={SELECT: chosen})
        complete(result, 6)
        journal = finished(gateway, result.request_id)
        destinations = journal["destinations"]
        assert destinations["picker"] == [chosen]
        assert destinations["order"][0] == chosen and destinations["source"] == "picker+gateway"
        assert [(a["replica"], a["chosen_by"]) for a in journal["attempts"]] == [(chosen, "picker choice #1")]
        assert served_on(sims, result.request_id, 1) == [chosen]


def test_a_failure_before_content_goes_to_the_pickers_next_endpoint(
    gateway: Gateway, sims: dict[str, Sim]
) -> None:
    first, second = sims["b"].endpoint, sims["c"].endpoint
    result = post(
        f"{gateway.url}/v1/chat/completions",
        chat(max_tokens=4),
        headers={SELECT: f"{first},{second}", "x-sim-fault": "reset@role attempt=1"},
    )
    complete(result, 4)
    journal = finished(gateway, result.request_id)
    assert [(a["replica"], a["chosen_by"]) for a in journal["attempts"]] == [
        (first, "picker choice #1"),
        (second, "picker choice #2"),
    ]
    assert served_on(sims, result.request_id, 2) == [first, second]


def test_after_content_the_terminal_frame_as_always(gateway: Gateway, sims: dict[str, Sim]) -> None:
    chosen = sims["a"].endpoint
    result = post(
        f"{gateway.url}/v1/chat/completions",
        chat(max_tokens=6),
        headers={SELECT: chosen, "x-sim-fault": "error@token:3"},
    )
    [frame] = terminal_frames(result)
    assert_terminal_frame(frame, result.request_id, 2)
    assert result.data()[-1] == "[DONE]"
    journal = finished(gateway, result.request_id)
    assert journal["outcome"] == "upstream_decode_interrupted" and len(journal["attempts"]) == 1
