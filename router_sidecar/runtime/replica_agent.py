"""`router-sidecar replica`: register one engine replica in etcd while, and only while, it is healthy.

Every ``interval`` seconds the agent probes the engine (``/health``, then ``/v1/models`` and what the engine
says about itself), builds the fingerprint (file merged with what the engine reports, see `fingerprint`), and
makes the registry match: healthy → registered under a lease kept alive by `Heartbeat`; unhealthy (non-200,
refused, timed out, unreadable) → withdrawn at once (key deleted, lease revoked). An engine that comes
back is registered again with a fresh fingerprint (it may have been upgraded meanwhile).

The engine is recognised by ``/v1/models`` (``owned_by``): vLLM (and anything else) reports its version on
``/version``; SGLang on ``/get_server_info``, its weights version and model on ``/get_model_info``. SGLang
answers ``/health`` only after waiting a second for its scheduler to produce a token, so its health probe
gets that much longer than the tick's timeout. While it drains after SIGTERM it answers ``/health`` with
503 at once but still serves: a 503 from an engine whose ``/v1/models`` still answers keeps the
registration, marked draining (gateways send it nothing new; the attempts in flight there are not lost and
finish), for at most ``--drain-seconds``; it is withdrawn when the engine stops answering (it exits).

Exit codes: 0 after SIGTERM/SIGINT (registration withdrawn first); 2 for configuration errors: etcd
unreachable at start, invalid fingerprint file, file and engine disagreeing, ``--interval`` ≥ ``--ttl``.
etcd lost later is not fatal: the agent keeps probing and re-registers (new lease if the old one expired)
when etcd answers again.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import secrets
import signal
import socket
import sys
import time
from dataclasses import dataclass
from typing import Any

from router_sidecar.coordination.engine_http import EngineDown, http_get, split_hostport
from router_sidecar.coordination.registry_store import Heartbeat, Replica, ReplicaRegistry
from router_sidecar.coordination.store import EtcdStore, Store, StoreUnavailable
from router_sidecar.core.fingerprint import (
    SGLANG,
    EngineInfo,
    Fingerprint,
    FingerprintError,
    engine_kind,
    from_engine,
    from_sglang,
    load_fingerprint_file,
    merge,
)

__all__ = ["AgentOptions", "EngineDown", "EngineProbe", "ReplicaAgent", "http_get", "main_async"]

log = logging.getLogger("router_sidecar.replica")


class ConfigError(Exception):
    """A start-up or configuration problem: reported on stderr, exit code 2."""


# SGLang's /health sends a one-token generation and answers after polling for the scheduler's output once
# a second (sglang/srt/entrypoints/http_server.py, 0.5.23): ≥ 1 s when healthy, 2 s when a busy CPU made the
# first poll miss it. A frozen or dead scheduler still shows up as a timeout, just that much later.
SGLANG_HEALTH_ALLOWANCE = 2.0


class EngineDraining(EngineDown):
    """The engine says it is unhealthy (503) but still answers: it drains what it has and takes no more."""


class EngineProbe:
    """The engine's OpenAI-compatible server, as seen by the agent."""

    def __init__(self, engine: str, *, timeout: float) -> None:
        self.host, self.port = split_hostport(engine)
        self.timeout = timeout
        self.kind: str | None = None  # from /v1/models' owned_by once seen: "vllm", "sglang", ...

    async def _get(self, path: str, timeout: float | None = None) -> tuple[int, bytes]:
        timeout = self.timeout if timeout is None else timeout
        try:
            return await http_get(self.host, self.port, path, timeout)
        except TimeoutError as exc:
            raise EngineDown(f"GET {path}: no answer within {timeout:g}s", slow=True) from exc
        except OSError as exc:
            raise EngineDown(f"GET {path}: {exc.strerror or exc}") from exc

    async def _json(self, path: str) -> Any:
        status, body = await self._get(path)
        if status != 200:
            raise EngineDown(f"GET {path}: HTTP {status}")
        try:
            return json.loads(body)
        except ValueError as exc:
            raise EngineDown(f"GET {path}: body is not JSON") from exc

    def health_timeout(self) -> float:
        # Until /v1/models has said which engine this is, allow for SGLang: otherwise the first probe of a
        # healthy SGLang would always time out, and its registration wait a tick.
        if self.kind is None or self.kind == SGLANG:
            return self.timeout + SGLANG_HEALTH_ALLOWANCE
        return self.timeout

    async def _still_serving(self) -> bool:
        try:
            status, _ = await self._get("/v1/models")
        except EngineDown:
            return False
        return status == 200

    async def check(self, model_id: str | None) -> tuple[Fingerprint, EngineInfo]:
        """Health first (it is the engine's own readiness verdict), then what it says about itself."""
        try:
            return await self._check(model_id)
        except EngineDown:
            self.kind = None  # whatever comes back on this port (another engine?) is recognised afresh
            raise

    async def _check(self, model_id: str | None) -> tuple[Fingerprint, EngineInfo]:
        status, _ = await self._get("/health", self.health_timeout())
        if status == 503 and await self._still_serving():
            # SGLang draining after SIGTERM: 503 here while it still accepts and serves requests.
            raise EngineDraining("GET /health: HTTP 503 while the server still answers: draining")
        if status != 200:
            raise EngineDown(f"GET /health: HTTP {status}")
        models = await self._json("/v1/models")
        self.kind = engine_kind(models) or "unnamed"
        if self.kind == SGLANG:
            model_info, server_info = await asyncio.gather(
                self._json("/get_model_info"), self._json("/get_server_info")
            )
            return from_sglang(models, model_info, server_info, model_id=model_id)
        return from_engine(models, await self._json("/version"), model_id=model_id)


