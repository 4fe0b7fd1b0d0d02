"""`router-testbed demo`: etcd + two simulated replicas + the gateway on loopback, then the drill against it.

Beside it, a fallback pool for the drill's `fallback` scene: two replicas of the same model and one of
another (`big`), each registered in etcd by its `router-sidecar replica` agent, behind a second gateway whose
policy falls back to `big` (a fallback needs discovery: the registry says which replica serves which model;
static `--replica`s are refused with it). Every replica of the requested model answers 503 there, and the
scene shows `big` answering, said out loud.

The demo only builds the stack; the scenarios, their checks and the reports are the drill's
(`router_testbed.drill`, the same code as `router-testbed drill --gateway URL`), run in-process with the
simulator's fault header, the replicas' own logs, and in-process hooks that freeze and thaw a replica
(SIGSTOP/SIGCONT: a path lost with the process alive). It prints the drill's verdict table and writes its
HTML report (a timeline per request) and JSON results into the work dir, whose path it prints; the report
is kept after the run, the rest of the work dir only with ``--keep``.

``--real-vllm`` runs two real vLLM replicas instead and the drill in hooks mode, with in-process hooks
that kill, freeze and thaw a replica's process group (without the fallback pool: its scene needs the
simulator's fault).

Exit code 0 only if every scenario passed. Every process runs on 127.0.0.1 and is stopped in a
``finally`` (also on Ctrl-C and SIGTERM).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from router_sidecar.runtime.supervise import Child, envoy_admin, find_etcd, free_port, http_ok, wait_until
from router_testbed.drill import Options, run
from router_testbed.drill.report import Style
from router_testbed.drill.scenarios import Scenario
from router_testbed.sim.process import SimProcess, spawn

REPLICA_NAMES = ("replica-a", "replica-b")
MODEL = "tiny"  # what the demo's replicas serve (the simulator's default)
FALLBACK_MODEL = "big"
# The fallback scene's pool, by replica name: the requested model's replicas (all of them fail) and one of
# the model the policy falls back to.
FALLBACK_POOL = {"tiny-a": MODEL, "tiny-b": MODEL, "big-a": FALLBACK_MODEL}
FALLBACK_POLICY = f"fallback:\n  models: [{FALLBACK_MODEL}]\n  causes: [failed_before_content]\n"
GATEWAY_START_TIMEOUT = 40.0
PREFILL_DELAY = 0.05
TOKEN_INTERVAL = 0.02
FAST_TOKEN_INTERVAL = 0.002
CREDENTIAL = "demo"  # journal look-ups are scoped to a credential (and refused without one)
REPORT = "drill-report.html"
RESULTS = "drill-results.json"


S = Style(sys.stdout.isatty() and not os.environ.get("NO_COLOR"))


def out(text: str = "", end: str = "\n") -> None:
    print(text, end=end, flush=True)


# --------------------------------------------------------------------------- the stack


class Stack:
    """etcd, two simulated replicas and the gateway, all on loopback under ``work``; with ``fallback_pool``
    also the fallback scene's replicas, their agents and its gateway."""

    def __init__(self, work: Path, *, token_interval: float, fallback_pool: bool = False) -> None:
        self.work = work
        self.token_interval = token_interval
        self.etcd: Child | None = None
        self.etcd_endpoint = ""
        self.sims: dict[str, SimProcess] = {}
        self.gateway: subprocess.Popen[bytes] | None = None
        self.url = ""
        self.with_fallback_pool = fallback_pool
        self.pool_sims: dict[str, SimProcess] = {}
        self.agents: list[Child] = []
        self.fallback_gateway: subprocess.Popen[bytes] | None = None
        self.fallback_url = ""
        self.fallback_pool_up = False

    def sim_log(self, name: str) -> Path:
        return self.work / f"sim-{name}.jsonl"

    def replica_logs(self) -> list[Path]:
        """Every simulated replica's log, the fallback pool's too: the drill reads what each one saw."""
        return [self.sim_log(name) for name in (*REPLICA_NAMES, *self.pool_sims)]

    def _spawn_sim(self, name: str, port: int = 0, model: str = MODEL) -> SimProcess:
        args = ["--prefill-delay", str(PREFILL_DELAY), "--token-interval", str(self.token_interval)]
        return spawn(name=name, port=port, log_path=self.sim_log(name), args=[*args, "--model", model])

    def _start_etcd(self) -> None:
        # Like supervise.start_etcd, but the Child is ours before the health wait, so a Ctrl-C or a
        # failed start-up still stops it.
        peer = free_port()
        self.etcd_endpoint = f"127.0.0.1:{free_port()}"
        client_url, peer_url = f"http://{self.etcd_endpoint}", f"http://127.0.0.1:{peer}"
        options = {
            "--name": "demo",
            "--data-dir": str(self.work / "etcd-data"),
            "--listen-client-urls": client_url,
            "--advertise-client-urls": client_url,
            "--listen-peer-urls": peer_url,
            "--initial-advertise-peer-urls": peer_url,
            "--initial-cluster": f"demo={peer_url}",
            "--log-level": "warn",
        }
        argv = [find_etcd(), *(part for item in options.items() for part in item)]
        self.etcd = Child("etcd", argv, log_path=self.work / "etcd.log")
        wait_until(
            lambda: http_ok(f"{client_url}/health"),
            timeout=20,
            what=f"etcd on {self.etcd_endpoint}",
            child=self.etcd,
        )

    def start(self) -> None:
        """Everything, up; the fallback pool and its gateway only launched (`wait_fallback_pool`)."""
        t0 = time.monotonic()
        self._start_etcd()
        if self.with_fallback_pool:
            # First: a gateway without --replica takes its replicas from the registry, and its Envoy warms
            # its EDS cluster for up to 5 s at start-up; that overlaps the rest of the demo.
            policy = self.work / "fallback-policy.yaml"
            policy.write_text(FALLBACK_POLICY)
            self.fallback_gateway, self.fallback_url = self._launch_gateway(
                "gateway-fallback", ["--policy", str(policy)]
            )
        self._start_replicas()
        if self.with_fallback_pool:
            self._start_fallback_pool()
        static = [arg for address in self.replica_addresses().values() for arg in ("--replica", address)]
        self.gateway, self.url = self._launch_gateway("gateway", static)
        self._wait_ready("gateway", self.gateway)
        out(S.dim(f"  etcd {self.etcd_endpoint}; {self.describe_replicas()}"))
        out(
            S.dim(
                f"  gateway {self.url} (Envoy + sidecar, pid {self.gateway.pid}); "
                f"up in {time.monotonic() - t0:.1f}s"
            )
        )

    def wait_fallback_pool(self) -> None:
        """Until the fallback gateway is ready and its Envoy has every replica of the pool as a healthy host
        (the scene must meet all of the requested model's replicas failing, and the fallback model's)."""
        if self.fallback_gateway is None or self.fallback_pool_up:
            return
        self._wait_ready("gateway-fallback", self.fallback_gateway)
        admin = self.work / "gateway-fallback" / "admin.sock"
        wanted = {sim.address for sim in self.pool_sims.values()}

        def routable() -> bool:
            for agent in self.agents:
                if not agent.alive():
                    raise RuntimeError(f"{agent.name} exited with {agent.proc.returncode}:\n{agent.tail()}")
            answer = envoy_admin(admin, "/clusters")
            lines = answer[1].decode().splitlines() if answer is not None and answer[0] == 200 else []
            rows = [line.split("::") for line in lines]  # llm::HOST:PORT::health_flags::healthy
            return wanted <= {r[1] for r in rows if r[0] == "llm" and r[2:] == ["health_flags", "healthy"]}

        wait_until(routable, timeout=GATEWAY_START_TIMEOUT, what="the fallback pool healthy in its gateway")
        self.fallback_pool_up = True
        pool = ", ".join(f"{n} {s.address} ({FALLBACK_POOL[n]})" for n, s in self.pool_sims.items())
        out(
            S.dim(
                f"  fallback gateway {self.fallback_url} (Envoy + sidecar, pid {self.fallback_gateway.pid}; "
                f"policy fallback.models [{FALLBACK_MODEL}]) over {pool}, registered by their agents\n"
            )
        )

    def before_scenario(self, scenario: Scenario) -> None:
        """Before each drill scenario: the fallback scene's gateway and pool must be up."""
        if scenario.needs_fallback:
            self.wait_fallback_pool()

    def _launch_gateway(self, name: str, args: list[str]) -> tuple[subprocess.Popen[bytes], str]:
        """`router-sidecar gateway` on a free port with these extra arguments, its output in `name`.out/.err
        and its work dir (Envoy's admin socket) in `name`/; not waited for (`_wait_ready`)."""
        port = free_port()
        argv = [
            sys.executable,
            "-m",
            "router_sidecar",
            "gateway",
            "--listen",
            f"127.0.0.1:{port}",
            "--etcd",
            self.etcd_endpoint,
            "--work-dir",
            str(self.work / name),
            *args,
        ]
        with open(self.work / f"{name}.out", "wb") as stdout, open(self.work / f"{name}.err", "wb") as stderr:
            # Own session: Ctrl-C reaches only the demo, which then stops the gateway in order.
            proc = subprocess.Popen(
                argv, stdout=stdout, stderr=stderr, stdin=subprocess.DEVNULL, start_new_session=True
            )
        return proc, f"http://127.0.0.1:{port}"

    def _wait_ready(self, name: str, proc: subprocess.Popen[bytes]) -> None:
        """Until the gateway says `ready:` (it has a replica to send to)."""
        said = self.work / f"{name}.out"
        deadline = time.monotonic() + GATEWAY_START_TIMEOUT
        while not any(line.startswith(b"ready:") for line in said.read_bytes().splitlines()):
            if proc.poll() is not None or time.monotonic() > deadline:
                err = (self.work / f"{name}.err").read_text(errors="replace")[-3000:]
                raise RuntimeError(f"{name} did not become ready (exit {proc.poll()}):\n{err}")
            time.sleep(0.05)

    def _start_fallback_pool(self) -> None:
        """The fallback scene's replicas, each with a `router-sidecar replica` agent registering it (and the
        model it serves) in etcd; the agents are not waited for (`wait_fallback_pool`)."""
        for name, model in FALLBACK_POOL.items():
            self.pool_sims[name] = self._spawn_sim(name, model=model)
        for name, sim in self.pool_sims.items():
            argv = [sys.executable, "-m", "router_sidecar", "replica", "--engine", sim.address]
            argv += ["--advertise", sim.address, "--etcd", self.etcd_endpoint]
            self.agents.append(Child(f"agent-{name}", argv, log_path=self.work / f"agent-{name}.log"))

    def _start_replicas(self) -> None:
        for name in REPLICA_NAMES:
            self.sims[name] = self._spawn_sim(name)

    def replica_addresses(self) -> dict[str, str]:
        return {name: sim.address for name, sim in self.sims.items()}

    def describe_replicas(self) -> str:
        return ", ".join(f"{n} {s.address} (pid {s.pid})" for n, s in self.sims.items())

    def check_gateway(self) -> None:
        """Fail loudly if a gateway process is gone (its exit code tells a crash from a signal)."""
        for name, proc in (("gateway", self.gateway), ("gateway-fallback", self.fallback_gateway)):
            if proc is not None and (code := proc.poll()) is not None:
                err = (self.work / f"{name}.err").read_text(errors="replace")[-2000:]
                raise RuntimeError(
                    f"the {name} process exited with {code} (negative = killed by that signal):\n{err}"
                )

    def restart_dead_sims(self) -> list[str]:
        """Start again, on the same port, every replica whose process has exited."""
        restarted = []
        for name, sim in self.sims.items():
            if sim.proc.poll() is not None:
                code = sim.stop()
                self.sims[name] = self._spawn_sim(name, sim.port)
                restarted.append(
                    f"{name} (exited with {code}; restarted on {sim.address}, pid {self.sims[name].pid})"
                )
        return restarted

    def signal_replica(self, address: str, sig: int) -> tuple[int, str]:
        """The drill's in-process hook: a signal to the simulator at `address` (SIGSTOP/SIGCONT: a replica
        frozen, then thawed: alive, connected, silent)."""
        sim = next((s for s in self.sims.values() if s.address == address), None)
        if sim is None:
            return 1, f"no replica of this demo listens on {address}"
        with contextlib.suppress(ProcessLookupError):
            os.kill(sim.pid, sig)
        return 0, f"{signal.Signals(sig).name} to {sim.name} (pid {sim.pid})"

    def between_scenarios(self) -> None:
        """After each drill scenario: the gateway must still run; a replica that died is started again."""
        self.check_gateway()
        for note in self.restart_dead_sims():
            out(S.yellow(f"  note: replica process gone: {note}"))

    def stop(self) -> None:
        """Stop the gateways (each stops its Envoy), the agents, then the replicas, then etcd; each even if
        another fails."""
        try:
            for proc in (self.gateway, self.fallback_gateway):
                with contextlib.suppress(Exception):
                    _stop_gateway(proc)
            for agent in self.agents:
                with contextlib.suppress(Exception):
                    agent.stop()
        finally:
            for sim in (*self.sims.values(), *self.pool_sims.values()):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(sim.pid, signal.SIGCONT)  # a frozen replica must be able to act on SIGTERM
                with contextlib.suppress(Exception):
                    sim.stop()
            self._stop_replicas()
            if self.etcd is not None:
                self.etcd.stop()

    def _stop_replicas(self) -> None:
        """Extra replicas of a subclass (the simulators are stopped in ``stop``)."""


