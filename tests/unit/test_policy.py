"""The operator policy: defaults, the example file, every key's type and bounds (generated from the schema,
so a new key is covered without a new test), unknown keys, null sections and the impossible combinations.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import math
import re
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

import pytest
import yaml

from router_sidecar.core.policy import (
    DEFAULT_POLICY,
    Budgets,
    Deadlines,
    Policy,
    PolicyError,
    PolicyKey,
    load_policy,
    policy_from_mapping,
    policy_keys,
    policy_to_mapping,
    route_policy,
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


def value_at(policy: Policy, path: str) -> Any:
    return functools.reduce(getattr, path.split("."), policy)


KEYS = policy_keys()


def sections() -> list[str]:
    """Every section's dotted path, "" for the document itself."""
    found = {""}
    for key in KEYS:
        parts = key.path.split(".")
        found.update(".".join(parts[:i]) for i in range(1, len(parts)))
    return sorted(found)


def children(section: str) -> list[str]:
    """The keys allowed directly under `section`, in declaration order."""
    prefix = f"{section}." if section else ""
    names: list[str] = []
    for key in KEYS:
        if key.path.startswith(prefix) and (name := key.path[len(prefix) :].split(".")[0]) not in names:
            names.append(name)
    return names


def test_defaults() -> None:
    p = load_policy(None)
    assert p is DEFAULT_POLICY
    bfd = p.before_first_delta
    assert bfd.require == {"source_attempt_fenced", "retry_budget_available"}
    assert (bfd.action, bfd.max_attempts) == ("retry_prefill_on_healthy_replica", 2)
    assert p.uncertain_source_liveness.then == "retry_only_if_no_delta_was_sent"
    assert p.budgets == Budgets(50, 3)
    assert p.reprefill_cost_cap.max_prompt_tokens == 32768
    assert p.deadlines == Deadlines(300, 1)
    assert p.upstream_connections.idle_timeout_seconds == 4  # below the engines' 5 s keep-alive
    assert p.leases.attempt_ttl_seconds == 10
    assert p.limits.max_request_body_bytes == 4194304
    assert p.journal.retention_seconds == 86400
    assert p.retries_enabled
    assert p.before_first_delta is p.on_upstream_failure.before_first_delta
    assert p.uncertain_source_liveness is p.on_upstream_failure.uncertain_source_liveness


def test_defaults_of_the_limits_journal_tools_and_tenancy_keys() -> None:
    p = DEFAULT_POLICY
    assert p.limits.max_held_response_bytes == 262144
    assert p.limits.max_event_bytes == 1048576
    assert p.limits.max_json_depth == 64
    assert p.journal.max_events == 256
    assert p.tools.max_calls_per_request == 64
    assert p.tenancy.refuse_anonymous is True
    assert p.tenancy.secret_file is None


def test_every_key_has_a_one_line_doc() -> None:
    assert KEYS
    for key in KEYS:
        assert key.spec.doc.strip(), key.path
        assert "\n" not in key.spec.doc, key.path


def test_schema_keys_are_the_mapping_keys() -> None:
    def leaves(m: dict[str, Any], prefix: str = "") -> Iterator[str]:
        for name, v in m.items():
            path = f"{prefix}{name}"
            yield from leaves(v, f"{path}.") if isinstance(v, dict) else [path]

    assert list(leaves(policy_to_mapping(DEFAULT_POLICY))) == [key.path for key in KEYS]


@pytest.mark.parametrize("m", [None, {}, {"budgets": None}, {"on_upstream_failure": {}}])
def test_empty_means_defaults(m: Any) -> None:
    assert policy_from_mapping(m) == DEFAULT_POLICY


def test_example_file_is_the_defaults_and_shows_every_key() -> None:
    assert load_policy(str(EXAMPLE)) == DEFAULT_POLICY
    doc = yaml.safe_load(EXAMPLE.read_text())
    assert doc.pop("routes") == []  # per-route overlays: none by default (tests/unit/test_route_policy.py)
    assert doc == policy_to_mapping(DEFAULT_POLICY)


def test_example_file_comments_every_key() -> None:
    for line in EXAMPLE.read_text().splitlines():
        if re.match(r"\s*\w+:\s*[^\s#]", line):  # a key with a value
            assert "#" in line, line


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
  uncertain_source_liveness:
    wait_for: lease_expiry
    then: retry_only_if_no_delta_was_sent
