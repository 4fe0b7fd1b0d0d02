"""Our own records (proto/router_sidecar/records/): the contract other programs rely on.

* v1 only grows: every field of the lock (records_v1.lock) keeps its number, type and label;
* the JSON mapping (codec.py): explicit nulls, `omit_unset`, `sparse`, integers as numbers, unknown fields
  and nulls read back; the attempt headers;
* every event the machines emit is a JournalEvent the schema knows (a static scan of the code);
* the JSON Schemas in docs/schema/ are current, and the records the code writes validate against them.
"""

from __future__ import annotations

import ast
import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from google.protobuf.descriptor import FieldDescriptor

from router_sidecar.coordination.registry_store import Replica
from router_sidecar.core import views
from router_sidecar.core.fingerprint import EngineInfo, Fingerprint
from router_sidecar.core.openai_api import RequestRejected, parse_request
from router_sidecar.core.routes import RouteKind
from router_sidecar.core.sse import terminal_error_frame
from router_sidecar.records import codec, schema
from router_sidecar.records import records_pb2 as rec
from tests.unit.test_views import _completed, new_request

REPO = Path(__file__).resolve().parents[2]
LOCK = Path(__file__).with_name("records_v1.lock")

_TYPE_NAMES = {
    getattr(FieldDescriptor, name): name[len("TYPE_") :].lower()
    for name in dir(FieldDescriptor)
    if name.startswith("TYPE_")
}


def current_fields() -> list[str]:
    lines = []
    for name, message in rec.DESCRIPTOR.message_types_by_name.items():
        for field in message.fields:
            kind = field.message_type.full_name if field.message_type else _TYPE_NAMES[field.type]
            label = "repeated" if field.is_repeated else "optional" if field.has_presence else "singular"
            lines.append(f"{name}.{field.name} {field.number} {kind} {label}")
    return lines


def locked_fields() -> list[str]:
    return [line for line in LOCK.read_text().splitlines() if line and not line.startswith("#")]


# --- v1 only grows -----------------------------------------------------------------------------------------


def test_no_released_field_changed_or_went() -> None:
    current = set(current_fields())
    changed = [line for line in locked_fields() if line not in current]
    assert changed == [], "a released field changed or went; add a new field instead (and `reserved` the old)"


def test_every_field_is_in_the_lock() -> None:
    new = [line for line in current_fields() if line not in set(locked_fields())]
    assert new == [], f"new fields: add them to {LOCK.name} once released:\n" + "\n".join(new)


def test_no_field_number_is_used_twice_across_the_lock() -> None:
    numbers = [(line.split()[0].split(".")[0], line.split()[1]) for line in locked_fields()]
    assert len(numbers) == len(set(numbers))


# --- the JSON mapping --------------------------------------------------------------------------------------


def test_unset_fields_are_null_unless_omitted_and_sparse_messages_list_only_what_is_set() -> None:
    attempt = rec.AttemptRecord(attempt=1, attempt_id="a1", replica="r:1", outcome="started")
    assert codec.to_dict(attempt) == {
        "attempt": 1,
        "attempt_id": "a1",
        "replica": "r:1",
        "outcome": "started",
        "detail": None,
        "status": None,
        "lease": None,
        "fence": None,
    }
    record = codec.to_dict(rec.JournalRecord(request_id="r"))
    assert "owner" not in record and "trace" not in record and "tool_calls_not_listed" not in record
    assert record["outcome"] is None and record["attempts"] == [] and record["input"] is None
    event = rec.JournalEvent(t=1.5, event="stream_reset", delivered_output_tokens=0, stream=False)
    assert codec.to_dict(event) == {
        "t": 1.5,
        "event": "stream_reset",
        "delivered_output_tokens": 0,
        "stream": False,
    }


