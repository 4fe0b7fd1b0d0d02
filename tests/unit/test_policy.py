from __future__ import annotations

import copy
import dataclasses
from pathlib import Path
from typing import Any

import pytest
import yaml

from router_sidecar.core.policy import (
    DEFAULT_POLICY,
    Budgets,
    Deadlines,
    Policy,
    PolicyError,
    load_policy,
    policy_from_mapping,
    policy_to_mapping,
)

EXAMPLE = Path(__file__).resolve().parents[2] / "policy.example.yaml"


def with_(path: str, value: Any, base: dict[str, Any] | None = None) -> dict[str, Any]:
    """A copy of the default mapping with the dotted `path` set to `value`."""
    m = copy.deepcopy(base if base is not None else policy_to_mapping(DEFAULT_POLICY))
    *parents, last = path.split(".")
    node = m
    for key in parents:
        node = node.setdefault(key, {})
    node[last] = value
    return m


def error(m: Any) -> PolicyError:
    with pytest.raises(PolicyError) as info:
        policy_from_mapping(m)
    return info.value


def test_defaults() -> None:
    p = load_policy(None)
    assert p is DEFAULT_POLICY
    bfd = p.before_first_delta
    assert bfd.require == {"source_attempt_fenced", "retry_budget_available"}
    assert (bfd.action, bfd.max_attempts) == ("retry_prefill_on_healthy_replica", 2)
    assert p.after_first_delta.automatic_retry is False
    assert p.after_first_delta.client_error == "upstream_decode_interrupted"
    assert p.uncertain_source_liveness.then == "retry_only_if_no_delta_was_sent"
    assert p.budgets == Budgets(20, 3, 64)
    assert p.reprefill_cost_cap.max_prompt_tokens == 32768
    assert p.deadlines == Deadlines(300, 1)
    assert p.leases.attempt_ttl_seconds == 10
    assert p.limits.max_request_body_bytes == 4194304
    assert p.journal.retention_seconds == 86400
    assert p.retries_enabled
    assert p.before_first_delta is p.on_upstream_failure.before_first_delta
    assert p.after_first_delta is p.on_upstream_failure.after_first_delta
    assert p.uncertain_source_liveness is p.on_upstream_failure.uncertain_source_liveness


@pytest.mark.parametrize("m", [None, {}, {"budgets": None}, {"on_upstream_failure": {}}])
def test_empty_means_defaults(m: Any) -> None:
    assert policy_from_mapping(m) == DEFAULT_POLICY


def test_example_file_is_the_defaults_and_shows_every_key() -> None:
    assert load_policy(str(EXAMPLE)) == DEFAULT_POLICY
    doc = yaml.safe_load(EXAMPLE.read_text())
    assert doc == policy_to_mapping(DEFAULT_POLICY)


def test_round_trip() -> None:
    assert policy_from_mapping(policy_to_mapping(DEFAULT_POLICY)) == DEFAULT_POLICY


def test_full_valid_file(tmp_path: Path) -> None:
    f = tmp_path / "policy.yaml"
    f.write_text(
        """
on_upstream_failure:
  before_first_delta:
    require: [source_attempt_fenced]
    action: retry_prefill_on_healthy_replica
    max_attempts: 3
  after_first_delta:
    action: terminate_stream
    client_error: upstream_decode_interrupted
    automatic_retry: false
  uncertain_source_liveness:
    action: fence_source_attempt
    wait_for: lease_expiry
    then: retry_only_if_no_delta_was_sent
budgets:
  retry_budget_percent: 12.5
  min_retry_concurrency: 0
  max_concurrent_retries: 8
reprefill_cost_cap:
  max_prompt_tokens: 1000
deadlines:
  request_seconds: 60
  connect_seconds: 0.25
leases:
  attempt_ttl_seconds: 5
limits:
  max_request_body_bytes: 65536
journal:
  retention_seconds: 3600
"""
    )
    p = load_policy(str(f))
    assert p.before_first_delta.require == {"source_attempt_fenced"}
    assert p.before_first_delta.max_attempts == 3
    assert p.uncertain_source_liveness.wait_for == "lease_expiry"
    assert p.budgets == Budgets(12.5, 0, 8)
    assert p.reprefill_cost_cap.max_prompt_tokens == 1000
    assert p.deadlines == Deadlines(60, 0.25)
    assert p.leases.attempt_ttl_seconds == 5
    assert p.limits.max_request_body_bytes == 65536
    assert p.journal.retention_seconds == 3600