budgets:
  retry_budget_percent: 12.5
  min_retry_concurrency: 0
reprefill_cost_cap:
  max_prompt_tokens: 1000
deadlines:
  request_seconds: 60
  connect_seconds: 0.25
upstream_connections:
  idle_timeout_seconds: 2.5
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
    assert p.budgets == Budgets(12.5, 0)
    assert p.reprefill_cost_cap.max_prompt_tokens == 1000
    assert p.deadlines == Deadlines(60, 0.25)
    assert p.upstream_connections.idle_timeout_seconds == 2.5
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
    p = policy_from_mapping({"budgets": {"retry_budget_percent": 20}})
    assert p.budgets == Budgets(20, 3)
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
        ("upstream_connections.idle_timeout_seconds", "4s"),
        ("budgets.retry_budget_percent", "20"),
        ("budgets.retry_budget_percent", True),
        ("budgets.retry_budget_percent", float("nan")),
        ("budgets.min_retry_concurrency", 1.5),
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


# Keys that once took one value and changed nothing: the rules they named are fixed. A policy that still sets
# one (with the value it used to accept, or any other) is refused, naming the key, the rule and what to do.
FIXED_RULE_KEYS = [
    ("on_upstream_failure.after_first_delta.action", "terminate_stream", "terminal error frame"),
    (
        "on_upstream_failure.after_first_delta.client_error",
        "upstream_decode_interrupted",
        "upstream_decode_int",
    ),
    ("on_upstream_failure.after_first_delta.automatic_retry", False, "never an automatic retry"),
    ("on_upstream_failure.uncertain_source_liveness.action", "fence_source_attempt", "always fenced first"),
]


@pytest.mark.parametrize(("path", "value", "rule"), FIXED_RULE_KEYS)
def test_a_key_of_a_fixed_rule_is_refused_with_the_rule_and_what_to_do(
    path: str, value: Any, rule: str
) -> None:
    for given in (value, "anything else"):
        e = error(with_(path, given))
        assert e.path == path
        assert "is not configurable (the rule is fixed:" in str(e)
        assert rule in str(e)
        assert "remove the key" in str(e)


def test_the_after_first_delta_section_is_refused_whole() -> None:
    for given in (None, {}, {"unknown": 1}):
        e = error({"on_upstream_failure": {"after_first_delta": given}})
        assert e.path == "on_upstream_failure.after_first_delta"
        assert "its rules are fixed" in str(e) and "remove the section" in str(e)


def test_the_old_example_policy_is_refused_at_its_first_fixed_key(tmp_path: Path) -> None:
    f = tmp_path / "policy.yaml"
    f.write_text(
        "on_upstream_failure:\n"
        "  after_first_delta:\n"
        "    action: terminate_stream\n"
        "    client_error: upstream_decode_interrupted\n"
        "    automatic_retry: false\n"
    )
    with pytest.raises(PolicyError) as raised:
        load_policy(str(f))
    assert raised.value.path == "on_upstream_failure.after_first_delta.action"


def test_a_route_overlay_setting_a_fixed_rule_is_refused() -> None:
    with pytest.raises(PolicyError) as raised:
        route_policy(
            DEFAULT_POLICY, {"on_upstream_failure": {"after_first_delta": {"automatic_retry": False}}}
        )
    assert raised.value.path == "on_upstream_failure.after_first_delta.automatic_retry"


@pytest.mark.parametrize(
    ("path", "value"),
    [
        ("on_upstream_failure.before_first_delta.max_attempts", 0),
        ("on_upstream_failure.before_first_delta.max_attempts", 11),
        ("on_upstream_failure.before_first_delta.max_attempts", -1),
        ("on_upstream_failure.before_first_delta.action", "retry_forever"),
        ("on_upstream_failure.before_first_delta.action", "continue_on_healthy_replica"),
        ("upstream_connections.idle_timeout_seconds", 0),
        ("upstream_connections.idle_timeout_seconds", 3601),
        ("on_upstream_failure.uncertain_source_liveness.wait_for", "cancel_ack"),
        ("on_upstream_failure.uncertain_source_liveness.then", "retry_always"),
        ("budgets.retry_budget_percent", 101),
        ("budgets.retry_budget_percent", -1),
        ("budgets.min_retry_concurrency", -1),
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
        ({"deadlines": {"request_seconds": 10, "connect_seconds": 10}}, "deadlines.request_seconds"),
        (
            {"deadlines": {"request_seconds": 8}, "leases": {"attempt_ttl_seconds": 8}},
            "leases.attempt_ttl_seconds",
        ),
        # a duplicate tool call waits inside Envoy's admission timeout, derived from the request deadline
        (
            {"deadlines": {"request_seconds": 30}, "tools": {"in_progress_wait_seconds": 25}},
            "tools.in_progress_wait_seconds",
        ),
        ({"tools": {"in_progress_wait_seconds": 295}}, "tools.in_progress_wait_seconds"),
    ],
)
def test_impossible_combinations(m: dict[str, Any], path: str) -> None:
    assert error(m).path == path


