"""A retry that lands warm, measured on real vLLM (issue 24 item 1): the gateway remembers which replica was
sent which prompt blocks and sends a retry where the longest prefix of its prompt is warm. Does that reach
vLLM's own prefix cache, and what does it buy the retry's time to first token?

Each round, through the gateway (real Envoy, etcd, the sidecar) on the tier's two replicas (vLLM 0.32 V1
on the CPU: prefix caching on by default, 128-token blocks, both read from `vllm:cache_config_info`):

* **warm**: a long prompt P (a system prompt of random words of the model's vocabulary, filling most of the
  tiny model's 1024-token context) and a question is sent until it has completed on replica a (the journal
  says where; a fresh P whenever it went to b). Then P with a new question: b's engine worker is frozen
  (SIGSTOP), requests are sent until one's first attempt lands on b, the worker is SIGKILLed (vLLM fails the
  request before any token: an in-band error), and the gateway retries on a.
* **cold**: the same with a prompt Q of the same length that was never sent before.

Recorded per round: the journal's `destinations` (the prompt's blocks, a's warm blocks) and the retry's
`chosen_by`; the retry's time to first content at the client (from the kill), in the gateway's journal (the
retry attempt's `attempt_started` to its `first_delta_sent`) and in vLLM (a's own `time_to_first_token` and
prefill time histograms); a's prefix-cache counters (`vllm:prefix_cache_queries`, `vllm:prefix_cache_hits`,
in tokens) and the tokens it computed in prefill (`vllm:request_prefill_kv_computed_tokens`), as deltas over
the retry alone. Asserted: only behaviour — the warm retry's journal shows a's warm prefix and chosen_by names
it, a's prefix-cache hits cover P's blocks; the cold retry is ranked with no warm block and hits no block of
a's cache. Timings are printed, never asserted (`-s` shows them; the last test prints medians and ratios).

Rounds alternate warm and cold; b is started again after each kill (25–50 s), the last one excepted (the next
module starts the replicas it needs). PREFIX_RETRY_ROUNDS (default 2) sets the rounds per case.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import statistics
import time
import uuid
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from router_testbed.real_engine import Installation
from tests.harness import Gateway, poll
from tests.real_engine.client import Streamed
from tests.real_engine.conftest import RESTART_TIMEOUT, TierVllmReplica
from tests.real_engine.tier import (
    CONTINUOUS_USAGE,
    assert_complete,
    assert_retried_on,
    chunk_has_content,
    serving_attempt,
    stopped,
    stream_chat,
    stream_until_routed_to,
    terminal_journal,
    wait_restarted,
)

ROUNDS = int(os.environ.get("PREFIX_RETRY_ROUNDS", "2"))
CASES = [(case, n) for n in range(1, ROUNDS + 1) for case in ("warm", "cold")]
MAX_TOKENS = 16
# The first request's prompt (system prompt + question, chat template included), in the model's tokens: the
# tiny model's context is 1024; MAX_TOKENS of output and a question a few tokens longer must still fit.
PROMPT_TOKENS = 960
CHOSEN_BY = re.compile(r"gateway choice #2 \(warm prefix (\d+) of (\d+) blocks, (\d+) in flight\)")

# vLLM 0.32's Prometheus names (vllm/v1/metrics/loggers.py); counters get `_total`, histograms `_sum`.
HITS = "vllm:prefix_cache_hits_total"  # tokens found in the prefix cache
QUERIES = "vllm:prefix_cache_queries_total"  # tokens looked up in it
FINISHED = "vllm:request_success_total"  # finished requests, every finish reason
TTFT = "vllm:time_to_first_token_seconds"
PREFILL = "vllm:request_prefill_time_seconds"
COMPUTED = "vllm:request_prefill_kv_computed_tokens"  # prompt tokens computed in prefill (not cached)


@dataclass
class Retry:
    """One round's retry on the target replica, as the client, the gateway and vLLM saw it."""

    case: str
    prompt_tokens: int
    prefix_blocks: int  # the prompt's blocks (gateway)
    warm_blocks: int  # of them, warm on the target (gateway)
    chosen_by: str
    first_failed: str  # the first attempt's failure, as journaled
    client_ttft: float  # the kill -> the first content event at the client
    failover: float  # the kill -> the retry attempt started (the gateway's clock)
    gateway_ttft: float  # the retry attempt started -> its first delta released (journal)
    engine_ttft: float  # vLLM's own time to first token for the retry
    engine_prefill: float  # vLLM's prefill time for it
    hits: int  # prefix-cache hits on the target during the retry, tokens
    queries: int
    computed: int  # prompt tokens the target computed

    def line(self) -> str:
        return (
            f"{self.case}: prompt {self.prompt_tokens} tokens, warm prefix {self.warm_blocks}/"
            f"{self.prefix_blocks} blocks; kill->first content {ms(self.client_ttft)} (kill->retry started "
            f"{ms(self.failover)}, retry started->first delta {ms(self.gateway_ttft)}); vLLM TTFT "
            f"{ms(self.engine_ttft)}, prefill {ms(self.engine_prefill)}, prefix-cache hits {self.hits}/"
            f"{self.queries} tokens, computed {self.computed}"
        )


