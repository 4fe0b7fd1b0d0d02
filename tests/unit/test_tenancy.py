"""Tenants: a keyed digest of the caller's credential, with one secret per deployment."""

from __future__ import annotations

import asyncio
import hashlib
from pathlib import Path

import pytest

from router_sidecar.coordination.store import MemoryStore
from router_sidecar.coordination.tenancy import SECRET_ENV, SECRET_KEY, TenantSecretError, load_tenant_secret
from router_sidecar.extproc.downstream import ANONYMOUS, tenant_of

SECRET = b"0123456789abcdef0123456789abcdef"


def test_the_digest_is_keyed_and_says_nothing_without_the_secret() -> None:
    headers = {"authorization": "Bearer alice"}
    tenant = tenant_of(headers, SECRET)
    assert tenant == tenant_of(headers, SECRET)  # stable: records are found again
    assert tenant != tenant_of(headers, b"another deployment's secret!!")
    assert tenant not in hashlib.sha256(b"Bearer alice").hexdigest()  # not the plain digest
    assert tenant != tenant_of({"authorization": "Bearer bob"}, SECRET)
    assert tenant_of({"x-api-key": "k"}, SECRET) != ANONYMOUS
    assert tenant_of({}, SECRET) == ANONYMOUS


def test_secret_from_a_file_then_the_environment_then_etcd(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = MemoryStore()
    monkeypatch.delenv(SECRET_ENV, raising=False)
    first = asyncio.run(load_tenant_secret(store, None))
    assert store.data[SECRET_KEY] == first and len(first) >= 32
    # A second gateway on the same etcd cluster gets the same secret.
    assert asyncio.run(load_tenant_secret(store, None)) == first
    monkeypatch.setenv(SECRET_ENV, "from-the-environment-0123")
    assert asyncio.run(load_tenant_secret(store, None)) == b"from-the-environment-0123"
    path = tmp_path / "secret"
    path.write_bytes(b"from-a-file-0123456789\n")
    assert asyncio.run(load_tenant_secret(store, str(path))) == b"from-a-file-0123456789"


def test_a_short_or_missing_secret_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = MemoryStore()
    with pytest.raises(TenantSecretError, match="cannot read"):
        asyncio.run(load_tenant_secret(store, str(tmp_path / "absent")))
    (tmp_path / "short").write_bytes(b"abc")
    with pytest.raises(TenantSecretError, match="at least 16"):
        asyncio.run(load_tenant_secret(store, str(tmp_path / "short")))
    monkeypatch.setenv(SECRET_ENV, "short")
    with pytest.raises(TenantSecretError, match="at least 16"):
        asyncio.run(load_tenant_secret(store, None))
