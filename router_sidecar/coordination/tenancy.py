"""The per-deployment secret that keys credential digests (tenant ids are etcd key segments).

Every gateway of a deployment must use the same secret, or a tenant's records written through one gateway
are invisible through another. In order: the policy's `tenancy.secret_file`, the environment variable
ROUTER_SIDECAR_TENANT_SECRET, or a secret kept in etcd itself (created once by whichever gateway starts
first). The last is zero-configuration but protects only against readers who cannot read that key too.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

from router_sidecar.coordination.store import Store, keys

SECRET_ENV = "ROUTER_SIDECAR_TENANT_SECRET"
SECRET_KEY = keys.TENANT_SECRET


class TenantSecretError(ValueError):
    pass


async def load_tenant_secret(store: Store, secret_file: str | None) -> bytes:
    if secret_file is not None:
        try:
            secret = Path(secret_file).read_bytes().strip()
        except OSError as exc:
            raise TenantSecretError(
                f"cannot read tenancy.secret_file {secret_file}: {exc.strerror or exc}"
            ) from exc
        if len(secret) < 16:
            raise TenantSecretError(
                f"tenancy.secret_file {secret_file} holds {len(secret)} bytes; use at least 16"
            )
        return secret
    from_env = os.environ.get(SECRET_ENV, "").strip()
    if from_env:
        if len(from_env) < 16:
            raise TenantSecretError(f"${SECRET_ENV} is {len(from_env)} characters long; use at least 16")
        return from_env.encode()
    candidate = secrets.token_hex(32).encode()
    existing = await store.create(SECRET_KEY, candidate)
    return existing if existing is not None else candidate
