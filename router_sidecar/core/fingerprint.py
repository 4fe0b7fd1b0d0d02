"""The compatibility fingerprint of a replica (pure: no IO, no clock).

A retry may only land on a replica that would compute the same thing as the pinned one (docs/design.md,
invariant 7). Two replicas are *compatible* exactly when their fingerprints have the same digest.

Where the facts come from:

* the operator's fingerprint file (YAML or JSON, flat mapping of the field names below; unknown keys
  are errors) for what the engine cannot tell: weights revision, quantization, tokenizer and
  chat-template digests, attention backend, KV-cache dtype, block size, parallelism;
* the engine for what it reports about itself: vLLM (``/v1/models``, ``/version``) the model id, LoRA
  adapters, engine name and version; SGLang (``/v1/models`` with ``owned_by: "sglang"``,
  ``/get_model_info``, ``/get_server_info``) those too, and the weights version it was started with or
  updated to, its attention backend, KV-cache dtype, page (block) size and parallelism (see
  :func:`from_sglang`).

Merge rule (:func:`merge`): a field is taken from whichever source states it. When both state it, the
values must be equal after normalisation; otherwise it is a :class:`FingerprintConflict` naming every
differing field, because a file that disagrees with the running engine is a deployment mistake and
registering either value would be a lie. A field neither source states stays ``None`` ("unknown").
Unknown is part of the digest (as JSON ``null``): an unknown field never matches a known one, and the
agent warns about every unknown field at start-up.

Normalisation (every :class:`Fingerprint` is normalised on construction, so equal meaning gives equal
objects and equal digests):

* all strings: Unicode NFC, surrounding whitespace stripped; an empty string is an error (omit the key
  if the value is unknown);
* ``model_id``, ``lora_adapters``: case kept: served model and adapter names are case-sensitive in the
  OpenAI API;
* ``weights_revision``: case kept, except a hex commit id (7–64 hex digits) which is lower-cased
  (git ids are case-insensitive; branch and tag names are not);
* ``tokenizer_digest``, ``chat_template_digest``: ``sha256:<64 hex>``, lower-cased; bare hex is
  taken as sha256;
* ``quantization``, ``kv_cache_dtype``, ``engine_name``: lower-cased (``AWQ`` = ``awq``, ``FP8`` = ``fp8``);
  ``auto`` is kept as is, not resolved to the model dtype;
* ``attention_backend``: lower-cased, ``-`` → ``_`` (vLLM spells ``FLASH_ATTN``, SGLang ``flashinfer``);
* ``engine_version``: lower-cased, one leading ``v`` dropped (``v0.32.0`` = ``0.32.0``);
* integers must be integers (not strings, not booleans) and positive;
* ``lora_adapters``: an ordered tuple; order matters (it is the engine's adapter slot order), duplicates
  are an error.

The digest is ``sha256:<hex>`` of a canonical JSON document: ``{"schema": 1, <field>: <value>, ...}``
with sorted keys, no insignificant whitespace, UTF-8. Key order in the file therefore never matters;
``schema`` changes whenever the field set or a normalisation rule changes, so digests computed by
different versions never collide by accident.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import unicodedata
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

__all__ = [
    "FIELDS",
    "SCHEMA",
    "EngineInfo",
    "Fingerprint",
    "FingerprintConflict",
    "FingerprintError",
    "compatible",
    "describe_difference",
    "differing_fields",
    "engine_kind",
    "from_engine",
    "from_sglang",
    "load_fingerprint_file",
    "merge",
]

SCHEMA = 1

_HEX_COMMIT = re.compile(r"^[0-9a-fA-F]{7,64}$")
_SHA256 = re.compile(r"^(?:sha256:)?([0-9a-f]{64})$")


class FingerprintError(ValueError):
    """An invalid fingerprint value or file; ``field`` names the offending key ("" for the whole)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"fingerprint: {field}: {message}" if field else f"fingerprint: {message}")
        self.field = field


class FingerprintConflict(FingerprintError):
    """The fingerprint file and the engine disagree; ``fields`` lists every conflicting field."""

    def __init__(self, fields: Sequence[str], detail: str) -> None:
        super().__init__("", f"the file and the engine disagree on {detail}")
        self.fields = tuple(fields)


