"""The deploy tier's fixture: every kustomization under deploy/, rendered once per session."""

from __future__ import annotations

import pytest

from tests.deploy.kube import KUSTOMIZATIONS, Obj, render


@pytest.fixture(scope="session")
def rendered() -> dict[str, list[Obj]]:
    return {name: render(name) for name in KUSTOMIZATIONS}