@dataclass(frozen=True)
class AgentOptions:
    engine: str
    advertise: str
    etcd: str
    fingerprint_file: str | None = None
    ttl: int = 10
    interval: float = 2.0
    front: str | None = None  # replica mode: own Envoy on this HOST:PORT with the replica-side fence
    fence_margin: float = 0.5
    drain_seconds: float = 60.0  # a draining engine stays registered (as draining) at most this long

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> AgentOptions:
        return cls(
            engine=args.engine,
            advertise=args.advertise,
            etcd=args.etcd,
            fingerprint_file=args.fingerprint,
            ttl=args.ttl,
            interval=args.interval,
            front=getattr(args, "front", None),
            fence_margin=getattr(args, "fence_margin", 0.5),
            drain_seconds=getattr(args, "drain_seconds", 60.0),
        )

    def validate(self) -> None:
        for flag, value in (
            ("--engine", self.engine),
            ("--advertise", self.advertise),
            ("--etcd", self.etcd),
        ):
            try:
                split_hostport(value)
            except ValueError as exc:
                raise ConfigError(f"{flag}: {exc}") from None
        if self.front is not None:
            try:
                split_hostport(self.front)
            except ValueError as exc:
                raise ConfigError(f"--front: {exc}") from None
            if self.front == self.engine:
                raise ConfigError("--front must differ from --engine")
            if not 0 <= self.fence_margin < 60:
                raise ConfigError(f"--fence-margin must be ≥ 0 and < 60 s, got {self.fence_margin:g}")
        if self.ttl < 1:
            raise ConfigError(f"--ttl must be ≥ 1 second, got {self.ttl}")
        if not 0 <= self.drain_seconds <= 3600:
            raise ConfigError(f"--drain-seconds must be 0..3600, got {self.drain_seconds:g}")
        if not 0 < self.interval < self.ttl:
            # The lease is refreshed once per interval: at or above the TTL it would lapse between
            # refreshes and the replica would flap in and out of the registry.
            raise ConfigError(f"--interval must be > 0 and < --ttl ({self.ttl}s), got {self.interval:g}")


