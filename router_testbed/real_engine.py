"""Real vLLM replicas for the real-engine test tier and `router-sidecar demo --real-vllm`.

One :class:`VllmReplica` is one ``vllm.entrypoints.openai.api_server`` process (from ``.venv-vllm``, built by
``make real-setup``) in its own session/process group, on 127.0.0.1, with every temp file, IPC socket and
cache inside its own temp dir, and thread settings that let two replicas share 2 cores (see
``REAL_ENGINE.md``). It runs three processes: API server -> ``VLLM::EngineCore`` -> ``VLLM::Worker``;
:meth:`VllmReplica.stop` kills the whole group (SIGTERM, then SIGKILL), since killing the API server alone
leaves ~2 GB of orphans.
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

from router_sidecar.runtime.supervise import _die_with_parent, free_port

REPO = Path(__file__).resolve().parents[1]
VLLM_VENV = REPO / ".venv-vllm"
TINY_MODEL = REPO / ".tools" / "tiny-model"
SERVED_MODEL_NAME = "tiny"
READY_TIMEOUT = 60.0


@dataclass(frozen=True)
class Installation:
    python: Path
    model: Path


def find_installation(venv: Path = VLLM_VENV, model: Path = TINY_MODEL) -> tuple[Installation | None, str]:
    """The vLLM venv and tiny model if `make real-setup` built them, else None and the reason why not."""
    python = venv / "bin" / "python"
    if not python.exists():
        return None, (
            f"{venv} is missing: run `make real-setup` (needs the local torch wheel "
            "/opt/wheels/torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl)"
        )
    if not (model / ".stamp").exists() or not (model / "config.json").exists():
        return None, f"the tiny model {model} is missing: run `make real-setup`"
    return Installation(python, model), ""


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


class VllmReplica:
    """One vLLM OpenAI API server on 127.0.0.1 in its own process group."""

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
        self.log_path = work / f"vllm-{name}.log"
        self.extra_args = list(extra_args or [])
        self.proc: subprocess.Popen[bytes] | None = None
        self.tmp: Path | None = None
        self._log_offset = 0
        self.started_in: float = 0.0

    # ------------------------------------------------------------------ lifecycle

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
        keep = ("PATH", "HOME", "LANG", "LC_ALL", "TERM", "USER")
        env = {k: os.environ[k] for k in keep if k in os.environ}
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

    def start(self, *, wait: bool = True, timeout: float = READY_TIMEOUT) -> None:
        """Start the server in its own session; with ``wait``, block until GET /health is 200."""
        if self.alive():
            raise RuntimeError(f"replica {self.name} is already running (pid {self.pid})")
        self._cleanup_tmp()
        self.tmp = Path(tempfile.mkdtemp(prefix=f"vllm-{self.name}-", dir=self.work))
        self.work.mkdir(parents=True, exist_ok=True)
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
                raise RuntimeError(f"vLLM {self.name} exited with {code} during start-up:\n{self.tail()}")
            if _health(self.url) == 200:
                self.started_in = time.monotonic() - self._t_start
                return self.started_in
            time.sleep(0.25)
        self.stop()
        raise TimeoutError(f"vLLM {self.name} not healthy within {timeout}s:\n{self.tail()}")

    def restart(self, timeout: float = READY_TIMEOUT) -> float:
        self.stop()
        self.start(wait=True, timeout=timeout)
        return self.started_in

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def healthy(self) -> bool:
        return self.alive() and _health(self.url) == 200

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM the whole process group, then SIGKILL whatever is left; reap; remove the temp dir."""
        if self.proc is not None:
            pgid = self.proc.pid
            if self.proc.poll() is None:
                self.signal_group(signal.SIGTERM)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.proc.wait(timeout)
            self.signal_group(signal.SIGKILL)  # leftovers (EngineCore, Worker) even if the server exited
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

    def terminate_api_server(self) -> None:
        """SIGTERM only the API server process (a graceful shutdown as Kubernetes would start it)."""
        if self.alive():
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGTERM)

    def engine_pids(self) -> dict[str, int]:
        """Pids of the engine processes under the API server: {'EngineCore': pid, 'Worker': pid} if found."""
        found: dict[str, int] = {}
        if not self.alive():
            return found
        todo = [self.pid]
        while todo:
            pid = todo.pop()
            for child in _children(pid):
                text = _comm_and_cmdline(child)
                for role in ("EngineCore", "Worker"):
                    if role in text and role not in found:
                        found[role] = child
                todo.append(child)
        return found

    def engine_worker_pid(self) -> int | None:
        """The process that runs the model: ``VLLM::Worker`` if there is one, else ``VLLM::EngineCore``."""
        pids = self.engine_pids()
        return pids.get("Worker") or pids.get("EngineCore")

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
        """vLLM's own request ids (``--enable-log-requests``: ``Received request <id>``) since start."""
        return re.findall(r"Received request (\S+?):", self.log_text())

    def aborted_request_ids(self) -> list[str]:
        """Request ids vLLM's log reports aborted (``Request <id> aborted.``) since start."""
        return re.findall(r"Request (\S+) aborted\.", self.log_text())


def start_replicas(
    names: list[str], install: Installation, work: Path, *, timeout: float = READY_TIMEOUT
) -> dict[str, VllmReplica]:
    """Start several replicas concurrently (they share the CPU while loading) and wait for all of them."""
    replicas = {name: VllmReplica(name, install, work) for name in names}
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
