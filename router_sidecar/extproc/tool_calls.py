"""Downstream handling of one call to a tool route (`/tools/NAME/...`): idempotency by key.

The claim is an etcd create-if-absent, so a burst of parallel calls with one key executes the tool once.
The final record is written before the last byte of the tool's answer goes to the caller, so a caller
that retries at once finds the stored answer, never a second execution.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time

from router_sidecar.coordination.journal import Journal
from router_sidecar.coordination.store import StoreUnavailable
from router_sidecar.coordination.tool_ledger import ToolLedger
from router_sidecar.core.events import EventName
from router_sidecar.core.policy import ToolsPolicy
from router_sidecar.core.request import LogicalRequest, ToolCallNoted
from router_sidecar.core.tool_keys import request_id_of
from router_sidecar.core.tools import (
    REPLAY_HEADER,
    Refuse,
    Replay,
    ResponseFate,
    StillRunning,
    ToolResponse,
    answer_for_existing,
    call_digest,
    claim_record,
)
from router_sidecar.extproc import messages as m
from router_sidecar.extproc.parsing import INLINE_BODY_BYTES
from router_sidecar.extproc.registry import Registry

log = logging.getLogger(__name__)


def _request_id_or_none(key: str) -> str | None:
    # Keys not derived with tool_keys (no request id in them) are still protected, just not journaled.
    try:
        return request_id_of(key)
    except ValueError:
        return None


class ToolCallStream:
    def __init__(
        self,
        *,
        ledger: ToolLedger,
        policy: ToolsPolicy,
        registry: Registry,
        journal: Journal,
        tenant: str,
        key: str,
        method: str,
        path: str,
        caller_attempt_id: str | None,
        gateway_id: str,
    ) -> None:
        self._ledger = ledger
        self._policy = policy
        self._journal = journal
        self._tenant = tenant
        self._key = key
        self._call = f"{method} {path}"  # the action the key names, with the body (path with its query)
        self._method, self._path = method, path
        self._gateway_id = gateway_id
        self._claimed: dict[str, object] | None = None
        self._response = ToolResponse(max_stored_bytes=policy.max_stored_response_bytes)
        self._settled = False
        # The logical request this call is made for, if it is in flight here and belongs to the same caller.
        request_id = _request_id_or_none(key)
        live = registry.get(request_id) if request_id else None
        self._request: LogicalRequest | None = (
            live.request if live is not None and live.request.tenant == tenant else None
        )
        self._attempt = self._request.attempt_number(caller_attempt_id) if self._request else None
        self.attempt_id = caller_attempt_id if self._attempt is not None else None

    async def on_request_body(self, body: bytes) -> m.Reply | None:
        """None: go ahead and call the tool. Otherwise the answer to send instead of calling it."""
        if len(body) > INLINE_BODY_BYTES:
            # sha256 lets go of the GIL on large inputs: hashed on a thread, a 4 MiB body (~5 ms) does not
            # stall every other stream's chunks on the event loop.
            digest = await asyncio.to_thread(call_digest, self._method, self._path, body)
        else:
            digest = call_digest(self._method, self._path, body)
        now = time.time()
        record = claim_record(
            key=self._key,
            request_id=_request_id_or_none(self._key),
            attempt_id=self.attempt_id,
            digest=digest,
            call=self._call,
            now=now,
            deadline=now + self._policy.call_timeout_seconds + 5,
            gateway=self._gateway_id,
        )
        try:
            existing = await self._ledger.claim(self._tenant, self._key, record)
            if existing is None:
                self._claimed = record
                self._note(EventName.TOOL_CALL_CLAIMED)
                return None
            answer = answer_for_existing(existing, digest, now)
            if isinstance(answer, StillRunning):
                answer = await self._ledger.wait_while_running(
                    self._tenant, self._key, digest, now + self._policy.in_progress_wait_seconds
                )
        except StoreUnavailable as exc:
            # Without the store no claim can be proven: refuse rather than risk a second execution.
            self._settled = True
            return self._refusal(
                Refuse(
                    503,
                    "idempotency_store_unavailable",
                    f"the idempotency store cannot be reached ({exc}); the tool was not called",
                    retry_after_seconds=1,
                )
            )
        self._settled = True
        if isinstance(answer, Replay):
            self._note(EventName.TOOL_CALL_REPLAYED, status=answer.status)
            return m.immediate(
                answer.status,
                answer.body,
                content_type=_content_type(answer.headers),
                extra_headers=[(REPLAY_HEADER, "true"), ("idempotency-key", self._key)],
            )
        return self._refusal(answer)

    def on_response_headers(self, headers: dict[str, str], code_details: str) -> None:
        self._response.on_headers(headers, code_details)

    async def on_response_body(self, chunk: bytes, end_of_stream: bool) -> m.Reply:
        self._response.on_body(chunk)
        if end_of_stream:
            await self._settle(complete=True)  # durable before the caller has the whole answer
        return m.streamed_body(chunk, end_of_stream)

    async def on_stream_end(self) -> None:
        """The stream ended (or was torn down) before the tool's answer was complete."""
        if not self._settled:
            await self._settle(complete=False)

    async def _settle(self, *, complete: bool) -> None:
        if self._settled or self._claimed is None:
            return
        self._settled = True
        fate = self._response.fate(complete=complete)
        record = (
            None
            if fate is ResponseFate.FREE
            else self._response.final_record(self._claimed, fate, time.time())
        )
        try:
            await self._ledger.settle(self._tenant, self._key, record)
        except StoreUnavailable as exc:
            log.error("tool call %s: outcome %s not recorded: %s", self._key, fate.value, exc)
        event = {
            ResponseFate.STORE: EventName.TOOL_CALL_EXECUTED,
            ResponseFate.TOO_LARGE: EventName.TOOL_CALL_EXECUTED,
            ResponseFate.FREE: EventName.TOOL_CALL_FREED,
            ResponseFate.UNKNOWN: EventName.TOOL_CALL_OUTCOME_UNKNOWN,
        }[fate]
        self._note(event, status=self._response.status or None, stored=fate is ResponseFate.STORE)

    def _refusal(self, refuse: Refuse) -> m.ProcessingResponse:
        self._note(EventName.TOOL_CALL_REFUSED, code=refuse.code)
        body = {
            "error": {
                "code": refuse.code,
                "message": refuse.message,
                "type": "gateway_error",
                "idempotency_key": self._key,
            }
        }
        extra = (
            [("retry-after", str(refuse.retry_after_seconds))]
            if refuse.retry_after_seconds is not None
            else []
        )
        return m.immediate(refuse.status, json.dumps(body).encode(), extra_headers=extra)

    def _note(self, name: EventName, **detail: object) -> None:
        if self._request is not None:
            self._request.handle(ToolCallNoted(name, self._key, self._attempt, dict(detail)))
            self._journal.update(self._request)
        log.info("tool call %s: %s %s", self._key, name.value, detail or "")


def _content_type(headers: tuple[tuple[str, str], ...]) -> str:
    return next((v for k, v in headers if k == "content-type"), "application/json")
