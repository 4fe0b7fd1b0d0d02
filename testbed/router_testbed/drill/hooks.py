"""Faults against real replicas: `--kill-cmd`, `--freeze-cmd`, `--thaw-cmd` shell hooks.

A hook is a shell command run on the drill's host with the replica it targets substituted for
``{replica}`` (``HOST:PORT``, as the gateway's journal names the attempt's replica), ``{host}`` and
``{port}``; each value is shell-quoted. For example::

    --kill-cmd   'ssh {host} sudo systemctl kill -s KILL vllm@{port}'
    --freeze-cmd 'kubectl exec $(./pod-of {replica}) -- kill -STOP 1'

A hook runs in its own process group with a timeout; on timeout the whole group is killed (only what the
hook started). Its exit status and output are recorded as evidence: a failed hook makes the scenario fail
with the hook's output, never silently pass without its fault.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import subprocess
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from router_testbed.drill.evidence import HookRun

ACTIONS = ("kill", "freeze", "thaw")
DEFAULT_HOOK_TIMEOUT = 30.0

# An in-process hook (the demo's, on replicas it started itself): returns (exit status, output).
HookFunction = Callable[[str], tuple[int, str]]


def render(template: str, replica: str) -> str:
    """The command for one replica: ``{replica}``, ``{host}``, ``{port}`` replaced, shell-quoted."""
    host, _, port = replica.rpartition(":")
    values = {"{replica}": replica, "{host}": host.strip("[]") or replica, "{port}": port}
    command = template
    for placeholder, value in values.items():
        command = command.replace(placeholder, shlex.quote(value))
    return command


def run_shell(command: str, timeout: float) -> tuple[int | None, str]:
    """Run `command` with /bin/sh in its own process group; (exit status or None on timeout, output)."""
    proc = subprocess.Popen(
        command,
        shell=True,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        output, _ = proc.communicate(timeout=timeout)
        return proc.returncode, output.decode("utf-8", "replace")
    except subprocess.TimeoutExpired:
        # Only the hook's own group: it may have started children (ssh, kubectl) that outlive the shell.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        return None, output.decode("utf-8", "replace")


@dataclass
class Hooks:
    """The hooks a drill run may use, by action ("kill", "freeze", "thaw")."""

    commands: Mapping[str, str] = field(default_factory=dict)  # action -> shell template
    functions: Mapping[str, HookFunction] = field(default_factory=dict)  # action -> in-process hook
    timeout: float = DEFAULT_HOOK_TIMEOUT

    def can(self, action: str) -> bool:
        return action in self.commands or action in self.functions

    @property
    def available(self) -> set[str]:
        return {a for a in ACTIONS if self.can(a)}

    def run(self, action: str, replica: str) -> HookRun:
        started = time.time()
        if action in self.functions:
            code: int | None
            try:
                code, output = self.functions[action](replica)
            except Exception as exc:  # a broken hook is evidence, not a crash of the drill
                code, output = 1, f"{type(exc).__name__}: {exc}"
            return HookRun(action, replica, f"(in-process {action})", started, time.time(), code, output)
        if action not in self.commands:
            return HookRun(action, replica, "", started, started, 127, f"no --{action}-cmd given")
        command = render(self.commands[action], replica)
        code, output = run_shell(command, self.timeout)
        return HookRun(action, replica, command, started, time.time(), code, output[-4000:])