def test_fail_request_policy_and_its_defaults() -> None:
    p = policy_from_mapping({"on_upstream_failure": {"before_first_delta": {"action": "fail_request"}}})
    assert not p.retries_enabled
    assert p.before_first_delta.max_attempts == 1
    assert p.uncertain_source_liveness.then == "fail_request"
    # without retries, the lease TTL need not fit in the deadline
    policy_from_mapping(
        {
            "on_upstream_failure": {"before_first_delta": {"action": "fail_request"}},
            "leases": {"attempt_ttl_seconds": 600},
        }
    )


def test_partial_sections_keep_other_defaults() -> None:
    p = policy_from_mapping({"budgets": {"retry_budget_percent": 50}})
    assert p.budgets == Budgets(50, 3, 64)
    assert dataclasses.replace(p, budgets=DEFAULT_POLICY.budgets) == DEFAULT_POLICY


def test_immutable() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        DEFAULT_POLICY.budgets.retry_budget_percent = 1  # type: ignore[misc]
    assert isinstance(DEFAULT_POLICY, Policy)


# --- errors -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("m", "path"),
    [
        ({"retries": 1}, "retries"),
        (
            {"on_upstream_failure": {"before_first_delta": {"max_attemps": 2}}},
            "on_upstream_failure.before_first_delta.max_attemps",
        ),
        ({"on_upstream_failure": {"after_delta": {}}}, "on_upstream_failure.after_delta"),
        (
            {"on_upstream_failure": {"uncertain_source_liveness": {"timeout": 1}}},
            "on_upstream_failure.uncertain_source_liveness.timeout",
        ),
        ({"budgets": {"retry_budget": 20}}, "budgets.retry_budget"),
        ({"deadlines": {"first_token_seconds": 5}}, "deadlines.first_token_seconds"),
        ({"leases": {"ttl": 5}}, "leases.ttl"),
        ({"limits": {"max_body": 5}}, "limits.max_body"),
        ({"journal": {"keep": 5}}, "journal.keep"),
        ({"reprefill_cost_cap": {"max_prompt_seconds": 5}}, "reprefill_cost_cap.max_prompt_seconds"),
    ],
)
def test_unknown_key_reports_dotted_path(m: dict[str, Any], path: str) -> None:
    e = error(m)
    assert e.path == path
    assert path in str(e)
    assert "unknown key; allowed here:" in str(e)


@pytest.mark.parametrize(
    ("path", "value"),
    [
        ("on_upstream_failure", [1]),
        ("budgets", "20%"),
        ("on_upstream_failure.before_first_delta.max_attempts", "2"),
        ("on_upstream_failure.before_first_delta.max_attempts", 2.0),
        ("on_upstream_failure.before_first_delta.max_attempts", True),
        ("on_upstream_failure.before_first_delta.require", "source_attempt_fenced"),
        ("on_upstream_failure.before_first_delta.action", ["retry_prefill_on_healthy_replica"]),
        ("on_upstream_failure.after_first_delta.automatic_retry", "false"),
        ("budgets.retry_budget_percent", "20"),
        ("budgets.retry_budget_percent", True),
        ("budgets.retry_budget_percent", float("nan")),
        ("budgets.min_retry_concurrency", 1.5),
        ("budgets.max_concurrent_retries", None),
        ("reprefill_cost_cap.max_prompt_tokens", "32k"),
        ("deadlines.request_seconds", "300s"),
        ("deadlines.connect_seconds", None),
        ("leases.attempt_ttl_seconds", 2.5),
        ("limits.max_request_body_bytes", "4MiB"),
        ("journal.retention_seconds", "1d"),
    ],
)
def test_wrong_types(path: str, value: Any) -> None:
    e = error(with_(path, value))
    assert e.path == path


def test_top_level_not_a_mapping() -> None:
    e = error(["on_upstream_failure"])
    assert e.path == ""
    assert "mapping" in str(e)


def test_automatic_retry_true_is_refused_with_the_reason() -> None:
    e = error(with_("on_upstream_failure.after_first_delta.automatic_retry", True))
    assert e.path == "on_upstream_failure.after_first_delta.automatic_retry"
    assert "must be false" in str(e)
    assert "two answers" in str(e)