def _text(field: str, value: Any) -> str:
    if not isinstance(value, str):
        # YAML turns 0.32 or 1234567 into numbers: say so instead of silently stringifying.
        raise FingerprintError(field, f"must be a string (quote it in YAML), got {type(value).__name__}")
    text = unicodedata.normalize("NFC", value).strip()
    if not text:
        raise FingerprintError(field, "is empty; omit the key if the value is unknown")
    return text


def _positive_int(field: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise FingerprintError(field, f"must be an integer, got {type(value).__name__}")
    if value < 1:
        raise FingerprintError(field, f"must be ≥ 1, got {value}")
    if value >= 2**63:  # the registry record's integer (no real engine comes near)
        raise FingerprintError(field, f"must be < 2^63, got {value}")
    return value


def _digest(field: str, value: Any) -> str:
    text = _text(field, value).lower()
    m = _SHA256.match(text)
    if m is None:
        raise FingerprintError(field, f"must be sha256:<64 hex digits>, got {text!r}")
    return f"sha256:{m[1]}"


def _revision(field: str, value: Any) -> str:
    text = _text(field, value)
    return text.lower() if _HEX_COMMIT.match(text) else text


def _lower(field: str, value: Any) -> str:
    return _text(field, value).lower()


def _backend(field: str, value: Any) -> str:
    return _text(field, value).lower().replace("-", "_")


def _version(field: str, value: Any) -> str:
    text = _text(field, value).lower()
    return text[1:] if text.startswith("v") and text[1:2].isdigit() else text


def _adapters(field: str, value: Any) -> tuple[str, ...]:
    if isinstance(value, str) or not isinstance(value, Sequence):
        raise FingerprintError(field, f"must be a list of adapter names, got {type(value).__name__}")
    names = tuple(_text(f"{field}[{i}]", item) for i, item in enumerate(value))
    seen: set[str] = set()
    for name in names:
        if name in seen:
            raise FingerprintError(field, f"adapter {name!r} is listed twice")
        seen.add(name)
    return names


_NORMALISERS = {
    "model_id": _text,
    "weights_revision": _revision,
    "quantization": _lower,
    "tokenizer_digest": _digest,
    "chat_template_digest": _digest,
    "attention_backend": _backend,
    "kv_cache_dtype": _lower,
    "block_size": _positive_int,
    "tensor_parallel_size": _positive_int,
    "pipeline_parallel_size": _positive_int,
    "lora_adapters": _adapters,
    "engine_name": _lower,
    "engine_version": _version,
}


@dataclass(frozen=True, slots=True)
class Fingerprint:
    """What must be equal for two replicas to be interchangeable. ``None`` means unknown."""

    model_id: str | None = None
    weights_revision: str | None = None
    quantization: str | None = None
    tokenizer_digest: str | None = None
    chat_template_digest: str | None = None
    attention_backend: str | None = None
    kv_cache_dtype: str | None = None
    block_size: int | None = None
    tensor_parallel_size: int | None = None
    pipeline_parallel_size: int | None = None
    lora_adapters: tuple[str, ...] | None = None
    engine_name: str | None = None
    engine_version: str | None = None

    def __post_init__(self) -> None:
        for name, normalise in _NORMALISERS.items():
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, normalise(name, value))

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any]) -> Fingerprint:
        """Build from a mapping of field names; unknown keys are an error naming the key."""
        for key in data:
            if key not in _NORMALISERS:
                raise FingerprintError(str(key), f"unknown key; allowed: {', '.join(FIELDS)}")
        return cls(**{k: v for k, v in data.items() if v is not None})

    def to_mapping(self) -> dict[str, Any]:
        """All fields, adapters as a list: the JSON shape stored in the registry."""
        out: dict[str, Any] = {}
        for name in FIELDS:
            value = getattr(self, name)
            out[name] = list(value) if isinstance(value, tuple) else value
        return out

    def canonical_json(self) -> bytes:
        doc = {"schema": SCHEMA, **self.to_mapping()}
        return json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()

    def digest(self) -> str:
        return "sha256:" + hashlib.sha256(self.canonical_json()).hexdigest()

    def unknown_fields(self) -> tuple[str, ...]:
        return tuple(name for name in FIELDS if getattr(self, name) is None)


FIELDS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(Fingerprint))