def _stop_gateway(proc: subprocess.Popen[bytes] | None) -> None:
    """SIGTERM to the gateway's session (it stops Envoy), SIGKILL if it is still there after 15 s."""
    if proc is None or proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(15)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(5)


# --------------------------------------------------------------------------- --real-vllm

REAL_START_TIMEOUT = 150.0  # two replicas load at once on 2 cores (SGLang: up to ~90 s on a busy one)


ENGINE_NAMES = {"vllm": "vLLM", "sglang": "SGLang"}


class RealStack(Stack):
    """etcd, two real engine replicas (vLLM or SGLang, ``router_testbed.real_engine``) and the gateway."""

    def __init__(self, work: Path, engine: str = "vllm") -> None:
        super().__init__(work, token_interval=0.0)
        from router_testbed.real_engine import EngineReplica

        self.engine = engine
        self.vllm: dict[str, EngineReplica] = {}

    def _start_replicas(self) -> None:
        from router_testbed import real_engine

        if self.engine == "sglang":
            install, why = real_engine.find_sglang_installation()
            start = real_engine.start_sglang_replicas
        else:
            install, why = real_engine.find_installation()
            start = real_engine.start_replicas  # type: ignore[assignment]
        if install is None:
            raise RuntimeError(why)
        name = ENGINE_NAMES[self.engine]
        out(S.dim(f"  starting 2 {name} replicas (tiny random-weight model, CPU): 25-90 s ..."))
        self.vllm = dict(start(list(REPLICA_NAMES), install, self.work, timeout=REAL_START_TIMEOUT))

    def replica_addresses(self) -> dict[str, str]:
        return {name: r.endpoint for name, r in self.vllm.items()}

    def describe_replicas(self) -> str:
        engine = ENGINE_NAMES[self.engine]
        return ", ".join(
            f"{n} {engine} {r.endpoint} (pid {r.pid}, ready in {r.started_in:.0f}s)"
            for n, r in self.vllm.items()
        )

    def signal_replica(self, address: str, sig: int) -> tuple[int, str]:
        """The drill's in-process hook: a signal to the whole process group of the replica at `address`
        (SIGKILL: a pod's abrupt death; SIGSTOP/SIGCONT: a frozen, then thawed, replica)."""
        replica = next((r for r in self.vllm.values() if r.endpoint == address), None)
        if replica is None:
            return 1, f"no replica of this demo listens on {address}"
        if sig == signal.SIGKILL:
            replica.kill_group()
        else:
            replica.signal_group(sig)
        return 0, f"{signal.Signals(sig).name} to the process group of {replica.name} (pid {replica.pid})"

    def _stop_replicas(self) -> None:
        for r in self.vllm.values():
            with contextlib.suppress(Exception):
                r.signal_group(signal.SIGCONT)  # a frozen replica must be able to act on SIGTERM
                r.stop()


