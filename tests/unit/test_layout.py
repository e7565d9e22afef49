"""The house's shape (issue 34): file and folder sizes, no import circle, the layering contracts.

docs/architecture.md's map says which package holds what and which way its imports go; the
import-linter contracts in pyproject.toml (``[tool.importlinter]``) are the same map, checked.
These tests hold what the contracts cannot say: no source file over 600 lines, no folder of
more than 20 modules, no import circle between two modules (a circle inside one layer is
invisible to a layers contract), and that a change breaking a contract fails ``lint-imports``.
"""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src"
PACKAGE = SRC / "slotsync"
MAX_LINES = 600  # issue 34 C; a longer file's reason would go in docs/architecture.md
MAX_MODULES = 20  # .py files of one folder, __init__.py included (issue 34 acceptance)


def _modules(src: Path) -> dict[str, Path]:
    """Every module under ``src/slotsync``: dotted name -> file (a package is its __init__)."""
    found = {}
    for path in (src / "slotsync").rglob("*.py"):
        name = ".".join(path.relative_to(src).with_suffix("").parts)
        found[name.removesuffix(".__init__")] = path
    return found


def import_graph(src: Path = SRC) -> dict[str, set[str]]:
    """Module -> the slotsync modules it imports, at any depth of its code (function-level
    imports count). ``from pkg import name`` is an import of ``pkg``, ``from pkg import module``
    an import of that module (issue 34's rule); relative imports are resolved."""
    modules = _modules(src)

    def owner(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = defaultdict(set)
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(parts + ([node.module] if node.module else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base
                           for a in node.names]
            for target in targets:
                found = owner(target)
                if found and found != name:
                    graph[name].add(found)
    return graph


def import_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return circles


def test_no_source_file_is_over_600_lines():
    long = {str(p.relative_to(ROOT)): n for p in PACKAGE.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"over {MAX_LINES} lines (cut along a seam, docs/architecture.md): {long}"


def test_no_folder_holds_more_than_20_modules():
    crowded = {str(d.relative_to(ROOT)): n for d in [PACKAGE, *PACKAGE.rglob("*")]
               if d.is_dir() and (n := len(list(d.glob("*.py")))) > MAX_MODULES}
    assert not crowded, f"more than {MAX_MODULES} modules in one folder: {crowded}"


def test_every_package_says_what_it_holds_and_may_import():
    bare = [str(p.relative_to(ROOT)) for p in PACKAGE.rglob("__init__.py")
            if len((ast.get_docstring(ast.parse(p.read_text())) or "").splitlines()) < 3]
    assert not bare, f"packages without a docstring of what lives there: {bare}"


def test_no_import_circle_between_modules():
    circles = import_circles(import_graph())
    assert not circles, "import circles: " + "; ".join(" <-> ".join(c) for c in circles)


def test_the_circle_finder_finds_a_circle(tmp_path):
    (tmp_path / "slotsync" / "a").mkdir(parents=True)
    (tmp_path / "slotsync" / "__init__.py").write_text("")
    (tmp_path / "slotsync" / "a" / "__init__.py").write_text("")
    (tmp_path / "slotsync" / "a" / "x.py").write_text("def f():\n    from slotsync.a import y\n")
    (tmp_path / "slotsync" / "a" / "y.py").write_text("from . import x\n")
    (tmp_path / "slotsync" / "z.py").write_text("from slotsync.a.x import f\n")
    assert import_circles(import_graph(tmp_path)) == [["slotsync.a.x", "slotsync.a.y"]]


def _lint_imports() -> str:
    exe = Path(sys.executable).with_name("lint-imports")
    if not exe.exists():
        if os.environ.get("SLOTSYNC_REQUIRE_VLLM"):  # (scripts/test: .[dev] installs it)
            pytest.fail(f"lint-imports is not installed beside {sys.executable}: "
                        "pip install -e '.[dev]'")
        pytest.skip("import-linter is not installed (pip install -e '.[dev]')")
    return str(exe)


def _run_lint(exe: str, src: Path, config: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(src)}
    return subprocess.run([exe, "--no-cache", "--no-logo", str(config)], cwd=config.parent,
                          env=env, capture_output=True, text=True, timeout=300)


def test_the_layering_contracts_hold():
    done = _run_lint(_lint_imports(), SRC, ROOT / "pyproject.toml")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "0 broken" in done.stdout, done.stdout


@pytest.mark.parametrize("module, line, contract", [
    ("daemon/core/update.py", "import torch", "The daemon never imports torch"),
    ("daemon/core/update.py", "from slotsync.daemon.service import metrics",
     "The daemon's layers"),
    ("protocol/rank/session.py", "from slotsync.daemon.core import actions",
     "Rank-side code never imports the daemon"),
    ("engine/sglang/__init__.py", "from slotsync.engine.vllm import model",
     "the three engine families independent"),
    ("protocol/__init__.py", "import torch", "never imports torch"),
    # a new module nobody placed in the layers (exhaustive contracts): refused, so that it
    # cannot import past the rules unseen
    ("engine/common.py", "from slotsync.engine.reference import server",
     "not listed as layers"),
    ("protocol/digest.py", "import hashlib", "not listed as layers"),
    ("daemon/trtllm/__init__.py", "from slotsync.daemon.vllm import client",
     "not listed as layers"),
], ids=["daemon-torch", "core-above-service", "rank-daemon", "engine-families",
        "public-protocol-torch", "new-engine-module", "new-schema-module", "new-family"])
def test_a_change_that_breaks_a_contract_fails_lint_imports(tmp_path, module, line, contract):
    exe = _lint_imports()
    shutil.copytree(PACKAGE, tmp_path / "src" / "slotsync",
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    target = tmp_path / "src" / "slotsync" / module
    target.parent.mkdir(exist_ok=True)
    target.write_text((target.read_text() if target.exists() else "")
                      + f"\n{line}  # a broken contract\n")
    done = _run_lint(exe, tmp_path / "src", tmp_path / "pyproject.toml")
    assert done.returncode != 0, done.stdout
    broken = " ".join(done.stdout.split("Broken contracts", 1)[-1].split())  # (it wraps lines)
    assert contract in broken, done.stdout


def test_the_daemon_imports_no_lazy_name_of_slotsync_protocol():
    """``slotsync.protocol``'s ``__getattr__`` loads ``Publisher`` and the export helpers on
    first access -- and torch with them -- through ``importlib``, which no import graph sees:
    ``from slotsync.protocol import PublishStats`` in the daemon would pass lint-imports and
    load torch into slotsyncd when it runs. So the daemon imports the schema's own modules
    (``slotsync.protocol.wire``, ``.topology``, ...), never the package's names."""
    graph = import_graph()
    offenders = sorted(m for m, targets in graph.items()
                       if m.startswith("slotsync.daemon") and "slotsync.protocol" in targets)
    assert not offenders, (f"{offenders} import slotsync.protocol itself: import its modules "
                           "(slotsync.protocol.wire, .topology, .errors) instead")


def test_no_merge_conflict_markers_in_tracked_text():
    """A merge resolved in haste once committed ``<<<<<<< HEAD`` blocks inside a docstring,
    where no test noticed them: every tracked text file is free of the three markers."""
    import re

    marker = re.compile(r"^(<<<<<<< |>>>>>>> |=======$)", re.M)
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True)
    if tracked.returncode != 0:
        pytest.skip("not a git checkout")
    bad = []
    for name in tracked.stdout.splitlines():
        if not name.endswith((".py", ".md", ".toml", ".yml", ".yaml", ".cfg", ".txt", ".sh")):
            continue
        path = ROOT / name
        if path.is_file() and marker.search(path.read_text(errors="replace")):
            bad.append(name)
    assert not bad, f"merge conflict markers in {bad}"