def test_impossible_combinations_say_why() -> None:
    e = error({"deadlines": {"request_seconds": 30}, "tools": {"in_progress_wait_seconds": 25}})
    assert "must be less than deadlines.request_seconds minus 5 (25)" in str(e)
    e = error({"on_upstream_failure": {"before_first_delta": {"require": ["retry_budget_available"]}}})
    assert "must include source_attempt_fenced" in str(e)
    e = error({"on_upstream_failure": {"before_first_delta": {"max_attempts": 1}}})
    assert "allows no retry" in str(e)


def test_tool_wait_just_inside_the_admission_timeout() -> None:
    m = {"deadlines": {"request_seconds": 30}, "tools": {"in_progress_wait_seconds": 24.9}}
    assert policy_from_mapping(m).tools.in_progress_wait_seconds == 24.9


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
    typo.write_text("on_upstream_failure:\n  before_first_delta:\n    max_attempt: 2\n")
    with pytest.raises(PolicyError) as info:
        load_policy(str(typo))
    assert info.value.path == "on_upstream_failure.before_first_delta.max_attempt"


# --- generated from the schema: every key, every section, every bound --------------------------


def test_new_keys_from_a_file(tmp_path: Path) -> None:
    f = tmp_path / "policy.yaml"
    f.write_text(
        """
limits: {max_held_response_bytes: 65536, max_event_bytes: 8192, max_json_depth: 16}
journal: {max_events: 64}
tools: {max_calls_per_request: 8}
tenancy:
  refuse_anonymous: no          # YAML 1.1: a boolean
  secret_file: /run/secrets/tenant
"""
    )
    p = load_policy(str(f))
    assert (p.limits.max_held_response_bytes, p.limits.max_event_bytes, p.limits.max_json_depth) == (
        65536,
        8192,
        16,
    )
    assert (p.journal.max_events, p.tools.max_calls_per_request) == (64, 8)
    assert p.tenancy == dataclasses.replace(
        p.tenancy, refuse_anonymous=False, secret_file="/run/secrets/tenant"
    )
    assert p.tenancy.refuse_anonymous is False


def test_a_quoted_boolean_is_a_string(tmp_path: Path) -> None:
    f = tmp_path / "policy.yaml"
    f.write_text('tenancy:\n  refuse_anonymous: "true"\n')
    with pytest.raises(PolicyError) as info:
        load_policy(str(f))
    assert info.value.path == "tenancy.refuse_anonymous"
    assert "must be true or false" in str(info.value)


@pytest.mark.parametrize("section", sections(), ids=lambda s: s or "<document>")
def test_unknown_key_in_every_section(section: str) -> None:
    path = f"{section}.no_such_key" if section else "no_such_key"
    e = error(with_(path, 1, base={}))
    assert e.path == path
    assert f"unknown key; allowed here: {', '.join(children(section))}" in str(e)


@pytest.mark.parametrize("section", [s for s in sections() if s])
def test_null_section_means_its_defaults(section: str) -> None:
    assert policy_from_mapping(with_(section, None, base={})) == DEFAULT_POLICY
    assert policy_from_mapping(with_(section, None)) == DEFAULT_POLICY  # the other sections given in full


@pytest.mark.parametrize("section", [s for s in sections() if s])
def test_section_not_a_mapping(section: str) -> None:
    e = error(with_(section, [1], base={}))
    assert e.path == section
    assert "must be a mapping" in str(e)


