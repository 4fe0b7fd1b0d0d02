"""``json.loads`` with a bound on nesting depth, that never raises RecursionError (sans-IO).

The C decoder behind ``json.loads`` recurses once per array/object level, so input such as
100 000 ``[`` raises RecursionError — not a ValueError. :func:`loads` measures the depth exactly
in one of two ways, each cheap where the other is not:

* **Text without a backslash** (no escapes, so every quote delimits a string): a pre-scan with
  whole-buffer C operations before parsing. ``bytes.translate`` keeps only quotes and brackets
  (braces as ``[]``); empty strings ``""`` are dropped (this also merges two adjacent strings,
  which moves no bracket in or out of a string), then the strings that still hold brackets;
  then innermost ``[]`` pairs are peeled once per level: round *k* removes the pairs that are
  *k* levels high, so a pair left after ``max_depth`` rounds is too deep. Cost: one translate
  plus one pass per level present. Container-dense bodies (many small messages) take this path.
* **Text with escapes** (chat content with ``\\n`` and ``\\"``): parse, then walk the result one
  level at a time, without recursion. The walk costs per container, not per byte, so a body
  that is mostly long strings costs next to nothing on top of parsing.

Input nested deeper than the interpreter's recursion limit allows makes ``json.loads`` raise
RecursionError (the decoder checks the limit at every level), which is reported as
:class:`JsonTooDeep`. Invalid JSON is reported as too deep when its brackets nest deeper than
``max_depth`` before it breaks, so the error does not depend on the caller's stack depth.
"""

from __future__ import annotations

import itertools
import json
import operator
from typing import Any, NoReturn

__all__ = ["JsonTooDeep", "loads"]


class JsonTooDeep(ValueError):
    """The JSON text nests arrays/objects deeper than ``max_depth`` levels."""

    def __init__(self, max_depth: int) -> None:
        super().__init__(f"JSON nested deeper than {max_depth} levels")
        self.max_depth = max_depth


def _reject_constant(name: str) -> NoReturn:
    # Python's decoder accepts NaN, Infinity and -Infinity; JSON (RFC 8259) does not.
    raise ValueError(f"{name} is not allowed in JSON")


_DECODER = json.JSONDecoder(parse_constant=_reject_constant)  # json.loads with a keyword builds one per call


_ALL_BYTES = bytes(range(256))
_DELETE_BUT_STRUCTURE = _ALL_BYTES.translate(None, b'"[]{}')
# With escapes: also keep backslashes and the escape letters of JSON ("\\/bfnrtu), so the byte after
# a backslash stays next to it ("\n" before a closing quote never turns into an escaped quote).
_DELETE_BUT_ESCAPES = _ALL_BYTES.translate(None, b'"[]{}\\/bfnrtu')
_BRACKETS_AS_SQUARE = bytes.maketrans(b"{}", b"[]")
# Below this size, counting brackets is cheaper than either exact measure.
_SMALL = 1 << 16


def _structure(text: bytes) -> bytes:
    """The quotes and brackets of ``text`` (braces as ``[]``), escaped quotes removed."""
    if b"\\" not in text:
        return text.translate(_BRACKETS_AS_SQUARE, _DELETE_BUT_STRUCTURE)
    kept = text.translate(None, _DELETE_BUT_ESCAPES)
    if b"\\\\" in kept:
        # A run of backslashes is read as pairs from its left end, as str.replace removes them.
        kept = kept.replace(b"\\\\", b"")
    if b'\\"' in kept:
        kept = kept.replace(b'\\"', b"")
    return kept.translate(_BRACKETS_AS_SQUARE, _DELETE_BUT_STRUCTURE)


def _max_prefix_depth(brackets: bytes) -> int:
    """Deepest nesting of a ``[``/``]`` string, in one C-level pass (about 0.1 µs per ``]``)."""
    # Part i of the split is the run of "[" before the i-th "]": opens so far minus closes so far.
    runs = brackets.split(b"]")
    return max(map(operator.sub, itertools.accumulate(map(len, runs)), itertools.count()))


