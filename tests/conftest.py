from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

from router_sidecar.runtime.supervise import start_etcd


@pytest.fixture(scope="session")
def etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    work = tmp_path_factory.mktemp("etcd")
    child, endpoint = start_etcd(work / "data", log_path=work / "etcd.log")
    try:
        yield endpoint
    finally:
        child.stop()


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    """Before a failure is reported, collect the garbage. pytest parses the failing test's source (`ast`) to
    show it; on CPython 3.11.7 a collection that runs finalizers (Python code: an orphaned asyncio task's, a
    closed loop's) in the middle of that parse can end it with "AST constructor recursion depth mismatch",
    and pytest's INTERNALERROR then stops the whole run (CI, 5 December 2026). Collected first, they run
    here, where nothing else is being built."""
    if call.excinfo is not None:
        gc.collect()
    yield
