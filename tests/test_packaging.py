"""`pip install .` alone must import everything a run needs (issue 26): every third-party module
imported at module level by the shipped packages belongs to a core dependency of
pyproject.toml or to one of their own requirements, never only to an extra (test, bench)."""
from __future__ import annotations

import ast
import importlib.metadata as md
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("apex_bdq", "actors", "learner", "replay_server", "launch")


def _core_requirements() -> list[Requirement]:
    tomllib = pytest.importorskip("tomllib", reason="Python < 3.11 has no tomllib")
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return [Requirement(r) for r in data["project"]["dependencies"]]


def _closure(reqs: list[Requirement]) -> set[str]:
    """Distributions installed by the core requirements, transitively (with their extras)."""
    seen: set[str] = set()
    todo = [(r, frozenset(r.extras)) for r in reqs]
    while todo:
        req, extras = todo.pop()
        name = canonicalize_name(req.name)
        key = f"{name}[{','.join(sorted(extras))}]"
        if key in seen:
            continue
        seen.add(key)
        try:
            sub = md.requires(req.name) or []
        except md.PackageNotFoundError:
            continue
        for s in sub:
            r = Requirement(s)
            if r.marker is not None:
                envs = [{"extra": e} for e in extras] or [{"extra": ""}]
                if not any(r.marker.evaluate(env) for env in envs):
                    continue
            todo.append((r, frozenset(r.extras)))
    return {k.split("[")[0] for k in seen}


def _module_level_imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    mods: set[str] = set()
    for node in tree.body:  # module level only: what `import package.module` runs
        if isinstance(node, ast.Import):
            mods.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            mods.add(node.module.split(".")[0])
    return mods


def test_core_dependencies_cover_every_module_level_import():
    installed = _closure(_core_requirements())
    owners = md.packages_distributions()
    local = set(PACKAGES) | {"tests"}
    missing: dict[str, list[str]] = {}
    for pkg in PACKAGES:
        for f in sorted((ROOT / pkg).rglob("*.py")):
            rel = f.relative_to(ROOT).as_posix()
            for mod in _module_level_imports(f):
                if mod in local or mod in sys.stdlib_module_names or mod == "__future__":
                    continue
                dists = {canonicalize_name(d) for d in owners.get(mod, [])}
                assert dists, f"{rel} imports {mod!r}, which no installed distribution provides"
                if not dists & installed:
                    missing.setdefault(mod, []).append(rel)
    assert not missing, ("imported at module level but not installed by pyproject.toml's core "
                         f"dependencies (only by an extra, or not at all): {missing}")


def test_scipy_is_a_core_dependency_for_the_simulator():
    # the case the issue found: apex_bdq.sim.queueing imports scipy at module level
    assert "scipy" in _module_level_imports(ROOT / "apex_bdq/sim/queueing.py")
    assert "scipy" in {canonicalize_name(r.name) for r in _core_requirements()}


def test_the_haproxy_rewrite_touches_only_the_stats_page_and_exporter():
    from apex_bdq.haproxy_ingress import loopback_only
    cfg = ("global\n    stats socket /x/admin.sock mode 666 level admin expose-fd listeners\n"
           "frontend prometheus\n    bind :9101\n    mode http\n"
           "frontend http_frontend\n    bind *:8000\n    mode http\n"
           "listen stats\n  bind *:8404\n  stats enable\n")
    out = loopback_only(cfg)
    assert "bind 127.0.0.1:9101" in out and "bind 127.0.0.1:8404" in out
    assert "bind *:8000" in out  # the service keeps the host the user chose (--host 0.0.0.0)
    assert "mode 600 level admin" in out and "mode 666" not in out