@pytest.mark.parametrize(
    ("path", "value"),
    [
        ("on_upstream_failure.before_first_delta.max_attempts", 0),
        ("on_upstream_failure.before_first_delta.max_attempts", 11),
        ("on_upstream_failure.before_first_delta.max_attempts", -1),
        ("on_upstream_failure.before_first_delta.action", "retry_forever"),
        ("on_upstream_failure.before_first_delta.action", "continue_on_healthy_replica"),
        ("on_upstream_failure.after_first_delta.action", "retry_prefill_on_healthy_replica"),
        ("on_upstream_failure.after_first_delta.client_error", "oops"),
        ("on_upstream_failure.uncertain_source_liveness.action", "retry"),
        ("on_upstream_failure.uncertain_source_liveness.wait_for", "cancel_ack"),
        ("on_upstream_failure.uncertain_source_liveness.then", "retry_always"),
        ("budgets.retry_budget_percent", 101),
        ("budgets.retry_budget_percent", -1),
        ("budgets.min_retry_concurrency", -1),
        ("budgets.max_concurrent_retries", 0),
        ("reprefill_cost_cap.max_prompt_tokens", 0),
        ("deadlines.request_seconds", 0),
        ("deadlines.connect_seconds", 0),
        ("deadlines.connect_seconds", -1),
        ("leases.attempt_ttl_seconds", 0),
        ("limits.max_request_body_bytes", 0),
        ("journal.retention_seconds", 0),
    ],
)
def test_values_out_of_range(path: str, value: Any) -> None:
    e = error(with_(path, value))
    assert e.path == path
    assert "must be" in str(e)


@pytest.mark.parametrize(
    ("require", "path"),
    [
        (["retry_budget_available"], "on_upstream_failure.before_first_delta.require"),
        ([], "on_upstream_failure.before_first_delta.require"),
        (
            ["source_attempt_fenced", "source_attempt_fenced"],
            "on_upstream_failure.before_first_delta.require",
        ),
        (["source_attempt_fenced", "replica_healthy"], "on_upstream_failure.before_first_delta.require[1]"),
    ],
)
def test_require(require: list[str], path: str) -> None:
    e = error(with_("on_upstream_failure.before_first_delta.require", require))
    assert e.path == path


def test_require_may_omit_fencing_when_not_retrying() -> None:
    m = {"on_upstream_failure": {"before_first_delta": {"action": "fail_request", "require": []}}}
    assert policy_from_mapping(m).before_first_delta.require == frozenset()


@pytest.mark.parametrize(
    ("m", "path"),
    [
        # retry with a single attempt is no retry
        (
            {"on_upstream_failure": {"before_first_delta": {"max_attempts": 1}}},
            "on_upstream_failure.before_first_delta.max_attempts",
        ),
        # fail_request makes exactly one attempt
        (
            {"on_upstream_failure": {"before_first_delta": {"action": "fail_request", "max_attempts": 2}}},
            "on_upstream_failure.before_first_delta.max_attempts",
        ),
        (
            {
                "on_upstream_failure": {
                    "before_first_delta": {"action": "fail_request"},
                    "uncertain_source_liveness": {"then": "retry_only_if_no_delta_was_sent"},
                }
            },
            "on_upstream_failure.uncertain_source_liveness.then",
        ),
        ({"budgets": {"retry_budget_percent": 0, "min_retry_concurrency": 0}}, "budgets"),
        ({"deadlines": {"request_seconds": 1, "connect_seconds": 1}}, "deadlines.request_seconds"),
        (
            {"deadlines": {"request_seconds": 5}, "leases": {"attempt_ttl_seconds": 5}},
            "leases.attempt_ttl_seconds",
        ),
    ],
)
def test_impossible_combinations(m: dict[str, Any], path: str) -> None:
    assert error(m).path == path


def test_zero_budget_is_fine_without_the_budget_requirement() -> None:
    m = {
        "on_upstream_failure": {"before_first_delta": {"require": ["source_attempt_fenced"]}},
        "budgets": {"retry_budget_percent": 0, "min_retry_concurrency": 0},
    }
    assert policy_from_mapping(m).budgets.retry_budget_percent == 0


def test_load_errors(tmp_path: Path) -> None:
    with pytest.raises(PolicyError, match="cannot read"):
        load_policy(str(tmp_path / "missing.yaml"))
    bad = tmp_path / "bad.yaml"
    bad.write_text("budgets: [\n")
    with pytest.raises(PolicyError, match="not valid YAML"):
        load_policy(str(bad))
    dup = tmp_path / "dup.yaml"
    dup.write_text("budgets:\n  min_retry_concurrency: 1\n  min_retry_concurrency: 2\n")
    with pytest.raises(PolicyError, match="duplicate key 'min_retry_concurrency'"):
        load_policy(str(dup))
    empty = tmp_path / "empty.yaml"
    empty.write_text("# nothing\n")
    assert load_policy(str(empty)) == DEFAULT_POLICY
    typo = tmp_path / "typo.yaml"
    typo.write_text("on_upstream_failure:\n  after_first_delta:\n    automatic_retries: false\n")
    with pytest.raises(PolicyError) as info:
        load_policy(str(typo))
    assert info.value.path == "on_upstream_failure.after_first_delta.automatic_retries"