def test_64_bit_integers_are_json_numbers_and_read_back() -> None:
    record = rec.InputRecord(route="chat.completions", digest="sha256:0", seed=-(2**63), stream=True)
    raw = codec.dumps(record)
    assert b'"seed":-9223372036854775808' in raw
    assert codec.loads(rec.InputRecord, raw).seed == -(2**63)
    assert (
        codec.loads(rec.AttemptProgress, b'{"bytes": "12", "at": 1}').bytes == 12
    )  # proto3's string form too


def test_a_newer_writer_s_fields_are_ignored_and_nulls_read_as_unset() -> None:
    raw = json.dumps({"bytes": 7, "at": 2.0, "added_in_v1_9": {"x": [1]}, "at_ms": None}).encode()
    assert codec.loads(rec.AttemptProgress, raw) == rec.AttemptProgress(bytes=7, at=2.0)
    attempt = codec.from_dict(rec.AttemptRecord, {"attempt": 2, "detail": None, "lease": None})
    assert not attempt.HasField("detail") and not attempt.HasField("lease") and attempt.attempt == 2


@pytest.mark.parametrize(
    "raw", [b"", b"[]", b"{", b'{"bytes": "many"}', b'{"bytes": -1}', b'{"at": {}}', b'"x"', b"\xff"]
)
def test_a_record_that_does_not_parse_is_a_record_error(raw: bytes) -> None:
    with pytest.raises(codec.RecordError, match="not a valid AttemptProgress"):
        codec.loads(rec.AttemptProgress, raw)


def test_attempt_headers_round_trip_and_the_optional_one_is_sent_only_when_set() -> None:
    sent = rec.AttemptHeaders(request_id="r1", attempt_id="a1", attempt_lease="")
    assert codec.to_headers(sent) == [("x-request-id", "r1"), ("x-attempt-id", "a1"), ("x-attempt-lease", "")]
    sent.traceparent = "00-" + "1" * 32 + "-" + "2" * 16 + "-01"
    headers = dict(codec.to_headers(sent))
    assert codec.from_headers(rec.AttemptHeaders, headers) == sent
    assert codec.header_names(rec.AttemptHeaders) == (
        "x-request-id",
        "x-attempt-id",
        "x-attempt-lease",
        "traceparent",
    )


def test_the_registry_value_is_the_same_bytes_as_before_the_schema() -> None:
    fingerprint = Fingerprint(model_id="m", block_size=16, lora_adapters=("a", "b"), engine_name="vllm")
    replica = Replica(
        address="127.0.0.1:8001",
        fingerprint=fingerprint,
        digest=fingerprint.digest(),
        engine_name="vllm",
        engine_version="0.11.0",
        engine=EngineInfo(root="/models/tiny", max_model_len=2048),
        registered_at=1700000000.25,
        agent_id="agent-1",
    )
    value = replica.to_value()
    assert value == (
        b'{"address":"127.0.0.1:8001","agent_id":"agent-1","digest":"' + fingerprint.digest().encode() + b'",'
        b'"engine":{"max_model_len":2048,"name":"vllm","root":"/models/tiny","version":"0.11.0"},'
        b'"fingerprint":{"attention_backend":null,"block_size":16,"chat_template_digest":null,'
        b'"engine_name":"vllm","engine_version":null,"kv_cache_dtype":null,"lora_adapters":["a","b"],'
        b'"model_id":"m","pipeline_parallel_size":null,"quantization":null,"tensor_parallel_size":null,'
        b'"tokenizer_digest":null,"weights_revision":null},"registered_at":1700000000.25}'
    )
    assert Replica.from_value(value) == replica


@pytest.mark.parametrize("missing", ["address", "digest", "agent_id", "fingerprint"])
def test_a_registration_without_a_required_field_is_refused(missing: str) -> None:
    doc = {
        "address": "a:1",
        "digest": "sha256:" + "0" * 64,
        "agent_id": "x",
        "fingerprint": {},
        "registered_at": 1,
    }
    del doc[missing]
    with pytest.raises(ValueError, match=missing):
        Replica.from_value(json.dumps(doc).encode())