def _brackets_too_deep(text: bytes, max_depth: int) -> bool:
    """Pre-scan: do the brackets outside string literals nest deeper than ``max_depth``?"""
    skeleton = _structure(text)
    if skeleton.count(b"[") <= max_depth:
        return False  # not enough opening brackets in all, strings included
    if b'"' in skeleton:
        skeleton = skeleton.replace(b'""', b"")
        if b'"' in skeleton:
            # Strings that hold brackets: the text starts outside a string, so every other part is outside.
            skeleton = b"".join(skeleton.split(b'"')[::2])
    if b"[" * (max_depth + 1) in skeleton:
        return True  # a run of opening brackets alone is too deep
    if 2 * skeleton.count(b"[") != len(skeleton):
        return _max_prefix_depth(skeleton) > max_depth  # unbalanced: invalid JSON, measured as it is
    # Balanced: every deepest point is an adjacent "[]", so each round of peeling lowers the depth by
    # exactly one. Rounds are cheap while they shrink the skeleton fast (shallow, wide documents); once
    # they stop doing so (deep and wide), one pass measures the rest.
    levels = 0
    while skeleton:
        peeled = skeleton.replace(b"[]", b"")
        if 2 * len(peeled) > len(skeleton):
            return levels + _max_prefix_depth(skeleton) > max_depth
        levels += 1
        skeleton = peeled
    return levels > max_depth


def _nests_deeper(obj: Any, max_depth: int) -> bool:
    """Walk a parsed value one level at a time (no recursion): deeper than ``max_depth``?"""
    level = [obj] if type(obj) is dict or type(obj) is list else []
    depth = 0
    while level:
        depth += 1
        if depth > max_depth:
            return True
        below: list[Any] = []
        for node in level:
            for child in node.values() if type(node) is dict else node:
                t = type(child)
                if t is dict or t is list:
                    below.append(child)
        level = below
    return False


def loads(data: bytes | bytearray | str, *, max_depth: int) -> Any:
    """Parse JSON like ``json.loads``, without NaN/Infinity, at most ``max_depth`` levels deep.

    ``[]`` and ``{}`` are one level; ``[[1]]`` is two. Raises :class:`JsonTooDeep` (a ValueError)
    for deeper input, another ValueError (``json.JSONDecodeError``, UnicodeDecodeError, or a plain
    one for NaN/Infinity) for invalid input, and never RecursionError. Keep ``max_depth`` well
    below ``sys.getrecursionlimit()``.
    """
    if isinstance(data, str):
        doc = data
        if doc.startswith("\ufeff"):
            raise json.JSONDecodeError("Unexpected UTF-8 BOM (decode using utf-8-sig)", doc, 0)
        few_brackets = len(doc) <= _SMALL and doc.count("[") + doc.count("{") <= max_depth
        text = b"" if few_brackets else doc.encode("utf-8", "surrogatepass")
    else:
        encoding = json.detect_encoding(data)  # as json.loads does
        doc = data.decode(encoding, "surrogatepass")
        few_brackets = len(data) <= _SMALL and data.count(b"[") + data.count(b"{") <= max_depth
        # UTF-8 (with or without a BOM) as it is: no multi-byte sequence holds an ASCII byte.
        text = bytes(data) if encoding.startswith("utf-8") else doc.encode("utf-8", "surrogatepass")
    # few_brackets: too few to nest too deep (e.g. one SSE event). Otherwise text without escapes is
    # pre-scanned, and text with escapes is parsed and then walked.
    checked = few_brackets or b"\\" not in text
    if checked and not few_brackets and _brackets_too_deep(text, max_depth):
        raise JsonTooDeep(max_depth)
    try:
        obj = _DECODER.decode(doc)
    except RecursionError:
        raise JsonTooDeep(max_depth) from None
    except ValueError as exc:
        if not checked and _brackets_too_deep(text, max_depth):
            raise JsonTooDeep(max_depth) from exc
        raise
    if not checked and _nests_deeper(obj, max_depth):
        raise JsonTooDeep(max_depth)
    return obj
