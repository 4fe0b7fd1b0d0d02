"""A local endpoint picker (GAIE endpoint-picker protocol v1.0.0 over Envoy ext_proc) for tests and the demo.

Entry point: :func:`router_testbed.epp.server.main` (``router-testbed epp --listen HOST:PORT --endpoint
IP:PORT ...``, or ``python -m router_testbed.epp``). What it picks: :mod:`router_testbed.epp.picker`; the
ext_proc fields it reads and writes beyond the product's wire messages: :mod:`router_testbed.epp.wire`.
docs/endpoint-picker.md describes it.
"""


def main(argv: list[str] | None = None) -> int:
    """Run the picker (see :func:`router_testbed.epp.server.main`)."""
    from router_testbed.epp.server import main as _main

    return _main(argv)
