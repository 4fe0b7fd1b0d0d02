"""The deploy tier's fixture: every kustomization under deploy/ and every render of the Helm chart, each
rendered once per session, when a test first asks for it (a missing kubectl or helm skips, or in CI fails,
only the tests that need it)."""

from __future__ import annotations

import pytest

from tests.deploy.chart import render_any
from tests.deploy.kube import Obj


class Renders(dict[str, list[Obj]]):
    def __missing__(self, name: str) -> list[Obj]:
        objects = render_any(name)
        self[name] = objects
        return objects


@pytest.fixture(scope="session")
def rendered() -> dict[str, list[Obj]]:
    return Renders()
