"""Structured logs: one JSON object per line, with the request, attempt and trace a line is about.

The ids come from context variables that each ext_proc stream sets for itself (every stream is its own
asyncio task, and tasks it starts inherit them), so a log call anywhere below names its request without
passing it along. What a request is (its API, the engine behind an attempt's replica) the telemetry
describes once per request (`describe`); a line about it adds those fields, read when the line is written.
Bodies are never logged: nothing here reads one.
"""

from __future__ import annotations

import contextvars
import json
import logging
import sys
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

LOG_FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

request_id_var: contextvars.ContextVar[str | None] = contextvars.ContextVar("request_id", default=None)
attempt_id_var: contextvars.ContextVar[str | None] = contextvars.ContextVar("attempt_id", default=None)

# What a request's log lines say about it, given the attempt a line is about (or None): its trace, its API,
# and the engine behind the attempt's replica (`trace_id`, `api`, `gen_ai.operation.name`,
# `gen_ai.provider.name`). Read when a line is written: the trace opens after admission, and a line may come
# from any task that feeds the request's machine (one stream's, another's, the journal's). Kept from
# admission to the request's end; bounded all the same (a request never ended by a view is forgotten, the
# oldest first).
About = Callable[[str | None], dict[str, str]]
MAX_DESCRIBED = 100_000
_described: OrderedDict[str, About] = OrderedDict()


def describe(request_id: str, about: About) -> None:
    """What the log lines about `request_id` add (until `forget`)."""
    _described[request_id] = about
    _described.move_to_end(request_id)
    while len(_described) > MAX_DESCRIBED:
        _described.popitem(last=False)


def forget(request_id: str) -> None:
    _described.pop(request_id, None)


def _about(request_id: str, attempt_id: str | None) -> dict[str, str]:
    about = _described.get(request_id)
    if about is None:
        return {}
    try:
        return about(attempt_id)
    except Exception:  # a log line must never fail for what it adds
        return {}


def bind(*, request_id: str | None = None, attempt_id: str | None = None) -> None:
    """Name what the current task's log lines are about (the stream's task and those it starts)."""
    if request_id is not None:
        request_id_var.set(request_id)
    if attempt_id is not None:
        attempt_id_var.set(attempt_id)


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key, var in (("request_id", request_id_var), ("attempt_id", attempt_id_var)):
            # A line about another attempt than the task's own (a decision one stream delivers to another's)
            # names it itself: `log.info(..., extra={"attempt_id": ...})`.
            value = getattr(record, key, None) or var.get()
            if value is not None:
                line[key] = value
        request_id = line.get("request_id")
        if request_id is not None:
            line.update(_about(request_id, line.get("attempt_id")))
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line, ensure_ascii=False, default=str)


def configure_logging(level: str, log_format: str = "text") -> None:
    if log_format not in LOG_FORMATS:
        raise ValueError(f"log format {log_format!r}: expected one of {', '.join(LOG_FORMATS)}")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if log_format == "json" else logging.Formatter(TEXT_FORMAT))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
