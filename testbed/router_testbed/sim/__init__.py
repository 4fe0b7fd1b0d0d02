"""vLLM 0.32 / SGLang 0.5.23 replica simulator: deterministic OpenAI-compatible streaming with fault
injection, in either engine's dialect (``--dialect vllm|sglang``).

Entry point: :func:`router_testbed.sim.server.main`
(``python -m router_testbed.sim --listen HOST:PORT``). Log helpers for tests:
:func:`router_testbed.sim.log.read_log`, :func:`router_testbed.sim.log.wait_for`.
"""

from router_testbed.sim.faults import FaultSpecError, parse_fault_spec
from router_testbed.sim.log import read_log, wait_for

__all__ = ["FaultSpecError", "main", "parse_fault_spec", "read_log", "wait_for"]


def main(argv: list[str] | None = None) -> int:
    """Run the simulator (see :func:`router_testbed.sim.server.main`)."""
    from router_testbed.sim.server import main as _main

    return _main(argv)
