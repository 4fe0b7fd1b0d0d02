"""Idempotency keys for side-effecting tool calls made by an agent worker.

A worker that calls a tool (creates an order, sends a mail, moves money) while serving a generation
request sends the tool an ``Idempotency-Key`` built here::

    key = tool_idempotency_key(request_id, 7)        # "req_01J...:call_07"
    key = tool_idempotency_key(request_id, call_id)  # "req_01J...:chatcmpl-tool-..."

``request_id`` is the *logical* request id, which the gateway passes to the replica on every attempt as
``x-request-id``; the second part names the tool call within that request (its ordinal, or the model's
``tool_call`` id). The key is derived from the logical action, **never from the GPU attempt**
(``x-attempt-id``): when a worker dies after the tool call but before its first delta and the gateway
retries on another replica, the new attempt derives the same key, and the tool gateway answers it with
the stored result of the earlier execution instead of executing the side effect a second time.

Keys use the gateway's ``Idempotency-Key`` charset (``A-Z a-z 0-9 . _ : ~ -``, 1-200 characters).
:func:`request_id_of` recovers the request id (everything before the last ``:``), so a tool call id
given as a string may not itself contain ``:``.
"""

from __future__ import annotations

import re

__all__ = ["MAX_KEY_LENGTH", "request_id_of", "tool_idempotency_key"]

MAX_KEY_LENGTH = 200
_CHARSET = re.compile(r"[A-Za-z0-9._:~-]+")
_CHARSET_TEXT = "A-Z a-z 0-9 . _ : ~ -"


def _check_charset(what: str, value: str) -> None:
    if not _CHARSET.fullmatch(value):
        bad = sorted({c for c in value if not _CHARSET.fullmatch(c)})
        raise ValueError(
            f"{what} {value!r} has characters outside the Idempotency-Key charset "
            f"({_CHARSET_TEXT}): {''.join(bad)!r}"
        )


def tool_idempotency_key(request_id: str, call: int | str) -> str:
    """The ``Idempotency-Key`` of tool call ``call`` of logical request ``request_id``.

    ``call`` is either the call's ordinal (an ``int >= 0``, rendered ``call_NN``: ``7`` →
    ``req_01J...:call_07``) or a tool call id string (used as is; it may not contain ``:``).
    Raises :class:`ValueError` when the request id is empty or not in the Idempotency-Key charset, when
    the call is invalid, or when the key would be longer than 200 characters.
    """
    if not isinstance(request_id, str) or not request_id:
        raise ValueError("request_id must be a non-empty string (the logical request's x-request-id)")
    _check_charset("request_id", request_id)
    if isinstance(call, bool):
        raise ValueError(f"call must be an int ordinal or a tool call id string, not {call!r}")
    if isinstance(call, int):
        if call < 0:
            raise ValueError(f"call ordinal must be >= 0, got {call}")
        suffix = f"call_{call:02d}"
    elif isinstance(call, str):
        if not call:
            raise ValueError("tool call id must be a non-empty string")
        _check_charset("tool call id", call)
        if ":" in call:
            raise ValueError(
                f"tool call id {call!r} may not contain ':' (it separates it from the request id)"
            )
        suffix = call
    else:
        raise ValueError(f"call must be an int ordinal or a tool call id string, not {type(call).__name__}")
    key = f"{request_id}:{suffix}"
    if len(key) > MAX_KEY_LENGTH:
        raise ValueError(
            f"idempotency key would be {len(key)} characters, over the limit of {MAX_KEY_LENGTH} "
            f"(request_id is {len(request_id)} characters)"
        )
    return key


def request_id_of(key: str) -> str:
    """The logical request id a tool key was derived from: everything before the last ``:``."""
    request_id, sep, call = key.rpartition(":")
    if not sep or not request_id or not call:
        raise ValueError(f"{key!r} is not a tool idempotency key of the form REQUEST_ID:CALL")
    return request_id
