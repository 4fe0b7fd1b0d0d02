from __future__ import annotations

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
