"""Real engines for the real-engine test tier and `router-testbed demo --real-vllm`: vLLM and SGLang.

One replica is one engine server (from its own venv, built by ``make real-setup``) in its own session/process
group, on 127.0.0.1, with every temp file, IPC socket and cache inside its own temp dir, and thread settings
that let two replicas share 2 cores (see ``REAL_ENGINE.md`` and docs/real-engine.md). :meth:`stop` kills the
whole group (SIGTERM, then SIGKILL), since killing the server process alone can leave orphans.

* :class:`VllmReplica`: ``vllm.entrypoints.openai.api_server`` (``.venv-vllm``), three processes: API server
  -> ``VLLM::EngineCore`` -> ``VLLM::Worker`` (~2 GB of orphans if the API server alone is killed).
* :class:`SglangReplica`: ``sglang.launch_server`` (``.venv-sglang``, scripts/real_setup_sglang.sh), four
  processes: HTTP server/tokenizer manager -> ``sglang::scheduler``, ``sglang::detokenizer`` and a
  resource tracker.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from router_sidecar.runtime.supervise import _die_with_parent, free_port

REPO = Path(__file__).resolve().parents[2]  # the checkout: testbed/router_testbed/real_engine.py
VLLM_VENV = REPO / ".venv-vllm"
SGLANG_VENV = REPO / ".venv-sglang"
TINY_MODEL = REPO / ".tools" / "tiny-model"
SERVED_MODEL_NAME = "tiny"
READY_TIMEOUT = 60.0
TORCH_WHEEL = "/opt/wheels/torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl"


@dataclass(frozen=True)
class Installation:
    python: Path
    model: Path


def find_installation(venv: Path = VLLM_VENV, model: Path = TINY_MODEL) -> tuple[Installation | None, str]:
    """The vLLM venv and tiny model if `make real-setup` built them, else None and the reason why not."""
    python = venv / "bin" / "python"
    if not python.exists():
        return None, f"{venv} is missing: run `make real-setup` (needs the local torch wheel {TORCH_WHEEL})"
    if not (model / ".stamp").exists() or not (model / "config.json").exists():
        return None, f"the tiny model {model} is missing: run `make real-setup`"
    return Installation(python, model), ""


def find_sglang_installation(
    venv: Path = SGLANG_VENV, model: Path = TINY_MODEL
) -> tuple[Installation | None, str]:
    """The SGLang venv (with its sgl_kernel stand-in) and the tiny model, else None and the reason why not."""
    if not (venv / ".real-setup-stamp").exists() or not (venv / "bin" / "python").exists():
        return None, (
            f"{venv} is missing or incomplete: run `make real-setup` (scripts/real_setup_sglang.sh; needs "
            f"the local torch wheel {TORCH_WHEEL})"
        )
    if not (venv / SGLANG_KERNEL_STUB / "sgl_kernel" / "__init__.py").exists():
        return None, f"{venv / SGLANG_KERNEL_STUB} is missing: run `make real-setup`"
    return find_installation(venv, model)


SGLANG_KERNEL_STUB = "sgl-kernel-stub"  # inside .venv-sglang: the sgl_kernel stand-in, put on PYTHONPATH


def _health(url: str, timeout: float = 1.0) -> int:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=timeout) as response:
            return int(response.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)
    except OSError:
        return 0


def _children(pid: int) -> list[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    try:
        return [int(p) for p in path.read_text().split()]
    except OSError:
        return []


def _comm_and_cmdline(pid: int) -> str:
    try:
        comm = Path(f"/proc/{pid}/comm").read_text().strip()
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""
    return f"{comm} {cmdline}"


def _pgid_members(pgid: int) -> list[int]:
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # pid (comm) state ppid pgrp ...; comm may contain spaces and parentheses
        fields = stat[stat.rfind(")") + 2 :].split()
        if len(fields) > 2 and int(fields[2]) == pgid:
            members.append(int(entry.name))
    return members


class EngineReplica:
    """One engine server on 127.0.0.1 in its own process group: start, readiness, faults, its own log.

    Subclasses say how to launch it (:meth:`argv`, :meth:`env`) and how to read their log."""

    label = "engine"  # in messages
    prefix = "engine"  # of the log file and the temp dir
    health_timeout = 1.0  # of one GET /health while waiting for readiness
    stop_grace = 10.0  # SIGTERM to the group, then SIGKILL after this long

    def __init__(
        self,
        name: str,
        install: Installation,
        work: Path,
        *,
        port: int | None = None,
        extra_args: list[str] | None = None,
    ) -> None:
        self.name = name
        self.install = install
        self.work = work
        self.port = port or free_port()
        self.endpoint = f"127.0.0.1:{self.port}"
        self.url = f"http://{self.endpoint}"
        self.log_path = work / f"{self.prefix}-{name}.log"
        self.extra_args = list(extra_args or [])
        self.proc: subprocess.Popen[bytes] | None = None
        self.tmp: Path | None = None
        self._log_offset = 0
        self._t_start = 0.0
        self.started_in: float = 0.0

    # ------------------------------------------------------------------ lifecycle

    def argv(self) -> list[str]:
        raise NotImplementedError

    def env(self, tmp: Path) -> dict[str, str]:
        raise NotImplementedError

    @staticmethod
    def base_env() -> dict[str, str]:
        keep = ("PATH", "HOME", "LANG", "LC_ALL", "TERM", "USER")
        return {k: os.environ[k] for k in keep if k in os.environ}

    def start(self, *, wait: bool = True, timeout: float = READY_TIMEOUT) -> None:
        """Start the server in its own session; with ``wait``, block until GET /health is 200."""
        if self.alive():
            raise RuntimeError(f"replica {self.name} is already running (pid {self.pid})")
        self._cleanup_tmp()
        self.work.mkdir(parents=True, exist_ok=True)
        self.tmp = Path(tempfile.mkdtemp(prefix=f"{self.prefix}-{self.name}-", dir=self.work))
        with open(self.log_path, "ab") as log:
            log.write(f"\n===== start {time.strftime('%H:%M:%S')} port {self.port}\n".encode())
            log.flush()
            self._log_offset = log.tell()
            self.proc = subprocess.Popen(
                self.argv(),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=self.env(self.tmp),
                cwd=self.tmp,
                start_new_session=True,  # setsid: own process group, killed as a whole in stop()
                preexec_fn=_die_with_parent,
            )
        self._t_start = time.monotonic()
        if wait:
            self.wait_ready(timeout)

    def wait_ready(self, timeout: float = READY_TIMEOUT) -> float:
        """Poll GET /health until 200; raise (after stopping the group) on exit or at the deadline."""
        deadline = self._t_start + timeout
        while time.monotonic() < deadline:
            if not self.alive():
                code = self.proc.returncode if self.proc else None
                self.stop()
                raise RuntimeError(
                    f"{self.label} {self.name} exited with {code} during start-up:\n{self.tail()}"
                )
            if _health(self.url, self.health_timeout) == 200:
                self.started_in = time.monotonic() - self._t_start
                return self.started_in
            time.sleep(0.25)
        self.stop()
        raise TimeoutError(f"{self.label} {self.name} not healthy within {timeout}s:\n{self.tail()}")

    def restart(self, timeout: float = READY_TIMEOUT) -> float:
        self.stop()
        self.start(wait=True, timeout=timeout)
        return self.started_in

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def healthy(self) -> bool:
        return self.alive() and _health(self.url, self.health_timeout) == 200

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def stop(self, timeout: float | None = None) -> None:
        """SIGTERM the whole process group, then SIGKILL whatever is left; reap; remove the temp dir."""
        if self.proc is not None:
            pgid = self.proc.pid
            if self.proc.poll() is None:
                self.signal_group(signal.SIGTERM)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.proc.wait(self.stop_grace if timeout is None else timeout)
            self.signal_group(signal.SIGKILL)  # leftovers (engine children) even if the server exited
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(5)
            deadline = time.monotonic() + 10
            while _pgid_members(pgid) and time.monotonic() < deadline:
                time.sleep(0.05)
        self._cleanup_tmp()

    def _cleanup_tmp(self) -> None:
        if self.tmp is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
            self.tmp = None

    # ------------------------------------------------------------------ faults

    def signal_group(self, sig: int) -> None:
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, sig)

    def kill_group(self) -> None:
        """SIGKILL every process of the replica at once: the abrupt death of a pod."""
        self.signal_group(signal.SIGKILL)
        if self.proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(5)

    def descendants(self) -> dict[int, str]:
        """Every process under the server: pid -> its comm and command line."""
        found: dict[int, str] = {}
        if not self.alive():
            return found
        todo = [self.pid]
        while todo:
            for child in _children(todo.pop()):
                found[child] = _comm_and_cmdline(child)
                todo.append(child)
        return found

    # ------------------------------------------------------------------ log

    def log_text(self, *, since_start: bool = True) -> str:
        if not self.log_path.exists():
            return ""
        with open(self.log_path, "rb") as f:
            if since_start:
                f.seek(self._log_offset)
            return f.read().decode(errors="replace")

    def tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])

    def received_request_ids(self) -> list[str]:
        raise NotImplementedError

    def aborted_request_ids(self) -> list[str]:
        raise NotImplementedError


class VllmReplica(EngineReplica):
    """One vLLM OpenAI API server on 127.0.0.1 in its own process group."""

    label = "vLLM"
    prefix = "vllm"

    def argv(self) -> list[str]:
        return [
            str(self.install.python),
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(self.install.model),
            "--served-model-name",
            SERVED_MODEL_NAME,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--max-model-len",
            "1024",
            "--dtype",
            "bfloat16",
            "--enforce-eager",
            "--enable-auto-tool-choice",
            "--tool-call-parser",
            "hermes",
            "--enable-log-requests",
            *self.extra_args,
        ]

    def env(self, tmp: Path) -> dict[str, str]:
        env = self.base_env()
        for sub in ("tmp", "rpc", "cache", "inductor"):
            (tmp / sub).mkdir(parents=True, exist_ok=True)
        env.update(
            {
                "HF_HUB_OFFLINE": "1",
                "TRANSFORMERS_OFFLINE": "1",
                "VLLM_CPU_KVCACHE_SPACE": "1",
                "VLLM_HOST_IP": "127.0.0.1",
                "VLLM_CPU_OMP_THREADS_BIND": "nobind",
                "OMP_NUM_THREADS": "1",
                "VLLM_NO_USAGE_STATS": "1",
                "DO_NOT_TRACK": "1",
                "TMPDIR": str(tmp / "tmp"),
                "VLLM_RPC_BASE_PATH": str(tmp / "rpc"),
                "VLLM_CACHE_ROOT": str(tmp / "cache"),
                "TORCHINDUCTOR_CACHE_DIR": str(tmp / "inductor"),
                "HF_HOME": str(tmp / "cache" / "hf"),
                "XDG_CACHE_HOME": str(tmp / "cache"),
                "PYTHONUNBUFFERED": "1",
            }
        )
        return env

    def terminate_api_server(self) -> None:
        """SIGTERM only the API server process (a graceful shutdown as Kubernetes would start it)."""
        if self.alive():
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGTERM)

    def engine_pids(self) -> dict[str, int]:
        """Pids of the engine processes under the API server: {'EngineCore': pid, 'Worker': pid} if found."""
        found: dict[str, int] = {}
        for pid, text in self.descendants().items():
            for role in ("EngineCore", "Worker"):
                if role in text and role not in found:
                    found[role] = pid
        return found

    def engine_worker_pid(self) -> int | None:
        """The process that runs the model: ``VLLM::Worker`` if there is one, else ``VLLM::EngineCore``."""
        pids = self.engine_pids()
        return pids.get("Worker") or pids.get("EngineCore")

    def received_request_ids(self) -> list[str]:
        """vLLM's own request ids (``--enable-log-requests``: ``Received request <id>``) since start."""
        return re.findall(r"Received request (\S+?):", self.log_text())

    def aborted_request_ids(self) -> list[str]:
        """Request ids vLLM's log reports aborted (``Request <id> aborted.``) since start."""
        return re.findall(r"Request (\S+) aborted\.", self.log_text())