def wrong_values(kind: Any) -> list[Any]:
    """Values of a wrong type (or outside a Literal) for a key of type `kind`."""
    origin = get_origin(kind)
    if kind is int:
        return ["1", 1.5, 2.0, True, None, [1]]
    if kind is float:
        return ["1", True, False, None, math.nan, math.inf, -math.inf, [1.0]]
    if kind is bool:
        return ["true", "yes", 1, 0, None]
    if kind is str:
        return [1, True, "", "  ", ["x"]]
    if origin is Literal:
        allowed = get_args(kind)
        # a YAML spelling as a string, and 0/1 standing for a boolean, are not the value
        spelled = [str(a).lower() for a in allowed if not isinstance(a, str)]
        ints = [int(a) for a in allowed if isinstance(a, bool)]
        return [None, "no_such_value", list(allowed), *spelled, *ints]
    if origin is frozenset:
        return [get_args(get_args(kind)[0])[0], None, {"a": 1}]
    if origin is tuple:
        return ["name", None, {"a": 1}, [1], [""], ["a", "a"]]
    if origin in (Union, types.UnionType):
        return [v for option in get_args(kind) if option is not type(None) for v in wrong_values(option)]
    raise AssertionError(f"no wrong values for {kind!r}: extend this test")


@pytest.mark.parametrize(
    ("path", "value"),
    [(key.path, v) for key in KEYS for v in wrong_values(key.type)],
    ids=lambda x: repr(x) if not isinstance(x, str) or "." not in x else x,
)
def test_wrong_type_of_every_key(path: str, value: Any) -> None:
    e = error(with_(path, value))
    assert e.path == path
    assert "must be" in str(e)


@pytest.mark.parametrize("key", [k for k in KEYS if k.type is float], ids=lambda k: k.path)
def test_an_int_is_a_fine_number(key: PolicyKey) -> None:
    value = int(key.default)
    assert value == key.default, "pick an integral default or another value here"
    got = value_at(policy_from_mapping(with_(key.path, value)), key.path)
    assert (got, type(got)) == (value, float)


# Some values at a bound break a cross-field rule with the other keys at their defaults; these are set too.
COMPANIONS: dict[tuple[str, str], dict[str, Any]] = {
    # max_attempts 1 is what fail_request makes
    ("on_upstream_failure.before_first_delta.max_attempts", "lo"): {
        "on_upstream_failure": {"before_first_delta": {"action": "fail_request"}}
    },
    # just above 5 s: the lease TTL must fit in the deadline
    ("deadlines.request_seconds", "lo"): {"leases": {"attempt_ttl_seconds": 1}},
}


def step(kind: Any, x: float, direction: int) -> float:
    """The next value of `kind` from `x` towards `direction` (-1 or +1)."""
    return x + direction if kind is int else math.nextafter(x, direction * math.inf)


def bound_cases() -> Iterator[Any]:
    """(key, side, value, accepted) at and beyond both bounds of every bounded key."""
    for key in KEYS:
        spec = key.spec
        for side, bound, is_open in (("lo", spec.lo, spec.open_lo), ("hi", spec.hi, spec.open_hi)):
            if bound is None:
                continue
            outwards = -1 if side == "lo" else 1
            cases = [(bound, not is_open), (step(key.type, bound, outwards), False)]
            if is_open:
                cases.append((step(key.type, bound, -outwards), True))
            for value, accepted in cases:
                verdict = "ok" if accepted else "refused"
                yield pytest.param(key, side, value, accepted, id=f"{key.path}-{side}={value!r}-{verdict}")


def test_bounds_are_on_numbers_only() -> None:
    for key in KEYS:
        if key.spec.lo is not None or key.spec.hi is not None:
            assert key.type in (int, float), key.path


@pytest.mark.parametrize(("key", "side", "value", "accepted"), list(bound_cases()))
def test_every_bound(key: PolicyKey, side: str, value: float, accepted: bool) -> None:
    m = with_(key.path, value, base=COMPANIONS.get((key.path, side), {}))
    if accepted:
        assert value_at(policy_from_mapping(m), key.path) == value
    else:
        e = error(m)
        assert e.path == key.path
        bound = key.spec.lo if side == "lo" else key.spec.hi
        assert re.search(rf"must be .*\b{bound}\b", str(e)), str(e)


def test_bounded_keys_include_the_new_limits() -> None:
    bounded = {key.path: (key.spec.lo, key.spec.hi) for key in KEYS}
    assert bounded["limits.max_held_response_bytes"] == (4096, 524288)
    assert bounded["limits.max_event_bytes"] == (4096, 16777216)
    assert bounded["limits.max_json_depth"] == (8, 512)
    assert bounded["journal.max_events"] == (32, 4096)
    assert bounded["tools.max_calls_per_request"] == (1, 1024)
