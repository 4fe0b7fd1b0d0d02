"""The compatibility fingerprint: canonical digest, normalisation, file loading, merge with the engine."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from router_sidecar.core.fingerprint import (
    FIELDS,
    EngineInfo,
    Fingerprint,
    FingerprintConflict,
    FingerprintError,
    compatible,
    describe_difference,
    differing_fields,
    engine_kind,
    from_engine,
    from_sglang,
    load_fingerprint_file,
    merge,
)

TOK = "a" * 64
TPL = "b" * 64

BASE: dict[str, Any] = {
    "model_id": "Qwen/Qwen2.5-0.5B-Instruct",
    "weights_revision": "7ae557604adf67be50417f59c2c2f167def9a775",
    "quantization": "none",
    "tokenizer_digest": f"sha256:{TOK}",
    "chat_template_digest": f"sha256:{TPL}",
    "attention_backend": "flash_attn",
    "kv_cache_dtype": "auto",
    "block_size": 16,
    "tensor_parallel_size": 1,
    "pipeline_parallel_size": 1,
    "lora_adapters": ["sql-lora", "chat-lora"],
    "engine_name": "vllm",
    "engine_version": "0.32.0",
}

# One different value per field: every field must reach the digest and be named in the difference.
CHANGED: dict[str, Any] = {
    "model_id": "Qwen/Qwen2.5-1.5B-Instruct",
    "weights_revision": "0123456789abcdef0123456789abcdef01234567",
    "quantization": "awq",
    "tokenizer_digest": f"sha256:{'c' * 64}",
    "chat_template_digest": f"sha256:{'d' * 64}",
    "attention_backend": "flashinfer",
    "kv_cache_dtype": "fp8",
    "block_size": 32,
    "tensor_parallel_size": 2,
    "pipeline_parallel_size": 2,
    "lora_adapters": ["sql-lora"],
    "engine_name": "sglang",
    "engine_version": "0.33.0",
}


def fp(**overrides: Any) -> Fingerprint:
    return Fingerprint.from_mapping({**BASE, **overrides})


def test_the_tables_cover_every_field() -> None:
    assert set(BASE) == set(CHANGED) == set(FIELDS)


def test_digest_format_and_golden_value() -> None:
    digest = fp().digest()
    assert digest.startswith("sha256:") and len(digest) == 7 + 64
    # Pinned on purpose: if this changes, replicas running different versions stop matching; bump SCHEMA.
    assert digest == "sha256:dbf9409dfd205b99299c313048f89bd5979b93a17d2d10ad615be197cd8228fa"
    assert fp().canonical_json().startswith(b'{"attention_backend":"flash_attn","block_size":16,')


def test_key_order_does_not_matter() -> None:
    reordered = dict(reversed(list(BASE.items())))
    assert Fingerprint.from_mapping(reordered).digest() == fp().digest()


def test_key_order_in_a_file_does_not_matter(tmp_path: Path) -> None:
    a, b = tmp_path / "a.yaml", tmp_path / "b.json"
    a.write_text("".join(f"{k}: {json.dumps(v)}\n" for k, v in BASE.items()))
    b.write_text(json.dumps(dict(sorted(BASE.items(), reverse=True))))
    assert load_fingerprint_file(a).digest() == load_fingerprint_file(b).digest() == fp().digest()


def test_adapter_order_matters() -> None:
    swapped = fp(lora_adapters=["chat-lora", "sql-lora"])
    assert swapped.digest() != fp().digest()
    assert differing_fields(fp(), swapped) == ("lora_adapters",)
    assert not compatible(fp(), swapped)


@pytest.mark.parametrize("field", sorted(CHANGED))
def test_each_field_changes_the_digest_and_is_named(field: str) -> None:
    other = fp(**{field: CHANGED[field]})
    assert other.digest() != fp().digest()
    assert not compatible(fp(), other)
    assert differing_fields(fp(), other) == (field,)
    text = describe_difference(fp(), other)
    assert text.startswith(f"{field}: pinned ") and " vs candidate " in text


@pytest.mark.parametrize("field", sorted(BASE))
def test_unknown_is_not_equal_to_known(field: str) -> None:
    partial = Fingerprint.from_mapping({k: v for k, v in BASE.items() if k != field})
    assert partial.digest() != fp().digest()
    assert differing_fields(fp(), partial) == (field,)
    assert f"{field}: pinned" in describe_difference(fp(), partial)
    assert "candidate unknown" in describe_difference(fp(), partial)


@pytest.mark.parametrize(
    ("field", "spelling"),
    [
        ("model_id", "  Qwen/Qwen2.5-0.5B-Instruct\n"),
        ("weights_revision", "7AE557604ADF67BE50417F59C2C2F167DEF9A775"),
        ("quantization", "None"),
        ("tokenizer_digest", TOK.upper()),
        ("tokenizer_digest", f" SHA256:{TOK} "),
        ("chat_template_digest", TPL),
        ("attention_backend", "FLASH-ATTN"),
        ("attention_backend", "FLASH_ATTN"),
        ("kv_cache_dtype", "AUTO"),
        ("lora_adapters", (" sql-lora", "chat-lora ")),
        ("engine_name", "vLLM"),
        ("engine_version", "v0.32.0"),
        ("engine_version", " 0.32.0 "),
    ],
)
def test_equal_meaning_gives_equal_digest(field: str, spelling: Any) -> None:
    assert fp(**{field: spelling}) == fp()
    assert fp(**{field: spelling}).digest() == fp().digest()


@pytest.mark.parametrize(
    ("field", "spelling"),
    [
        ("model_id", "qwen/qwen2.5-0.5b-instruct"),  # served names are case-sensitive
        ("weights_revision", "Main"),  # branch names are case-sensitive (only hex ids are folded)
        ("lora_adapters", ["SQL-lora", "chat-lora"]),
    ],
)
def test_case_is_kept_where_it_carries_meaning(field: str, spelling: Any) -> None:
    base = fp(weights_revision="main") if field == "weights_revision" else fp()
    assert fp(**{field: spelling}).digest() != base.digest()


@pytest.mark.parametrize(
    ("data", "field", "fragment"),
    [
        ({"model": "x"}, "model", "unknown key"),
        ({"block_size": "16"}, "block_size", "must be an integer"),
        ({"block_size": True}, "block_size", "must be an integer"),
        ({"tensor_parallel_size": 0}, "tensor_parallel_size", "must be ≥ 1"),
        ({"engine_version": 0.32}, "engine_version", "quote it in YAML"),
        ({"weights_revision": 1234567}, "weights_revision", "quote it in YAML"),
        ({"tokenizer_digest": "md5:abc"}, "tokenizer_digest", "sha256:<64 hex digits>"),
        ({"quantization": "  "}, "quantization", "is empty"),
        ({"lora_adapters": "sql-lora"}, "lora_adapters", "must be a list"),
        ({"lora_adapters": ["a", "a"]}, "lora_adapters", "listed twice"),
        ({"lora_adapters": ["a", 3]}, "lora_adapters[1]", "must be a string"),
    ],
)
def test_invalid_values_name_the_field(data: dict[str, Any], field: str, fragment: str) -> None:
    with pytest.raises(FingerprintError) as info:
        Fingerprint.from_mapping(data)
    assert info.value.field == field
    assert fragment in str(info.value) and field in str(info.value)


def test_file_with_unknown_key_is_rejected_naming_it(tmp_path: Path) -> None:
    path = tmp_path / "fp.yaml"
    path.write_text("model_id: tiny\nkv_cache_type: fp8\n")
    with pytest.raises(FingerprintError, match=r"kv_cache_type: unknown key; allowed: model_id, "):
        load_fingerprint_file(path)


@pytest.mark.parametrize(
    ("text", "fragment"),
    [("- a\n- b\n", "must hold a mapping"), ("a: [", "not valid YAML/JSON")],
)
def test_file_shape_errors(tmp_path: Path, text: str, fragment: str) -> None:
    path = tmp_path / "fp.yaml"
    path.write_text(text)
    with pytest.raises(FingerprintError, match=fragment):
        load_fingerprint_file(path)


def test_missing_file_is_a_fingerprint_error(tmp_path: Path) -> None:
    with pytest.raises(FingerprintError, match="cannot read"):
        load_fingerprint_file(tmp_path / "absent.yaml")


def test_empty_file_and_null_values_mean_unknown(tmp_path: Path) -> None:
    path = tmp_path / "fp.yaml"
    path.write_text("")
    assert load_fingerprint_file(path) == Fingerprint()
    path.write_text("quantization:\n")
    assert load_fingerprint_file(path) == Fingerprint()
    assert Fingerprint().unknown_fields() == FIELDS


def test_the_example_file_loads() -> None:
    example = Path(__file__).resolve().parents[2] / "fingerprint.example.yaml"
    loaded = load_fingerprint_file(example)
    assert loaded.tokenizer_digest is not None and loaded.block_size is not None


# ----------------------------------------------------------------------------- merge with the engine

ENGINE = Fingerprint(model_id="tiny", lora_adapters=(), engine_name="vllm", engine_version="0.32.0")


def test_merge_takes_what_the_file_is_silent_about() -> None:
    declared = Fingerprint(block_size=16, kv_cache_dtype="auto")
    merged = merge(declared, ENGINE)
    assert merged.model_id == "tiny" and merged.block_size == 16 and merged.engine_version == "0.32.0"


def test_merge_accepts_equal_values_after_normalisation() -> None:
    merged = merge(Fingerprint(model_id="tiny", engine_name="VLLM", engine_version="v0.32.0"), ENGINE)
    assert merged == merge(Fingerprint(), ENGINE)


def test_merge_conflict_names_every_field_and_both_values() -> None:
    declared = Fingerprint(model_id="other", engine_version="0.31.0", block_size=16)
    with pytest.raises(FingerprintConflict) as info:
        merge(declared, ENGINE)
    assert info.value.fields == ("model_id", "engine_version")
    text = str(info.value)
    assert "model_id: file 'other' vs engine 'tiny'" in text
    assert "engine_version: file '0.31.0' vs engine '0.32.0'" in text


def test_merge_conflict_on_adapters_order() -> None:
    with pytest.raises(FingerprintConflict, match="lora_adapters"):
        merge(Fingerprint(lora_adapters=("b", "a")), Fingerprint(lora_adapters=("a", "b")))


def models_body(*cards: dict[str, Any]) -> dict[str, Any]:
    return {"object": "list", "data": list(cards)}


def card(id: str, parent: str | None = None, **extra: Any) -> dict[str, Any]:
    return {"id": id, "object": "model", "owned_by": "vllm", "root": id, "parent": parent, **extra}


def test_from_engine_reads_vllm_bodies() -> None:
    body = models_body(card("tiny", max_model_len=1024), card("sql-lora", "tiny"), card("chat-lora", "tiny"))
    fingerprint, info = from_engine(body, {"version": "0.32.0"})
    assert fingerprint == Fingerprint(
        model_id="tiny", lora_adapters=("sql-lora", "chat-lora"), engine_name="vllm", engine_version="0.32.0"
    )
    assert info.root == "tiny" and info.max_model_len == 1024


def test_from_engine_with_several_models_needs_model_id() -> None:
    body = models_body(card("a"), card("b"))
    with pytest.raises(FingerprintError, match=r"several models \('a', 'b'\); set model_id"):
        from_engine(body, {"version": "1"})
    fingerprint, _ = from_engine(body, {"version": "1"}, model_id="b")
    assert fingerprint.model_id == "b"


@pytest.mark.parametrize("body", [{}, {"data": "x"}, {"data": [{"object": "model"}]}, [], None])
def test_from_engine_rejects_malformed_models(body: Any) -> None:
    with pytest.raises(FingerprintError):
        from_engine(body, {"version": "1"})


def test_from_engine_without_version_leaves_it_unknown() -> None:
    fingerprint, _ = from_engine(models_body(card("tiny")), {})
    assert fingerprint.engine_version is None


# ----------------------------------------------------------------------------- SGLang

# Response bodies of a real SGLang 0.5.23 (shared/reference/sglang-0.5.23-cpu/transcripts/, served without
# --served-model-name, so the model id is its path), byte for byte.
SGLANG_MODELS = (
    '{"object":"list","data":[{"id":"/tmp/sgl/tiny","object":"model","created":1796104918,"owned_by":"sgl'
    'ang","root":"/tmp/sgl/tiny","parent":null,"max_model_len":1024}]}'
)
SGLANG_MODEL_INFO = (
    '{"model_path":"/tmp/sgl/tiny","served_model_name":"/tmp/sgl/tiny","tokenizer_path":"/tmp/sgl/tiny","'
    'is_generation":true,"preferred_sampling_params":null,"weight_version":"default","load_format":"auto"'
    ',"reasoning_parser":null,"tool_call_parser":null,"disaggregation_mode":"null","has_image_understandi'
    'ng":false,"has_audio_understanding":false,"model_type":"llama","architectures":["LlamaForCausalLM"],'
    '"embedding":{"family":"none","task":"none","execution":"none","attention":"none","pooling":"model_de'
    'fined","normalize":false,"postprocessor":"none","tokenizer_special_tokens":"model_default","supports'
    '_dimensions":false,"supports_token_embeddings":false,"supports_multimodal":false,"requires_embedding'
    '_flag":false,"auto_enable_embedding":false,"bcg_eligibility":"disabled","safe_disable_kv_cache":fals'
    'e,"safe_disable_radix_cache":false,"safe_disable_chunked_prefill":false,"enabled":false,"matryoshka_'
    'dimensions":[],"bcg":{"prefill_backend":"disabled","enabled":false,"capture_token_budget":4096,"capt'
    'ure_batch_sizes":[4,8,12,16,20,24,28,32,48,64,80,96,112,128,144,160,176,192,208,224,240,256,288,320,'
    "352,384,416,448,480,512,576,640,704,768,832,896,960,1024,1280,1536,1792,2048,2304,2560,2816,3072,332"
    '8,3584,3840,4096]},"cache":{"kv_cache_disabled":false,"radix_cache_disabled":false,"chunked_prefill_'
    'disabled":false}}}'
)
# /get_server_info of the real SGLang 0.5.23 the real-engine tier runs (37 KB: the keys read, verbatim).
SGLANG_SERVER_INFO: dict[str, Any] = {
    "model_path": "/tmp/sgl/tiny",
    "version": "0.5.23",
    "weight_version": "default",
    "revision": None,
    "quantization": None,
    "attention_backend": "torch_native",
    "prefill_attention_backend": None,
    "decode_attention_backend": None,
    "kv_cache_dtype": "auto",
    "page_size": 1,
    "tp_size": 1,
    "pp_size": 1,
    "dp_size": 1,
}


def sglang_bodies() -> tuple[Any, Any, dict[str, Any]]:
    return json.loads(SGLANG_MODELS), json.loads(SGLANG_MODEL_INFO), dict(SGLANG_SERVER_INFO)


def test_engine_kind_from_models() -> None:
    assert engine_kind(json.loads(SGLANG_MODELS)) == "sglang"
    assert engine_kind(models_body(card("tiny"), card("lora", "tiny"))) == "vllm"
    assert engine_kind(models_body()) is None
    assert engine_kind({"data": [{"id": "x"}]}) is None  # no owned_by: nothing to go by
    assert engine_kind([]) is None


def test_from_sglang_reads_the_real_bodies() -> None:
    fingerprint, info = from_sglang(*sglang_bodies())
    assert fingerprint == Fingerprint(
        model_id="/tmp/sgl/tiny",
        attention_backend="torch_native",
        kv_cache_dtype="auto",
        block_size=1,
        tensor_parallel_size=1,
        pipeline_parallel_size=1,
        lora_adapters=(),
        engine_name="sglang",
        engine_version="0.5.23",
    )
    # "default" is SGLang's placeholder weight_version, quantization null is "not stated": both unknown.
    assert fingerprint.weights_revision is None and fingerprint.quantization is None
    assert info == EngineInfo(root="/tmp/sgl/tiny", max_model_len=1024, model_type="llama")
    assert info.to_mapping() == {"root": "/tmp/sgl/tiny", "max_model_len": 1024, "model_type": "llama"}


def test_from_sglang_root_is_the_model_path_not_the_served_name() -> None:
    models, model_info, server_info = sglang_bodies()
    models["data"][0].update(id="tiny", root="tiny")  # --served-model-name tiny
    fingerprint, info = from_sglang(models, model_info, server_info)
    assert fingerprint.model_id == "tiny" and info.root == "/tmp/sgl/tiny"


@pytest.mark.parametrize(
    ("model_info", "server_info", "expected"),
    [
        ({"weight_version": "step-42"}, {}, "step-42"),  # --weight-version, or after update_weights
        ({"weight_version": "default"}, {"revision": "7AE5576"}, "7ae5576"),  # the HF revision it loaded
        ({"weight_version": "Default"}, {}, None),
        ({}, {"weight_version": "v2"}, "v2"),
        ({"weight_version": None}, {"revision": None}, None),
    ],
)
def test_from_sglang_weights_revision(model_info: Any, server_info: Any, expected: str | None) -> None:
    fingerprint, _ = from_sglang(json.loads(SGLANG_MODELS), model_info, server_info)
    assert fingerprint.weights_revision == expected


def test_from_sglang_a_weight_update_changes_the_digest() -> None:
    models, model_info, server_info = sglang_bodies()
    before, _ = from_sglang(models, model_info, server_info)
    after, _ = from_sglang(models, {**model_info, "weight_version": "step-1"}, server_info)
    assert differing_fields(before, after) == ("weights_revision",)


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ({"prefill_attention_backend": "torch_native"}, "torch_native"),  # the same backend, named twice
        ({"decode_attention_backend": "triton"}, None),  # two backends in play: not one name
        ({"attention_backend": None}, None),
        ({"attention_backend": "FlashInfer"}, "flashinfer"),
    ],
)
def test_from_sglang_attention_backend(overrides: dict[str, Any], expected: str | None) -> None:
    models, model_info, server_info = sglang_bodies()
    fingerprint, _ = from_sglang(models, model_info, {**server_info, **overrides})
    assert fingerprint.attention_backend == expected


@pytest.mark.parametrize("value", [0, -1, True, "1", 1.0, None])
def test_from_sglang_sizes_that_are_not_positive_integers_are_unknown(value: Any) -> None:
    models, model_info, server_info = sglang_bodies()
    fingerprint, _ = from_sglang(models, model_info, {**server_info, "page_size": value, "tp_size": value})
    assert fingerprint.block_size is None and fingerprint.tensor_parallel_size is None


def test_from_sglang_without_server_info_knows_only_the_models_card() -> None:
    fingerprint, info = from_sglang(json.loads(SGLANG_MODELS), None, None)
    assert fingerprint == Fingerprint(model_id="/tmp/sgl/tiny", lora_adapters=(), engine_name="sglang")
    assert info == EngineInfo(root="/tmp/sgl/tiny", max_model_len=1024)


def test_from_sglang_adapters_and_model_choice_as_for_vllm() -> None:
    base = {**json.loads(SGLANG_MODELS)["data"][0], "id": "tiny"}
    adapter = {**base, "id": "sql-lora", "root": "/loras/sql", "parent": "tiny"}
    fingerprint, _ = from_sglang(models_body(base, adapter), {}, SGLANG_SERVER_INFO, model_id="tiny")
    assert fingerprint.lora_adapters == ("sql-lora",) and fingerprint.model_id == "tiny"
    with pytest.raises(FingerprintError, match="several models"):
        from_sglang(models_body(base, {**base, "id": "other"}), {}, SGLANG_SERVER_INFO)


def test_sglang_file_and_engine_merge() -> None:
    probed, _ = from_sglang(*sglang_bodies())
    declared = Fingerprint(weights_revision="aaaa1111", attention_backend="torch-native", block_size=1)
    merged = merge(declared, probed)
    assert merged.weights_revision == "aaaa1111" and merged.engine_version == "0.5.23"
    with pytest.raises(FingerprintConflict) as info:
        merge(Fingerprint(block_size=16, engine_name="vllm"), probed)
    assert info.value.fields == ("block_size", "engine_name")


def test_sglang_and_vllm_replicas_of_one_model_are_not_compatible() -> None:
    sglang, _ = from_sglang(*sglang_bodies())
    vllm, _ = from_engine(models_body(card("/tmp/sgl/tiny", max_model_len=1024)), {"version": "0.32.0"})
    assert not compatible(sglang, vllm)
    assert "engine_name: pinned 'sglang' vs candidate 'vllm'" in describe_difference(sglang, vllm)