# --------------------------------------------------------------------------- main


@contextlib.contextmanager
def _sigterm_as_interrupt() -> Iterator[None]:
    """Turn SIGTERM into KeyboardInterrupt so the ``finally`` still stops every child."""

    def handler(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _drill_options(stack: Stack, work: Path, *, real: bool) -> Options:
    options = Options(
        gateway=stack.url,
        credential=CREDENTIAL,
        report=work / REPORT,
        json_path=work / RESULTS,
        color=S.enabled,
    )
    # The replicas are the demo's own processes: the hooks are in-process signals to them.
    signals = {"freeze": signal.SIGSTOP, "thaw": signal.SIGCONT}
    if real:
        signals["kill"] = signal.SIGKILL
        options.fault_mode = "hooks"
        options.timeout = 60.0  # a frozen replica is lost by the sidecar's health probe, on a busy CPU
    else:
        options.fault_mode = "sim"
        options.replica_logs = stack.replica_logs()
    if stack.fallback_url:
        # The fallback scene: its own gateway, whose policy falls back from the demo's model to big's.
        options.model = MODEL
        options.fallback_model = FALLBACK_MODEL
        options.fallback_gateway = stack.fallback_url
    options.hook_functions = {
        action: (lambda address, sig=sig: stack.signal_replica(address, sig))
        for action, sig in signals.items()
    }
    return options


def _tidy(work: Path, keep: bool) -> None:
    """Keep the reports; the rest of the work dir (logs, etcd data) only with --keep, or when the drill
    could not run (its logs say why)."""
    if keep:
        out(f"kept {work} (logs, etcd data, reports)")
        return
    for entry in work.iterdir():
        if entry.name in (REPORT, RESULTS):
            continue
        if entry.is_dir():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)
    with contextlib.suppress(OSError):
        work.rmdir()  # only if nothing was kept (the run stopped before the drill)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="router-testbed demo", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--keep", action="store_true", help="keep the whole work dir (logs, etcd data), not only the report"
    )
    parser.add_argument(
        "--fast", action="store_true", help=f"token interval {FAST_TOKEN_INTERVAL}s (for tests)"
    )
    real = parser.add_mutually_exclusive_group()
    real.add_argument(
        "--real-vllm",
        action="store_true",
        help="real vLLM replicas (tiny local model, CPU; needs `make real-setup`) instead of the simulator",
    )
    real.add_argument(
        "--real-sglang",
        action="store_true",
        help="real SGLang replicas (tiny local model, CPU; needs `make real-setup`) instead of the simulator",
    )
    args = parser.parse_args(argv)
    args.real = args.real_vllm or args.real_sglang
    work = Path(tempfile.mkdtemp(prefix="router-sidecar-demo-"))
    stack: Stack
    if args.real:
        engine = "sglang" if args.real_sglang else "vllm"
        stack = RealStack(work, engine)
        what = f"etcd + 2 real {ENGINE_NAMES[engine]} replicas + Envoy, faults by hooks on their processes"
    else:
        token_interval = FAST_TOKEN_INTERVAL if args.fast else TOKEN_INTERVAL
        stack = Stack(work, token_interval=token_interval, fallback_pool=True)
        what = (
            "etcd + 2 simulated replicas + Envoy, and a fallback pool (2 replicas of tiny, 1 of big) behind "
            "a second gateway; faults by the simulator's x-sim-fault header"
        )
    code = 1
    ran = False  # whether the drill ran: if not, the logs are what is left to look at
    try:
        with _sigterm_as_interrupt():
            out(S.bold(f"router-testbed demo: first-delta failover, on {what}"))
            stack.start()
            out()
            options = _drill_options(stack, work, real=args.real)
            # A killed engine takes 30+ s to come back and the kill runs last: nothing to restart for.
            between = None if args.real else stack.between_scenarios
            code = run(options, before=stack.before_scenario, between=between)
            ran = True
            stack.check_gateway()
    except KeyboardInterrupt:
        out(S.red("\ninterrupted; stopping everything"))
        code = 130
    except Exception as exc:
        out(S.red(f"\ndemo could not run: {type(exc).__name__}: {exc}"))
        code = 1
    finally:
        stack.stop()
        _tidy(work, args.keep or not ran)
    return code


if __name__ == "__main__":
    sys.exit(main())
