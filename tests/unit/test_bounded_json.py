from __future__ import annotations

import json
import random
from typing import Any

import pytest

from router_sidecar.core import bounded_json
from router_sidecar.core.bounded_json import JsonTooDeep

# bounded_json measures depth in two ways, by the text: a pre-scan when it has no backslash, a walk
# of the parsed value when it has; and a short cut for small texts with few brackets. These wrap a
# value so that the same document takes each way.
BIG = 70_000  # over bounded_json's "small text" size


def plain(doc: str) -> str:
    return doc


def padded(doc: str) -> str:  # large, no backslash: pre-scan
    return '{"pad": "' + "p" * BIG + '", "doc": ' + doc + "}"


def padded_escaped(doc: str) -> str:  # large, with a backslash: parse, then walk
    return '{"pad": "' + "p\\n" * (BIG // 3) + '", "doc": ' + doc + "}"


WRAPS = [plain, padded, padded_escaped]
EXTRA_DEPTH = {plain: 0, padded: 1, padded_escaped: 1}


def depth_of(v: Any) -> int:
    """Reference depth of a parsed value (recursive; for the small test documents only)."""
    if isinstance(v, dict):
        return 1 + max((depth_of(x) for x in v.values()), default=0)
    if isinstance(v, list):
        return 1 + max((depth_of(x) for x in v), default=0)
    return 0


def nested(kind: str, depth: int) -> str:
    """``depth`` levels of arrays, objects, or both in turn."""
    opens: list[str] = []
    closes: list[str] = []
    for level in range(depth):
        array = kind == "array" or (kind == "mixed" and level % 2 == 0)
        opens.append("[" if array else '{"a":')
        closes.append("]" if array else "}")
    innermost = "1" if closes and closes[-1] == "}" else ""
    return "".join(opens) + innermost + "".join(reversed(closes))


# --- same result as json.loads -----------------------------------------------------------------


VALID = [
    "0",
    "-1.5e3",
    '"text"',
    "null",
    "true",
    "[]",
    "{}",
    '{"a": [1, 2, {"b": null}], "c": "x"}',
    '["\\"", "\\\\", "\\\\\\"", "\\u00e9\\ud83d\\ude00", "[{", "}]"]',
    '{"content": "line\\n[1, {2}]\\t\\"quoted\\" \\\\"}',
    '  {"a" : [ ] , "b" : { } }  ',
    '"\\u005b\\u005d"',
]


@pytest.mark.parametrize("doc", VALID, ids=range(len(VALID)))
@pytest.mark.parametrize("wrap", WRAPS, ids=lambda w: w.__name__)
def test_same_result_as_json_loads(doc: str, wrap: Any) -> None:
    text = wrap(doc)
    expected = json.loads(text)
    assert bounded_json.loads(text, max_depth=64) == expected
    assert bounded_json.loads(text.encode(), max_depth=64) == expected
    assert bounded_json.loads(bytearray(text.encode()), max_depth=64) == expected


@pytest.mark.parametrize("encoding", ["utf-8-sig", "utf-16", "utf-16-le", "utf-32-be"])
def test_encodings_as_json_loads(encoding: str) -> None:
    data = '{"k": ["\u00e9", [1]]}'.encode(encoding)
    assert bounded_json.loads(data, max_depth=3) == json.loads(data)
    with pytest.raises(JsonTooDeep):
        bounded_json.loads(data, max_depth=2)


@pytest.mark.parametrize("constant", ["NaN", "Infinity", "-Infinity"])
@pytest.mark.parametrize("wrap", WRAPS, ids=lambda w: w.__name__)
def test_nan_and_infinity_are_invalid(constant: str, wrap: Any) -> None:
    with pytest.raises(ValueError, match=f"{constant} is not allowed in JSON") as info:
        bounded_json.loads(wrap("[1, " + constant + "]"), max_depth=64)
    assert not isinstance(info.value, JsonTooDeep)


@pytest.mark.parametrize("doc", ["", "[1,", '{"a"}', "[1] x", "\ufeff[1]", '"\\x"', "[1, 2]]"])
def test_invalid_json_is_a_decode_error(doc: str) -> None:
    with pytest.raises(json.JSONDecodeError):
        bounded_json.loads(doc, max_depth=64)


def test_invalid_utf8_is_a_value_error() -> None:
    with pytest.raises(UnicodeDecodeError):
        bounded_json.loads(b'["\xff"]', max_depth=64)


# --- the depth bound -----------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["array", "object", "mixed"])
@pytest.mark.parametrize("wrap", WRAPS, ids=lambda w: w.__name__)
@pytest.mark.parametrize("max_depth", [1, 2, 3, 8, 64])
def test_depth_limit_is_exact(kind: str, wrap: Any, max_depth: int) -> None:
    inner = max_depth - EXTRA_DEPTH[wrap]  # levels of the nested part that reach max_depth exactly
    if inner >= 1:
        doc = wrap(nested(kind, inner))
        assert depth_of(json.loads(doc)) == max_depth
        assert bounded_json.loads(doc, max_depth=max_depth) == json.loads(doc)
    deeper = wrap(nested(kind, inner + 1))
    assert depth_of(json.loads(deeper)) == max_depth + 1
    with pytest.raises(JsonTooDeep) as info:
        bounded_json.loads(deeper, max_depth=max_depth)
    assert info.value.max_depth == max_depth
    assert str(info.value) == f"JSON nested deeper than {max_depth} levels"
    assert isinstance(info.value, ValueError)


HOSTILE = {
    "100k [": "[" * 100_000,
    "100k [ closed": "[" * 100_000 + "]" * 100_000,
    '100k {"a":': '{"a":' * 100_000,
    '100k {"a": closed': '{"a":' * 100_000 + "1" + "}" * 100_000,
    "100k [ after an escape": '["\\n", ' + "[" * 100_000,
    '100k {"a": after an escape, closed': '{"\\"": ' + '{"a":' * 100_000 + "1" + "}" * 100_001,
    "2 MB of [": "[" * (2 << 20),
    "200 [ then garbage, with an escape": '["\\t", ' + "[" * 200 + "x",
    "200 [ then garbage": "[" * 200 + "x",
}


@pytest.mark.parametrize("doc", HOSTILE.values(), ids=HOSTILE.keys())
def test_deep_input_raises_too_deep_never_recursion_error(doc: str) -> None:
    for data in (doc, doc.encode()):
        with pytest.raises(JsonTooDeep):
            bounded_json.loads(data, max_depth=64)


def test_deep_valid_input_over_the_recursion_limit() -> None:
    # Parsed then walked (it has a backslash): json.loads' own RecursionError is the backstop.
    doc = '["\\n", ' + "[" * 5000 + "]" * 5000 + "]"
    with pytest.raises(JsonTooDeep):
        bounded_json.loads(doc, max_depth=10_000)


IN_STRINGS = [
    '["' + "[" * 100_000 + '"]',
    '{"a": "' + "{a:" * 20_000 + '"}',
    '{"a": "' + '{\\"a\\":' * 20_000 + '"}',
    '["' + "]" * 1000 + '", [[["' + "[" * 1000 + '"]]]]',
    '["\\"[[[[[[[[", "]]]]]]]]\\\\", [[1]]]',
    '["\\\\", "[[[[[[[[[[", "\\\\\\"]]]]]]]]"]',
    '["", "[[[", "", "]]]", "", ["", ""], [[""]]]',
    '[["[", "]"], ["]", "["], "", ""]',
]


@pytest.mark.parametrize("doc", IN_STRINGS, ids=range(len(IN_STRINGS)))
@pytest.mark.parametrize("wrap", WRAPS, ids=lambda w: w.__name__)
def test_brackets_inside_strings_are_not_nesting(doc: str, wrap: Any) -> None:
    text = wrap(doc)
    expected = json.loads(text)
    assert bounded_json.loads(text, max_depth=depth_of(expected)) == expected
    with pytest.raises(JsonTooDeep):
        bounded_json.loads(text, max_depth=depth_of(expected) - 1)


# --- random documents against the reference depth ------------------------------------------------

STRING_BITS = [
    "a",
    "[",
    "]",
    "{",
    "}",
    '\\"',
    "\\\\",
    "\\n",
    "\\u005c",
    '\\"[',
    ']\\"',
    "\\\\]",
    " ",
    "\u00e9",
]


def random_value(rng: random.Random, depth: int) -> Any:
    r = rng.random()
    if depth <= 0 or r < 0.3:
        choice = rng.randrange(4)
        if choice == 0:
            return rng.randint(-5, 5)
        if choice == 1:
            return None
        # Strings with brackets and escapes: what a pre-scan must see through.
        return json.loads('"' + "".join(rng.choice(STRING_BITS) for _ in range(rng.randint(0, 8))) + '"')
    if r < 0.65:
        return [random_value(rng, depth - 1) for _ in range(rng.randint(0, 3))]
    return {f"k{i}": random_value(rng, depth - 1) for i in range(rng.randint(0, 3))}


@pytest.mark.parametrize("seed", range(30))
def test_random_documents(seed: int) -> None:
    rng = random.Random(f"bounded-json-{seed}")
    for _ in range(40):
        value = random_value(rng, rng.randint(0, 12))
        doc = json.dumps(value, ensure_ascii=rng.random() < 0.5)
        for wrap in WRAPS:
            text = wrap(doc)
            expected = json.loads(text)
            depth = depth_of(expected)
            for max_depth in (max(depth - 1, 0), depth, depth + 1):
                if depth > max_depth:
                    with pytest.raises(JsonTooDeep):
                        bounded_json.loads(text, max_depth=max_depth)
                else:
                    assert bounded_json.loads(text, max_depth=max_depth) == expected


@pytest.mark.parametrize("seed", range(10))
def test_random_broken_documents_raise_value_error_only(seed: int) -> None:
    rng = random.Random(f"bounded-json-broken-{seed}")
    alphabet = ["[", "]", "{", "}", '"', "\\", ":", ",", "1", "a", " ", '{"a":', "[" * 300, "]" * 300]
    for _ in range(150):
        doc = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 40)))
        for text in (doc, padded(doc), padded_escaped(doc)):
            try:
                got = bounded_json.loads(text, max_depth=16)
            except ValueError:  # includes JsonTooDeep; a RecursionError would fail the test
                continue
            assert got == json.loads(text)
            assert depth_of(got) <= 16