@pytest.mark.parametrize("seed", [2**63, -(2**63) - 1, 10**30])
def test_a_seed_beyond_64_bits_is_a_clear_400(seed: int) -> None:
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], "seed": seed}).encode()
    with pytest.raises(RequestRejected) as caught:
        parse_request(RouteKind.CHAT, body, max_body_bytes=1 << 20)
    assert (caught.value.status, caught.value.param) == (400, "seed")


# --- every event the machines emit is in the schema --------------------------------------------------------

_EMITTERS = {"_emit", "_note", "Event", "ToolCallNoted"}


def _emitted_detail_names() -> dict[str, set[str]]:
    """Keyword names (and literal dict keys) passed as event detail anywhere in the product code."""
    found: dict[str, set[str]] = {}
    for path in (REPO / "router_sidecar").rglob("*.py"):
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if name not in _EMITTERS:
                continue
            names = {k.arg for k in node.keywords if k.arg is not None}
            for arg in node.args:
                if isinstance(arg, ast.Dict):
                    names |= {k.value for k in arg.keys if isinstance(k, ast.Constant)}
            for n in names:
                found.setdefault(n, set()).add(f"{path.relative_to(REPO)}:{node.lineno}")
    return found


def test_every_event_detail_the_code_emits_is_a_journal_event_field() -> None:
    known = set(rec.JournalEvent.DESCRIPTOR.fields_by_name)
    emitted = _emitted_detail_names()
    assert {"reason", "cause", "proof", "status", "route"} <= set(emitted)  # the scan finds them
    unknown = {name: sorted(where) for name, where in emitted.items() if name not in known}
    assert unknown == {}, "add these to JournalEvent in proto/router_sidecar/records/records.proto"


# --- the JSON Schemas --------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(schema.ROOTS))
def test_the_committed_schema_is_current(name: str) -> None:
    committed = (REPO / "docs/schema" / f"{name}.schema.json").read_text()
    assert committed == schema.render(schema.ROOTS[name], name), (
        "run `python -m router_sidecar.records.schema docs/schema` and commit the result"
    )
    jsonschema.Draft202012Validator.check_schema(json.loads(committed))


def validate(name: str, document: Any) -> None:
    jsonschema.Draft202012Validator(
        json.loads((REPO / "docs/schema" / f"{name}.schema.json").read_text())
    ).validate(document)


def test_what_the_code_writes_validates() -> None:
    frame = terminal_error_frame("req-1", 5)
    validate("terminal-frame", json.loads(frame.split(b"\n\n")[0].removeprefix(b"data: ")))
    validate("cancel-ack", codec.to_dict(rec.CancelAck(attempt_id="a", reason="lease_revoked", at=1.0)))
    validate("attempt-progress", codec.to_dict(rec.AttemptProgress(bytes=10, at=1.0)))
    fingerprint = Fingerprint(model_id="m", lora_adapters=())
    replica = Replica(
        address="a:1",
        fingerprint=fingerprint,
        digest=fingerprint.digest(),
        engine_name=None,
        engine_version=None,
        engine=EngineInfo(),
        registered_at=1.0,
        agent_id="x",
        draining=True,
    )
    validate("replica-registration", json.loads(replica.to_value()))


def test_a_record_missing_a_field_or_with_a_wrong_type_does_not_validate() -> None:
    good = codec.to_dict(rec.CancelAck(attempt_id="a", reason="lease_revoked", at=1.0))
    validate("cancel-ack", {**good, "added_later": 1})  # unknown fields are allowed
    for bad in ({k: v for k, v in good.items() if k != "reason"}, {**good, "at": "soon"}):
        with pytest.raises(jsonschema.ValidationError):
            validate("cancel-ack", bad)


def test_journal_records_and_errors_of_the_machines_validate() -> None:
    request = new_request()
    _completed(request)
    record = views.journal_view(request)
    record["events"] = [views.journal_event(e.as_record(1.0)) for e in request.drain_events()]
    validate("journal-record", record)
    assert {e["event"] for e in record["events"]} >= {"request_accepted", "stream_completed"}