MEASURED: dict[str, list[Retry]] = {"warm": [], "cold": []}


def ms(seconds: float) -> str:
    return f"{seconds * 1000:.1f} ms"


# --------------------------------------------------------------------------- the engine's numbers


def engine_metrics(replica: TierVllmReplica) -> dict[str, float]:
    """vLLM's /metrics, each sample's value summed over its labels (one engine, one model here)."""
    text = httpx.get(f"{replica.url}/metrics", timeout=10).text
    values: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        sample, _, value = line.rpartition(" ")
        name = sample.split("{", 1)[0]
        values[name] = values.get(name, 0.0) + float(value)
    return values


def cache_config(replica: TierVllmReplica) -> dict[str, str]:
    """The labels of vLLM's `vllm:cache_config_info` (block_size, enable_prefix_caching, ...)."""
    text = httpx.get(f"{replica.url}/metrics", timeout=10).text
    line = next((ln for ln in text.splitlines() if ln.startswith("vllm:cache_config_info{")), None)
    assert line is not None, "vLLM's /metrics has no vllm:cache_config_info"
    return dict(re.findall(r'(\w+)="([^"]*)"', line[: line.rindex("}")]))


def delta(after: dict[str, float], before: dict[str, float], name: str) -> float:
    return after.get(name, 0.0) - before.get(name, 0.0)


# --------------------------------------------------------------------------- prompts


def vocabulary(install: Installation) -> list[str]:
    """The tiny model's whole-word tokens (byte-level BPE: `Ġword`, one token with its leading space): a text
    of them is one token per word, ~6 bytes a token, so a prompt that fills the context has many of the
    gateway's 256-byte blocks as well as vLLM's 128-token ones."""
    vocab = json.loads((install.model / "tokenizer.json").read_text())["model"]["vocab"]
    found = [w[1:] for w in vocab if w.startswith("Ġ") and w[1:].isascii() and w[1:].isalpha()]
    assert len(found) >= 100, f"the tiny model's vocabulary has {len(found)} whole words"
    return found


def question() -> str:
    return f"Question {uuid.uuid4().hex[:8]}: and then?"


def chat(system: str, user: str) -> list[dict[str, Any]]:
    return [{"role": "system", "content": system}, {"role": "user", "content": user}]


def prompt_tokens(replica: TierVllmReplica, messages: list[dict[str, Any]]) -> int:
    """The chat's prompt in the model's tokens, chat template included (vLLM's /tokenize; no engine step)."""
    response = httpx.post(f"{replica.url}/tokenize", json={"model": "tiny", "messages": messages}, timeout=10)
    assert response.status_code == 200, response.text
    return int(response.json()["count"])


def long_system_prompt(replica: TierVllmReplica, vocab: list[str], user: str) -> str:
    """A system prompt never sent before (random words), as long as fits PROMPT_TOKENS beside `user`
    (bisected on its words: each is at least one token)."""
    rng = random.Random(uuid.uuid4().int)
    pool = [rng.choice(vocab) for _ in range(PROMPT_TOKENS)]
    low, high = 1, len(pool)
    while low < high:
        mid = (low + high + 1) // 2
        if prompt_tokens(replica, chat(" ".join(pool[:mid]), user)) <= PROMPT_TOKENS:
            low = mid
        else:
            high = mid - 1
    return " ".join(pool[:low])


# --------------------------------------------------------------------------- the scenario


def journal_time(journal: dict[str, Any], event: str, **match: Any) -> float:
    found = [
        e["t"]
        for e in journal.get("events", [])
        if e.get("event") == event and all(e.get(k) == v for k, v in match.items())
    ]
    assert found, f"no {event} {match} in the journal: {journal.get('events')}"
    return float(found[0])