class ReplicaAgent:
    def __init__(self, options: AgentOptions, declared: Fingerprint, store: Store) -> None:
        self.options = options
        self.declared = declared
        self.agent_id = f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}"
        # A probe must not outlive the tick: a frozen engine then shows up as down within one interval.
        self.probe = EngineProbe(options.engine, timeout=max(0.2, min(options.interval, 2.0)))
        self.heartbeat = Heartbeat(
            ReplicaRegistry(store), options.advertise, ttl=options.ttl, interval=options.interval
        )
        self._healthy: bool | None = None
        self._draining_since: float | None = None  # monotonic: when the engine began to drain
        # A draining engine busy with what it finishes may miss one probe, and so may a healthy one too busy
        # to answer in time (slowness is not failure): only a second miss in a row withdraws it (withdrawn,
        # the attempts in flight there would be taken for lost). A refused connection withdraws it at once.
        self._missed = False
        self._ready_printed = False
        self.front: Any = None  # replica mode: the `ReplicaFront`; its Envoy dead → withdrawn like the engine

    async def _check(self) -> tuple[Fingerprint, EngineInfo]:
        if self.front is not None and not self.front.alive():
            raise EngineDown(f"front envoy on {self.options.front} is not running")
        return await self.probe.check(self.declared.model_id)

    async def tick(self) -> None:
        try:
            probed, info = await self._check()
        except EngineDraining as exc:
            self._missed = False
            await self._drain(exc)
            return
        except EngineDown as exc:
            tolerated = self._draining_since is not None or (exc.slow and self._healthy is True)
            if tolerated and not self._missed:
                self._missed = True
                state = "draining" if self._draining_since is not None else "busy"
                log.warning("engine %s %s, no answer (%s); kept once more", self.options.engine, state, exc)
                return
            self._missed = False
            if self._healthy is not False:
                log.warning("engine %s unhealthy (%s); withdrawing", self.options.engine, exc)
            self._healthy, self._draining_since = False, None
            await self.heartbeat.withdraw()
            return
        self._draining_since, self._missed = None, False
        try:
            fingerprint = merge(self.declared, probed)
        except FingerprintError:
            await self.heartbeat.withdraw()
            raise
        replica = Replica(
            address=self.options.advertise,
            fingerprint=fingerprint,
            digest=fingerprint.digest(),
            engine_name=fingerprint.engine_name,
            engine_version=fingerprint.engine_version,
            engine=info,
            registered_at=time.time(),
            agent_id=self.agent_id,
        )
        previous = self.heartbeat.wanted
        if previous is not None and previous.digest != replica.digest:
            log.warning("engine fingerprint changed: %s → %s", previous.digest, replica.digest)
        if self._healthy is not True:
            log.info(
                "engine %s (%s %s) healthy; fingerprint %s",
                self.options.engine,
                fingerprint.engine_name or "unnamed engine",
                fingerprint.engine_version or "of unknown version",
                replica.digest,
            )
            unknown = fingerprint.unknown_fields()
            if unknown:
                # Unknown is part of the digest (never matches a known value), but the operator should
                # state these in --fingerprint so that equal replicas are recognisably equal.
                log.warning("fingerprint fields neither in the file nor reported: %s", ", ".join(unknown))
        self._healthy = True
        await self.heartbeat.publish(replica)

    async def _drain(self, why: EngineDraining) -> None:
        """Keep the registration, marked draining: gateways send nothing new, the attempts in flight there
        are not lost and finish. Withdrawn when the engine stops answering, or after --drain-seconds."""
        registered = self.heartbeat.wanted
        now = time.monotonic()
        if self._draining_since is None:
            self._draining_since = now
            if registered is not None:
                log.warning(
                    "engine %s draining (%s): no new requests; those in flight finish (up to %gs)",
                    self.options.engine,
                    why,
                    self.options.drain_seconds,
                )
        if registered is None or now - self._draining_since >= self.options.drain_seconds:
            if self._healthy is not False:
                log.warning("engine %s drained or not registered; withdrawing", self.options.engine)
            self._healthy = False
            await self.heartbeat.withdraw()
            return
        self._healthy = None  # neither: a healthy answer later logs it again
        await self.heartbeat.publish(dataclasses.replace(registered, draining=True))

    def _report(self) -> None:
        if self.heartbeat.registered and not self._ready_printed:
            self._ready_printed = True
            wanted, lease = self.heartbeat.wanted, self.heartbeat.lease
            assert wanted is not None and lease is not None
            print(
                f"ready: replica {self.options.advertise} registered in etcd {self.options.etcd} "
                f"digest {wanted.digest} lease {lease.id:x} ttl {lease.ttl_seconds}s "
                f"interval {self.options.interval:g}s",
                flush=True,
            )

    async def run(self, stop: asyncio.Event) -> None:
        keep_alive = asyncio.create_task(self.heartbeat.run(), name="replica-heartbeat")
        loop = asyncio.get_running_loop()
        try:
            while not stop.is_set():
                started = loop.time()
                tick = asyncio.create_task(self.tick())
                stopped = asyncio.create_task(stop.wait())
                await asyncio.wait({tick, stopped}, return_when=asyncio.FIRST_COMPLETED)
                stopped.cancel()
                if not tick.done():  # asked to stop mid-probe: the withdrawal below is what matters
                    tick.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await tick
                    break
                tick.result()  # configuration errors end the agent
                self._report()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(
                        stop.wait(), max(0.0, started + self.options.interval - loop.time())
                    )
        finally:
            keep_alive.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await keep_alive
            await self.heartbeat.close()
            if self.heartbeat.wanted is None and self.heartbeat.in_sync:
                log.info("replica %s withdrawn", self.options.advertise)
            else:
                log.warning("could not withdraw %s; its lease will expire", self.options.advertise)


async def main_async(args: argparse.Namespace) -> int:
    options = AgentOptions.from_args(args)
    try:
        options.validate()
        declared = (
            load_fingerprint_file(options.fingerprint_file) if options.fingerprint_file else Fingerprint()
        )
    except (ConfigError, FingerprintError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    store = EtcdStore(options.etcd)
    try:
        try:
            await store.check()
        except StoreUnavailable as exc:
            print(
                f"error: etcd at {options.etcd} is unreachable ({exc}). Start etcd there, or point --etcd "
                "at a running one.",
                file=sys.stderr,
            )
            return 2
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        agent = ReplicaAgent(options, declared, store)
        front = None
        if options.front is not None:
            import tempfile
            from pathlib import Path

            from router_sidecar.runtime.replica_front import ReplicaFront

            front = ReplicaFront(
                store,
                front=options.front,
                engine=options.engine,
                work_dir=Path(tempfile.mkdtemp(prefix="router-sidecar-replica-")),
                margin=options.fence_margin,
            )
            try:
                await front.start()
            except Exception as exc:
                await front.stop()
                print(f"error: replica front on {options.front}: {exc}", file=sys.stderr)
                return 2
            agent.front = front
        try:
            await agent.run(stop)
        except FingerprintError as exc:
            print(f"error: engine {options.engine}: {exc}", file=sys.stderr)
            return 2
        finally:
            if front is not None:
                await front.stop()
        return 0
    finally:
        await store.close()