# What SGLang 0.5.23 logs, with `--log-requests --log-requests-level 0` and SGLANG_LOG_REQUEST_HEADERS naming
# our headers: `Receive: obj=GenerateReqInput(rid='<rid>', ...), headers={'x-request-id': '...', ...}`
# per request (its own health checks too, rid `HEALTH_CHECK_...`); and with `--log-level debug` the
# scheduler's `Abort running request. req.rid='<rid>'` (also `queued`, `chunked prefill`) when a request is
# aborted, e.g. because its client (the gateway) went away. Nothing is logged about an abort at info level.
_SGLANG_RECEIVED = re.compile(r"Receive: obj=GenerateReqInput\(rid='([^']+)'[^\n]*")
_SGLANG_HEADER = re.compile(r"headers=\{[^}\n]*'x-request-id': '([^']*)'")
_SGLANG_ABORTED = re.compile(r"Abort [a-z ]*request\. req\.rid='([^']+)'")
_SGLANG_HEALTH_RID = "HEALTH_CHECK"


class SglangReplica(EngineReplica):
    """One SGLang server (``sglang.launch_server``) on 127.0.0.1 in its own process group, on the CPU.

    Launched as scripts/real_setup_sglang.sh's venv allows: the plain PyTorch paths (this CPU has no AMX, so
    no CPU sgl-kernel), the ``sgl_kernel`` stand-in on PYTHONPATH. SGLang's ``/health`` runs a one-token
    generation and answers after ≥ 1 s; while it drains after SIGTERM it answers 503 at once.
    """

    label = "SGLang"
    prefix = "sglang"
    health_timeout = 5.0  # ≥ 1 s by design; more on a busy machine
    stop_grace = 1.0  # a SIGTERMed SGLang drains, checking every 5 s: tests need no drain at teardown

    def argv(self) -> list[str]:
        return [
            str(self.install.python),
            "-m",
            "sglang.launch_server",
            "--model-path",
            str(self.install.model),
            "--served-model-name",
            SERVED_MODEL_NAME,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--device",
            "cpu",
            # The paths that need no sgl-kernel (shared/reference/sglang-0.5.23-cpu).
            "--attention-backend",
            "torch_native",
            "--sampling-backend",
            "pytorch",
            "--disable-overlap-schedule",
            "--grammar-backend",
            "none",
            "--tp",
            "1",
            # The KV pool: 4096 tokens, not a fraction of the machine's memory.
            "--max-total-tokens",
            "4096",
            "--mem-fraction-static",
            "0.05",
            "--log-requests",
            "--log-requests-level",
            "0",
            "--log-level",
            "debug",  # the scheduler logs aborts only at debug level
            *self.extra_args,
        ]

    def env(self, tmp: Path) -> dict[str, str]:
        env = self.base_env()
        for sub in ("tmp", "cache"):
            (tmp / sub).mkdir(parents=True, exist_ok=True)
        env.update(
            {
                "PYTHONPATH": str(self.install.python.parent.parent / SGLANG_KERNEL_STUB),
                "SGLANG_USE_CPU_ENGINE": "1",
                "HF_HUB_OFFLINE": "1",
                "TRANSFORMERS_OFFLINE": "1",
                "OMP_NUM_THREADS": "1",
                # An explicit core list: SGLang then takes the KV pool size from --max-total-tokens instead of
                # a share of the NUMA node's memory. It pins nothing on a CPU without AMX (both replicas
                # float over both cores).
                "SGLANG_CPU_OMP_THREADS_BIND": "0",
                "SGLANG_LOG_REQUEST_HEADERS": "x-request-id,x-attempt-id",
                "TMPDIR": str(tmp / "tmp"),  # its ZMQ IPC sockets
                "HF_HOME": str(tmp / "cache" / "hf"),
                "XDG_CACHE_HOME": str(tmp / "cache"),
                "TRITON_CACHE_DIR": str(tmp / "cache" / "triton"),
                "TORCHINDUCTOR_CACHE_DIR": str(tmp / "cache" / "inductor"),
                "PYTHONUNBUFFERED": "1",
            }
        )
        return env

    def terminate_server(self) -> None:
        """SIGTERM the server process only, as Kubernetes would: SGLang drains (``/health`` 503 at once, new
        requests still served) and exits once nothing is left in flight."""
        if self.alive():
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGTERM)

    def kill_server(self) -> None:
        """SIGKILL the server process only: its children notice and die too (measured: the stream is cut
        within ~60 ms)."""
        if self.alive():
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)

    def scheduler_pid(self) -> int | None:
        """The ``sglang::scheduler`` process (it runs the model; comm is cut to 15 characters)."""
        return next((pid for pid, text in self.descendants().items() if "sglang::schedul" in text), None)

    def _received(self) -> list[tuple[str, str]]:
        out = []
        for line in _SGLANG_RECEIVED.finditer(self.log_text()):
            rid = line.group(1)
            if not rid.startswith(_SGLANG_HEALTH_RID):
                header = _SGLANG_HEADER.search(line.group(0))
                out.append((rid, header.group(1) if header else ""))
        return out

    def received_request_ids(self) -> list[str]:
        """SGLang's own request ids (``rid``) of the generation requests it received since start, in order;
        its own health checks left out."""
        return [rid for rid, _ in self._received()]

    def gateway_request_ids(self) -> dict[str, str]:
        """SGLang rid -> the ``x-request-id`` the gateway sent with it ("" when none)."""
        return dict(self._received())

    def rids_of(self, request_id: str) -> list[str]:
        """SGLang's rids for the attempts of the gateway's request ``request_id`` that reached it."""
        return [rid for rid, header in self._received() if header == request_id]

    def aborted_request_ids(self) -> list[str]:
        """SGLang rids its scheduler reports aborted since start (health checks left out)."""
        return [r for r in _SGLANG_ABORTED.findall(self.log_text()) if not r.startswith(_SGLANG_HEALTH_RID)]


def start_replicas(
    names: list[str], install: Installation, work: Path, *, timeout: float = READY_TIMEOUT
) -> dict[str, VllmReplica]:
    """Start several vLLM replicas at once (they share the CPU while loading) and wait for all of them."""
    return _start_all({name: VllmReplica(name, install, work) for name in names}, timeout)


def start_sglang_replicas(
    names: list[str], install: Installation, work: Path, *, timeout: float = READY_TIMEOUT
) -> dict[str, SglangReplica]:
    """Start several SGLang replicas concurrently and wait for all of them."""
    return _start_all({name: SglangReplica(name, install, work) for name in names}, timeout)


R = TypeVar("R", bound=EngineReplica)


def _start_all(replicas: dict[str, R], timeout: float) -> dict[str, R]:
    try:
        for replica in replicas.values():
            replica.start(wait=False)
        for replica in replicas.values():
            replica.wait_ready(timeout)
    except BaseException:
        for replica in replicas.values():
            replica.stop()
        raise
    return replicas