def warm_up(target: TierVllmReplica, gateway: Gateway, vocab: list[str]) -> str:
    """A long system prompt that completed on `target` through the gateway (a fresh one whenever one went
    elsewhere)."""
    for _ in range(4):
        first = question()
        system = long_system_prompt(target, vocab, first)
        result = stream_chat(
            gateway.url,
            max_tokens=MAX_TOKENS,
            messages=chat(system, first),
            stream_options=CONTINUOUS_USAGE,
            headers={"Idempotency-Key": f"warmup-{uuid.uuid4().hex[:16]}"},
        )
        assert_complete(result, MAX_TOKENS)
        if serving_attempt(terminal_journal(gateway, result.request_id))["replica"] == target.endpoint:
            return system
    raise AssertionError(f"four long prompts, none served by {target.name}")


def retry_after_kill_in_prefill(
    case: str,
    target: TierVllmReplica,
    victim: TierVllmReplica,
    gateway: Gateway,
    replicas: dict[str, TierVllmReplica],
    vocab: list[str],
) -> Retry:
    """The round: (warm) P completed on the target; then a request whose first attempt lands on the victim,
    its engine worker frozen, then killed: the retry on the target, measured."""
    system = warm_up(target, gateway, vocab) if case == "warm" else None
    # Cold: a fresh prompt for every request sent (one served by the target while looking for the victim must
    # not warm it); made before the freeze, so that the victim stays frozen only while requests are sent.
    fresh = [long_system_prompt(target, vocab, question()) for _ in range(4)] if system is None else []
    first_content: dict[str, float] = {}

    def start(headers: dict[str, str]) -> Streamed:
        rid = headers["Idempotency-Key"]

        def on_chunk(chunk: Any, _: Streamed) -> bool:
            if rid not in first_content and chunk_has_content(chunk):
                first_content[rid] = time.monotonic()
            return False

        prompt = system if system is not None else fresh.pop()
        return stream_chat(
            gateway.url,
            max_tokens=MAX_TOKENS,
            messages=chat(prompt, question()),
            stream_options=CONTINUOUS_USAGE,
            headers=headers,
            on_chunk=on_chunk,
        )

    worker = victim.engine_worker_pid()
    assert worker is not None, f"no engine worker under {victim.name}: {victim.engine_pids()}"
    with stopped(worker):
        received = len(victim.received_request_ids())
        landed = stream_until_routed_to(
            victim, gateway, replicas, max_tokens=MAX_TOKENS, id_prefix=case, join=30, start=start
        )
        assert landed, f"no request's first attempt went to {victim.name}"
        # In the victim's engine (its worker frozen: no token can come), nothing delivered yet.
        poll(
            lambda: len(victim.received_request_ids()) > received,
            timeout=10,
            what=f"vLLM {victim.name} to receive the request",
        )
        assert landed.thread.is_alive()
        before = engine_metrics(target)
        os.kill(worker, signal.SIGKILL)
        killed, killed_wall = time.monotonic(), time.time()
    landed.thread.join(60)
    assert not landed.thread.is_alive(), "the client never finished"
    attempts = assert_retried_on(gateway, landed, victim, target, MAX_TOKENS)

    # Everything the target finished is in its metrics before the client reads the last event (vLLM records
    # an iteration's stats before its output handler yields); polled all the same.
    def counted() -> dict[str, float] | None:
        now = engine_metrics(target)
        return now if delta(now, before, FINISHED) >= 1 else None

    after = poll(counted, timeout=10, what=f"vLLM {target.name}'s metrics to count the retry")
    assert delta(after, before, FINISHED) == 1, "the target finished other requests during the retry"
    journal = terminal_journal(gateway, landed.request_id)
    destinations = journal["destinations"]
    ranked = {r["replica"]: r for r in destinations.get("ranked", [])}
    retry = attempts[1]
    started = journal_time(journal, "attempt_started", attempt=2)
    usage = landed.box["r"].chunks[-1].usage
    assert usage is not None
    measured = Retry(
        case=case,
        prompt_tokens=int(usage.prompt_tokens),
        prefix_blocks=int(destinations.get("prefix_blocks", 0)),
        warm_blocks=int(ranked.get(target.endpoint, {}).get("warm_blocks", 0)),
        chosen_by=str(retry.get("chosen_by")),
        first_failed=f"{attempts[0].get('detail')}",
        client_ttft=first_content[landed.request_id] - killed,
        failover=started - killed_wall,
        gateway_ttft=journal_time(journal, "first_delta_sent", attempt_id=retry["attempt_id"]) - started,
        engine_ttft=delta(after, before, f"{TTFT}_sum"),
        engine_prefill=delta(after, before, f"{PREFILL}_sum"),
        hits=round(delta(after, before, HITS)),
        queries=round(delta(after, before, QUERIES)),
        computed=round(delta(after, before, f"{COMPUTED}_sum")),
    )
    assert destinations["order"] == [victim.endpoint, target.endpoint], destinations
    assert target.endpoint in ranked, destinations
    return measured