def load_fingerprint_file(path: str | Path) -> Fingerprint:
    """Read a YAML or JSON fingerprint file (JSON is YAML): a flat mapping of field names."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise FingerprintError("", f"cannot read {path}: {exc.strerror or exc}") from exc
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise FingerprintError("", f"{path} is not valid YAML/JSON: {exc}") from exc
    if data is None:
        return Fingerprint()
    if not isinstance(data, Mapping):
        raise FingerprintError("", f"{path} must hold a mapping of field names, got {type(data).__name__}")
    return Fingerprint.from_mapping(data)


def merge(declared: Fingerprint, probed: Fingerprint) -> Fingerprint:
    """Combine the file (``declared``) with what the engine reports (``probed``); see module doc."""
    conflicts = differing_fields(declared, probed, only_known=True)
    if conflicts:
        detail = describe_difference(declared, probed, labels=("file", "engine"), fields=conflicts)
        raise FingerprintConflict(conflicts, detail)
    chosen = {
        name: getattr(declared, name) if getattr(declared, name) is not None else getattr(probed, name)
        for name in FIELDS
    }
    return Fingerprint(**chosen)


def compatible(a: Fingerprint, b: Fingerprint) -> bool:
    return a.digest() == b.digest()


def differing_fields(a: Fingerprint, b: Fingerprint, *, only_known: bool = False) -> tuple[str, ...]:
    """Fields whose normalised values differ; with ``only_known``, fields unknown on a side are skipped."""
    out = []
    for name in FIELDS:
        va, vb = getattr(a, name), getattr(b, name)
        if only_known and (va is None or vb is None):
            continue
        if va != vb:
            out.append(name)
    return tuple(out)


def describe_difference(
    a: Fingerprint,
    b: Fingerprint,
    *,
    labels: tuple[str, str] = ("pinned", "candidate"),
    fields: Sequence[str] | None = None,
) -> str:
    """Human-readable list of the differing fields, e.g. for a "no compatible replica" error."""
    names = differing_fields(a, b) if fields is None else tuple(fields)
    if not names:
        return "no difference"

    def show(value: Any) -> str:
        if value is None:
            return "unknown"
        return repr(list(value)) if isinstance(value, tuple) else repr(value)

    return "; ".join(
        f"{name}: {labels[0]} {show(getattr(a, name))} vs {labels[1]} {show(getattr(b, name))}"
        for name in names
    )


# ----------------------------------------------------------------------------- what the engine reports


@dataclass(frozen=True, slots=True)
class EngineInfo:
    """Engine facts that are recorded with a registration but are not part of compatibility."""

    root: str | None = None  # the model path or repository the engine loaded
    max_model_len: int | None = None
    model_type: str | None = None  # the architecture family the engine reports (SGLang: "llama", ...)

    def to_mapping(self) -> dict[str, Any]:
        out: dict[str, Any] = {"root": self.root, "max_model_len": self.max_model_len}
        if self.model_type is not None:  # only engines that report it: vLLM registrations stay as they were
            out["model_type"] = self.model_type
        return out


SGLANG = "sglang"


def engine_kind(models: Any) -> str | None:
    """The engine behind a ``/v1/models`` body, from its cards' ``owned_by`` (``"vllm"``, ``"sglang"``, ...);
    None when the body says nothing usable."""
    cards = models.get("data") if isinstance(models, Mapping) else None
    if not isinstance(cards, list):
        return None
    owners = {c.get("owned_by") for c in cards if isinstance(c, Mapping)}
    owners.discard(None)
    if len(owners) != 1:
        return None
    (owner,) = owners
    return owner.lower() if isinstance(owner, str) and owner.strip() else None


def from_engine(models: Any, version: Any, *, model_id: str | None = None) -> tuple[Fingerprint, EngineInfo]:
    """Parse ``/v1/models`` and ``/version`` bodies (already JSON-decoded).

    ``model_id`` (from the file) selects the base model when the engine serves several names; base
    models are cards without ``parent``, LoRA adapters are cards with one (vLLM, SGLang).
    """
    chosen, adapters = _choose_model(models, model_id)
    engine_version = version.get("version") if isinstance(version, Mapping) else None
    fingerprint = Fingerprint(
        model_id=chosen["id"],
        lora_adapters=adapters,
        engine_name=chosen.get("owned_by") or None,
        engine_version=_str_or_none(engine_version),
    )
    info = EngineInfo(
        root=_str_or_none(chosen.get("root")), max_model_len=_int_or_none(chosen.get("max_model_len"))
    )
    return fingerprint, info


def from_sglang(
    models: Any, model_info: Any, server_info: Any, *, model_id: str | None = None
) -> tuple[Fingerprint, EngineInfo]:
    """Parse SGLang's ``/v1/models``, ``/get_model_info`` and ``/get_server_info`` bodies (JSON-decoded).

    SGLang has no ``/version``: its version is ``/get_server_info``'s ``version`` (verified on 0.5.23), which
    also carries the server arguments that change numerics or the KV layout. What it reports:

    * ``weights_revision``: ``weight_version`` (set by ``--weight-version`` or a weight update), else the
      ``--revision`` it loaded. ``"default"`` is SGLang's placeholder when neither was given: unknown,
      not a revision;
    * ``attention_backend`` (only when no separate prefill/decode backend overrides it), ``kv_cache_dtype``,
      ``block_size`` (= ``page_size``, tokens per KV page), ``tensor_parallel_size`` (``tp_size``),
      ``pipeline_parallel_size`` (``pp_size``), ``quantization`` (null = not stated, so unknown);
    * the model path and type (``/get_model_info``) as :class:`EngineInfo`, not compatibility: two paths
      may hold the same weights.

    A key that is absent or null stays unknown; a value of the wrong type is unknown too (never guessed).
    """
    chosen, adapters = _choose_model(models, model_id)
    model = model_info if isinstance(model_info, Mapping) else {}
    server = server_info if isinstance(server_info, Mapping) else {}
    weight_version = _str_or_none(model.get("weight_version") or server.get("weight_version"))
    if weight_version is not None and weight_version.strip().lower() == "default":
        weight_version = None
    backend = _str_or_none(server.get("attention_backend"))
    for phase in ("prefill_attention_backend", "decode_attention_backend"):
        override = server.get(phase)
        if override is not None and override != backend:
            backend = None  # two backends in play: one name would hide the other
    fingerprint = Fingerprint(
        model_id=chosen["id"],
        weights_revision=weight_version or _str_or_none(server.get("revision")),
        quantization=_str_or_none(server.get("quantization")),
        attention_backend=backend,
        kv_cache_dtype=_str_or_none(server.get("kv_cache_dtype")),
        block_size=_size_or_none(server.get("page_size")),
        tensor_parallel_size=_size_or_none(server.get("tp_size")),
        pipeline_parallel_size=_size_or_none(server.get("pp_size")),
        lora_adapters=adapters,
        engine_name=chosen.get("owned_by") or SGLANG,
        engine_version=_str_or_none(server.get("version")),
    )
    info = EngineInfo(
        root=_str_or_none(model.get("model_path")) or _str_or_none(chosen.get("root")),
        max_model_len=_int_or_none(chosen.get("max_model_len")),
        model_type=_str_or_none(model.get("model_type")),
    )
    return fingerprint, info


def _choose_model(models: Any, model_id: str | None) -> tuple[Mapping[str, Any], tuple[str, ...]]:
    """The base model card to fingerprint and the LoRA adapters' names, from a ``/v1/models`` body."""
    cards = models.get("data") if isinstance(models, Mapping) else None
    if not isinstance(cards, list) or not all(isinstance(c, Mapping) and "id" in c for c in cards):
        raise FingerprintError("", "engine /v1/models did not return a list of models under 'data'")
    bases = [c for c in cards if c.get("parent") is None]
    adapters = [c for c in cards if c.get("parent") is not None]
    if not bases:
        raise FingerprintError("model_id", "engine /v1/models lists no base model")
    wanted = Fingerprint(model_id=model_id).model_id if model_id is not None else None
    chosen = next((c for c in bases if c["id"] == wanted), None)
    if chosen is None:
        if len(bases) > 1:
            ids = ", ".join(repr(c["id"]) for c in bases)
            raise FingerprintError(
                "model_id", f"engine serves several models ({ids}); set model_id in the fingerprint file"
            )
        chosen = bases[0]  # a differing file model_id then surfaces as a merge conflict
    return chosen, tuple(c["id"] for c in adapters)


def _str_or_none(value: Any) -> str | None:
    return value if isinstance(value, str) and value else None


def _int_or_none(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _size_or_none(value: Any) -> int | None:
    """A size the engine reports for a fingerprint field: a positive integer, else unknown."""
    number = _int_or_none(value)
    return number if number is not None and number >= 1 else None
