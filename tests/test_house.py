"""The architecture, checked from the code: floors, sizes, and what a light command imports.

Floors, lowest first. A module may import from its own floor and the ones below, never
from a floor above; TYPE_CHECKING imports count too. Every folder of kvstore/ must be
listed here, so a new one has to be placed. Modules at the top of kvstore/ (the CLI and
its commands) stand above every floor; kvstore/__init__.py, the package's face, may
import the floors it re-exports.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FLOORS = ("format", "config", "io", "devices", "tiers", "datapath", "cluster", "store", "service")
PACKAGES = ("kvstore", "connectors", "engine_plugin", "bench")  # each may import only those before it


def _modules(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


def _imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found |= {f"{node.module}.{alias.name}" for alias in node.names}
    return found


def _floor(module: str) -> int | None:
    """The floor index of a kvstore module name; len(FLOORS) for the top; None: not kvstore."""
    parts = module.split(".")
    if parts[0] != "kvstore" or len(parts) < 2:
        return None
    return FLOORS.index(parts[1]) if parts[1] in FLOORS else len(FLOORS)


def test_every_folder_of_the_storage_package_is_a_listed_floor():
    folders = {p.name for p in (ROOT / "kvstore").iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert folders == set(FLOORS), f"place {folders - set(FLOORS)} in FLOORS; gone: {set(FLOORS) - folders}"


def test_no_module_imports_from_a_floor_above_its_own():
    upward = []
    for path in _modules("kvstore"):
        relative = path.relative_to(ROOT).with_suffix("")
        if relative.name == "__init__" and len(relative.parts) == 2:
            continue  # the package's face
        own = _floor(".".join(relative.parts))
        assert own is not None
        for module in _imports(path):
            floor = _floor(module)
            if floor is not None and floor > own and module.split(".")[1] in FLOORS:
                upward.append(f"{relative} ({FLOORS[own] if own < len(FLOORS) else 'top'}) imports "
                              f"{module} ({FLOORS[floor]})")
    assert not upward, "\n".join(upward)


@pytest.mark.parametrize("index", range(len(PACKAGES)))
def test_packages_import_only_the_ones_below_them_and_vllm_only_in_the_plugin(index):
    package, above = PACKAGES[index], set(PACKAGES[index + 1 :])
    if package != "engine_plugin" and package != "bench":
        above.add("vllm")
    wrong = [f"{path.relative_to(ROOT)} imports {module}" for path in _modules(package)
             for module in _imports(path) if module.split(".")[0] in above]
    assert not wrong, "\n".join(wrong)


def _classes() -> list[tuple[str, ast.ClassDef]]:
    return [(f"{path.relative_to(ROOT)}:{node.name}", node)
            for package in ("kvstore", "connectors") for path in _modules(package)
            for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.ClassDef)]


def test_no_class_over_200_lines_and_no_constructor_over_7_parameters():
    big = [f"{name}: {node.end_lineno - node.lineno + 1} lines" for name, node in _classes()
           if node.end_lineno - node.lineno + 1 > 200]
    wide = []
    for name, node in _classes():
        for item in node.body:
            if isinstance(item, ast.FunctionDef) and item.name == "__init__":
                args = item.args
                count = len(args.posonlyargs) + len(args.args) - 1 + len(args.kwonlyargs)
                if count > 7:
                    wide.append(f"{name}.__init__: {count} parameters")
    assert not big + wide, "\n".join(big + wide)


def test_the_top_of_the_storage_package_keeps_at_most_a_dozen_modules():
    top = sorted(p.name for p in (ROOT / "kvstore").glob("*.py"))
    assert len(top) <= 12, top


def test_fsck_help_imports_neither_bench_nor_torch():
    probe = ("import sys\nfrom kvstore.cli import main\n"
             "try:\n    main(['fsck', '--help'])\nexcept SystemExit:\n    pass\n"
             "print(sorted(m for m in sys.modules if m.split('.')[0] in ('bench', 'torch', 'vllm')))")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT,
                          timeout=60, check=True)
    assert done.stdout.strip().splitlines()[-1] == "[]", done.stdout