# --------------------------------------------------------------------------- fixtures and tests


@pytest.fixture
def pair(replicas: dict[str, TierVllmReplica], gateway: Gateway) -> tuple[TierVllmReplica, TierVllmReplica]:
    """(target, victim): both up (the one a round killed waited for, or started again) and Envoy routing to
    both."""
    for replica in replicas.values():
        if not replica.alive():
            replica.stop()
            replica.start(wait=False)
    waited = [r for r in replicas.values() if not r.healthy()]
    for replica in waited:
        took = wait_restarted(replica, RESTART_TIMEOUT)
        print(f"\nreal_engine: vLLM {replica.name} ready {took:.1f}s after its start")
    gateway.wait_replicas_healthy([r.endpoint for r in replicas.values()], fresh=bool(waited), timeout=30)
    return replicas["a"], replicas["b"]


@pytest.mark.parametrize(("case", "n"), CASES, ids=[f"{case}-{n}" for case, n in CASES])
def test_a_retry_after_a_kill_in_prefill_lands_on_the_warm_prefix(
    case: str,
    n: int,
    gateway: Gateway,
    replicas: dict[str, TierVllmReplica],
    pair: tuple[TierVllmReplica, TierVllmReplica],
    install: Installation,
) -> None:
    target, victim = pair
    config = cache_config(target)
    assert config.get("enable_prefix_caching") == "True", config
    block = int(config["block_size"])
    vocab = vocabulary(install)
    try:
        retry = retry_after_kill_in_prefill(case, target, victim, gateway, replicas, vocab)
    finally:
        victim.stop()  # its engine is dead (or the round failed): started again for the next round
        if (case, n) != CASES[-1]:
            victim.start(wait=False)
    MEASURED[case].append(retry)
    print(f"\nreal_engine: {retry.line()}")
    print(f"real_engine:   first attempt: {retry.first_failed}; the retry's chosen_by: {retry.chosen_by}")
    why = CHOSEN_BY.fullmatch(retry.chosen_by)
    assert why is not None, retry.chosen_by
    assert (int(why[1]), int(why[2])) == (retry.warm_blocks, retry.prefix_blocks), retry
    assert retry.queries >= retry.prompt_tokens - 1, retry  # the whole prompt was looked up on the target
    if case == "warm":
        # The gateway knew the target was warm for all of P: only the block with the new question is not.
        assert retry.prefix_blocks > 0 and retry.warm_blocks >= retry.prefix_blocks - 1, retry
        # ...and vLLM found it: every whole block of the prompt but the one(s) holding the new question.
        assert retry.hits >= retry.prompt_tokens - 2 * block, retry
        assert retry.computed <= 2 * block, retry
    else:
        assert retry.warm_blocks == 0, retry
        assert retry.hits < block, retry  # not one block of a prompt never sent before
        assert retry.computed >= retry.prompt_tokens - block, retry


def test_warm_versus_cold_retry_summary() -> None:
    """The medians of the rounds above (printed, not asserted: timings on a shared CPU are not a contract)."""
    warm, cold = MEASURED["warm"], MEASURED["cold"]
    if not warm or not cold:
        pytest.skip("no warm and cold rounds were measured")
    print(f"\nreal_engine: warm versus cold retries, {len(warm)} + {len(cold)} rounds (median; cold / warm):")
    for label, read in [
        ("kill -> first content (client)", lambda r: r.client_ttft),
        ("kill -> retry started (gateway)", lambda r: r.failover),
        ("retry started -> first delta (gateway)", lambda r: r.gateway_ttft),
        ("vLLM time to first token", lambda r: r.engine_ttft),
        ("vLLM prefill time", lambda r: r.engine_prefill),
    ]:
        w, c = statistics.median(read(r) for r in warm), statistics.median(read(r) for r in cold)
        print(f"real_engine:   {label:40s} warm {w * 1000:7.1f} ms  cold {c * 1000:7.1f} ms  x{c / w:.2f}")
    for label, read in [
        ("prefix-cache hits (tokens)", lambda r: r.hits),
        ("prompt tokens computed", lambda r: r.computed),
        ("prompt tokens", lambda r: r.prompt_tokens),
    ]:
        print(f"real_engine:   {label:40s} warm {[read(r) for r in warm]}  cold {[read(r) for r in cold]}")
