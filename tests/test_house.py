"""The architecture, checked from the code (the rules: tests/house_rules.py): floors in
the order docs/architecture.md draws them, packages, class and constructor sizes, and
what a light command imports. Each rule is also shown failing on a small bad tree."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
from house_rules import PACKAGES, Report, check, documented_floors, reaches

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def report() -> Report:
    return check(ROOT)


def test_the_rules_read_the_whole_tree(report):
    assert report.tests == len(list((ROOT / "tests").rglob("*.py"))) > 50
    for package in PACKAGES:
        assert report.modules[package] == len(list((ROOT / package).rglob("*.py"))) > 0, package
        assert report.imports[package] >= 2 * report.modules[package], (package, report.imports)
    assert report.modules["kvstore"] >= 50 and report.imports["kvstore"] >= 500
    assert report.classes >= 100
    assert report.floors == documented_floors(ROOT) and report.floors[0] == "format"


def test_the_house_holds(report):
    """No finding at all: one is fixed in the code, never by a wider limit. The size smells
    print (as warnings, at the end of the run) and fail nothing: each asks what a class's
    jobs are, which a split by job answers and a moved line does not."""
    found = [f"{rule}: {finding}" for rule, findings in report.problems.items() for finding in findings]
    assert not found, "\n".join(found)
    for size, findings in report.smells.items():
        for finding in findings:
            warnings.warn(f"{size}: {finding}", SizeSmell, stacklevel=1)


class SizeSmell(UserWarning):
    """A class or constructor past the size that asks what its jobs are."""


def test_the_top_of_the_storage_package_keeps_at_most_a_dozen_modules(report):
    assert "top modules" not in report.problems


def test_fsck_help_imports_neither_bench_nor_torch():
    probe = ("import sys\nfrom kvstore.cli import main\n"
             "try:\n    main(['fsck', '--help'])\nexcept SystemExit:\n    pass\n"
             "print(sorted(m for m in sys.modules if m.split('.')[0] in ('bench', 'torch', 'vllm')))")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT,
                          timeout=60, check=True)
    assert done.stdout.strip().splitlines()[-1] == "[]", done.stdout


# -- the rules on bad trees ---------------------------------------------------------------

DIAGRAM = """# Architecture

## The house: one folder per floor

```
cli.py                    the command line
{floors}
```
"""


def _tree(root: Path, floors: tuple[str, ...] = ("format", "tiers", "store")) -> Path:
    """A tree that keeps every rule: one module per floor and package, each importing below."""
    diagram = "\n".join(f"{f}/{' ' * 20}{f}.py" for f in reversed(floors))
    _write(root, "docs/architecture.md", DIAGRAM.format(floors=diagram))
    _write(root, "kvstore/__init__.py", "from kvstore.format.base import Key\n")
    below = "import os\n"
    for floor in floors:
        _write(root, f"kvstore/{floor}/__init__.py", "")
        _write(root, f"kvstore/{floor}/base.py", f"{below}\nclass {floor.title()}Part:\n    pass\n"
               + ("class Key:\n    pass\n" if floor == "format" else ""))
        below = f"from kvstore.{floor}.base import {floor.title()}Part\n"
    _write(root, "kvstore/cli.py", f"from kvstore.{floors[-1]}.base import {floors[-1].title()}Part\n")
    for package, imports in (("connectors", "import kvstore.format.base\n"),
                             ("engine_plugin", "import connectors.core\n"),
                             ("bench/support", "import vllm\nimport engine_plugin.core\n")):
        _write(root, f"{package.split('/')[0]}/__init__.py", "")
        _write(root, f"{package}/core.py", f"import os\n{imports}")
    _write(root, "tests/test_core.py", "from bench.support import core\nimport kvstore\n")
    return root


def _write(root: Path, name: str, text: str) -> None:
    path = root / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))


def _findings(root: Path) -> list[str]:
    return [f"{rule}: {finding}" for rule, found in check(root).problems.items() for finding in found]


def _smells(root: Path) -> list[str]:
    return [f"{size}: {finding}" for size, found in check(root).smells.items() for finding in found]


def test_a_tree_that_keeps_the_rules_passes(tmp_path):
    report = check(_tree(tmp_path))
    assert report.problems == {}
    assert report.floors == ("format", "tiers", "store")
    assert report.modules == {"kvstore": 8, "connectors": 2, "engine_plugin": 2, "bench": 2}
    assert report.imports["kvstore"] == 5
    assert report.tests == 1


def test_a_tree_with_nothing_to_scan_fails(tmp_path):
    _tree(tmp_path)
    for package in ("connectors", "engine_plugin"):
        for path in (tmp_path / package).glob("*.py"):
            path.unlink()
    assert _findings(tmp_path) == [f"scanned: {p}/: no modules found under {tmp_path}"
                                   for p in ("connectors", "engine_plugin")]


@pytest.mark.parametrize("line", ["from ..store import base", "from ..store.base import StorePart",
                                  "from kvstore import store", "from kvstore import cli",
                                  "import kvstore.store.base as below", "from . import base as mine\n"
                                  "from kvstore.format import base as lower\nfrom ...kvstore import store"])
def test_an_upward_import_in_any_spelling_fails(tmp_path, line):
    _write(_tree(tmp_path), "kvstore/tiers/extra.py", line + "\n")
    found = _findings(tmp_path)
    assert len(found) == 1, found
    assert found[0].startswith("floors: kvstore/tiers/extra.py (tiers) imports kvstore."), found


def test_importing_the_package_face_counts_as_the_floors_it_re_exports(tmp_path):
    _tree(tmp_path)
    _write(tmp_path, "kvstore/__init__.py", "from kvstore.store.base import StorePart\n")
    _write(tmp_path, "kvstore/tiers/extra.py", "from kvstore import StorePart\n")
    assert _findings(tmp_path) == ["floors: kvstore/tiers/extra.py (tiers) imports kvstore (store)"]


def test_the_floor_order_is_the_documented_one(tmp_path):
    _tree(tmp_path, floors=("format", "store", "tiers"))  # the diagram puts store below tiers
    _write(tmp_path, "kvstore/store/extra.py", "from kvstore.tiers import base\n")
    assert _findings(tmp_path) == [
        "floors: kvstore/store/extra.py (store) imports kvstore.tiers.base (tiers)"]
    (tmp_path / "kvstore" / "cache").mkdir()
    assert any("place ['cache']" in f for f in _findings(tmp_path))
    _write(tmp_path, "docs/architecture.md", "# Architecture\n")
    with pytest.raises(ValueError, match="no house diagram"):
        check(tmp_path)


def test_a_package_importing_one_above_it_or_vllm_fails(tmp_path):
    _write(_tree(tmp_path), "connectors/extra.py", "from engine_plugin import core\nimport vllm.config\n")
    assert _findings(tmp_path) == ["packages: connectors/extra.py imports engine_plugin.core",
                                   "packages: connectors/extra.py imports vllm.config"]


def test_an_engine_outside_its_room_or_a_room_importing_another_fails(tmp_path):
    _tree(tmp_path)
    _write(tmp_path, "engine_plugin/vllm/connector.py", "import vllm.config\nimport sglang.srt\n")
    _write(tmp_path, "engine_plugin/vllm/core/plan.py", "import os\n")
    _write(tmp_path, "engine_plugin/vllm/core/saves.py", "from vllm import envs\n")
    _write(tmp_path, "engine_plugin/sglang/hicache.py",
           "import sglang.srt\nfrom engine_plugin.vllm.core import plan\n")
    _write(tmp_path, "engine_plugin/connector.py",
           "from engine_plugin.vllm.connector import os\nimport lmcache\n")
    _write(tmp_path, "connectors/extra.py", "import lmcache.v1\n")
    assert _findings(tmp_path) == [
        "packages: connectors/extra.py imports lmcache.v1",
        "rooms: engine_plugin/connector.py imports lmcache: not its room's engine",
        "rooms: engine_plugin/sglang/hicache.py (sglang) imports engine_plugin.vllm.core.plan: "
        "another engine's room",
        "rooms: engine_plugin/vllm/connector.py imports sglang.srt: not its room's engine",
        "rooms: engine_plugin/vllm/core/saves.py imports vllm: a core imports no engine"]


def test_the_client_side_reaching_past_the_service_into_the_storage_engine_fails(tmp_path):
    _write(_tree(tmp_path), "connectors/extra.py", "from kvstore.tiers.base import TiersPart\n")
    _write(tmp_path, "engine_plugin/extra.py", "import kvstore\nfrom kvstore.format import base\n")
    assert _findings(tmp_path) == [
        "client: connectors/extra.py imports kvstore.tiers.base: the client side reaches the storage "
        "engine through kvstore.service (client_types.py)",
        "client: engine_plugin/extra.py imports kvstore: the client side reaches the storage engine "
        "through kvstore.service (client_types.py)"]


def test_modules_importing_each_other_in_a_circle_fail_type_checking_imports_too(tmp_path):
    _tree(tmp_path)
    _write(tmp_path, "kvstore/store/one.py", "from kvstore.store.two import Two\n\nclass One:\n    pass\n")
    _write(tmp_path, "kvstore/store/two.py", "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
           "    from kvstore.store.one import One\n\nclass Two:\n    pass\n")
    assert _findings(tmp_path) == ["circles: kvstore.store.one -> kvstore.store.two"]


def _class(name: str, lines: int, bases: str = "") -> str:
    body = "".join(f"    x{i} = {i}\n" for i in range(lines - 2))
    return f"class {name}{bases}:\n    '''Doc.'''\n{body}"


def test_a_class_is_measured_with_its_in_project_bases(tmp_path):
    _tree(tmp_path)
    _write(tmp_path, "connectors/parts.py", _class("Half", 120))
    _write(tmp_path, "connectors/whole.py",
           "from connectors.parts import Half\nfrom connectors import parts\n" + _class("Whole", 90, "(Half)")
           + _class("Other", 90, "(parts.Half)") + _class("Fine", 150))
    assert _smells(tmp_path) == ["class size: connectors/whole.py:Whole: 210 lines (with Half)",
                                 "class size: connectors/whole.py:Other: 210 lines (with Half)"]
    assert _findings(tmp_path) == []  # a smell, not a finding


def test_a_class_over_the_size_in_the_engine_plugin_smells(tmp_path):
    _write(_tree(tmp_path), "engine_plugin/vllm/connector.py", _class("Connector", 201, "(object)"))
    assert _smells(tmp_path) == ["class size: engine_plugin/vllm/connector.py:Connector: 201 lines"]


def test_a_dataclass_counts_its_fields_and_its_bases_fields_as_constructor_parameters(tmp_path):
    fields = "".join(f"    f{i}: int = 0\n" for i in range(5))
    _write(_tree(tmp_path), "kvstore/format/records.py", f"""\
from dataclasses import dataclass, field
import dataclasses
from typing import ClassVar

@dataclass(frozen=True)
class Base:
{fields}
@dataclasses.dataclass
class Wide(Base):
    a: int = 0
    b: int = 0
    c: int = 0

@dataclass
class Kept(Base):
    limit: ClassVar[int] = 3
    state: int = field(default=0, init=False)
    a: int = 0
    b: int = 0

class Plain:
    def __init__(self, a, b, c, d, e, f, g, *rest): pass
""")
    assert _smells(tmp_path) == ["constructor: kvstore/format/records.py:Wide.__init__: 8 parameters",
                                 "constructor: kvstore/format/records.py:Plain.__init__: 8 parameters"]


def test_the_size_rules_hold_in_benchs_support_and_commands_where_dataclasses_are_rows(tmp_path):
    _tree(tmp_path)
    fields = "".join(f"    f{i}: float = 0\n" for i in range(11))
    row = f"from dataclasses import dataclass\n\n@dataclass\nclass Row:\n{fields}"
    wide = "class Wide:\n    def __init__(self, a, b, c, d, e, f, g, h): pass\n"
    for floor in ("support", "commands", "lab"):
        _write(tmp_path, f"bench/{floor}/__init__.py", "")
        _write(tmp_path, f"bench/{floor}/big.py", _class("Big", 201) + row + wide)
    assert sorted(_smells(tmp_path)) == ["class size: bench/commands/big.py:Big: 201 lines",
                                         "class size: bench/support/big.py:Big: 201 lines",
                                         "constructor: bench/commands/big.py:Wide.__init__: 8 parameters",
                                         "constructor: bench/support/big.py:Wide.__init__: 8 parameters"]


# -- bench in floors, and how tests reach it ----------------------------------------------

def _bench(root: Path) -> Path:
    """The tree with a simulator over the harness, and a command and an experiment over both."""
    _tree(root)
    _write(root, "bench/sim/__init__.py", "")
    _write(root, "bench/sim/model.py", "from bench.support.core import os\n")
    for floor in ("commands", "lab"):
        _write(root, f"bench/{floor}/__init__.py", "")
        _write(root, f"bench/{floor}/one.py", "from bench.support.core import os\n")
        _write(root, f"bench/{floor}/two.py", "from bench.support import core\nfrom bench.sim import model\n")
    return root


def test_bench_floors_that_keep_the_rules_pass(tmp_path):
    _write(_bench(tmp_path), "tests/test_one.py", "from bench.lab.one import os\nfrom bench.lab import one\n"
           "from bench.support.core import os as same\nfrom bench.sim.model import os as sim\n")
    _write(tmp_path, "tests/test_two.py", "from bench.commands.two import core\n")
    assert _findings(tmp_path) == []


def test_a_module_of_bench_s_own_fails(tmp_path):
    _write(_bench(tmp_path), "bench/drawer.py", "import os\n")
    assert _findings(tmp_path) == [
        "bench floors: bench/drawer.py: a module of bench/'s own; it goes in one of support/, sim/, "
        "commands/, lab/"]


@pytest.mark.parametrize(("where", "line", "imported"), [
    ("support/core.py", "from bench.commands import one", "bench.commands.one (commands)"),
    ("support/extra.py", "from ..lab.two import core", "bench.lab.two (lab)"),
    ("support/core.py", "from bench.sim import model", "bench.sim.model (sim)"),
    ("sim/model.py", "from bench.commands import one", "bench.commands.one (commands)"),
    ("commands/one.py", "import bench.lab.two", "bench.lab.two (lab)"),
    ("lab/two.py", "from bench.commands import one", "bench.commands.one (commands)")])
def test_a_floor_importing_one_above_or_commands_and_lab_each_other_fail(tmp_path, where, line, imported):
    _write(_bench(tmp_path), f"bench/{where}", line + "\n")
    floor = where.split("/")[0]
    found = [f for f in _findings(tmp_path) if not f.startswith("circles:")]  # an upward import may close one
    assert found == [f"bench floors: bench/{where} ({floor}) imports {imported}"]


@pytest.mark.parametrize(("line", "finding"), [
    ("from bench import fio", "imports bench: tests import bench through bench.support"),
    ("import bench.lab", "imports bench.lab: tests import bench through bench.support"),
    ("from bench.lab import EXPERIMENTS", "imports bench.lab: tests import bench through bench.support"),
    ("from bench.lab.one import os\nfrom bench.commands import two",
     "imports bench.commands.two, bench.lab.one: at most one command or experiment a test; what they share "
     "goes to bench.support")])
def test_a_test_reaching_past_the_harness_fails(tmp_path, line, finding):
    _write(_bench(tmp_path), "tests/test_reach.py", line + "\n")
    assert _findings(tmp_path) == [f"tests: tests/test_reach.py {finding}"]


def test_tests_sharing_through_tests_support_pass_and_importing_a_test_module_fails(tmp_path):
    _write(_tree(tmp_path), "tests/support/__init__.py", "")
    _write(tmp_path, "tests/support/stores.py", "import kvstore\n")
    _write(tmp_path, "tests/test_one.py", "from support.stores import kvstore\nimport house_rules\n")
    assert _findings(tmp_path) == []

    _write(tmp_path, "tests/test_two.py", "from test_one import kvstore, os\nimport conftest\n"
           "from tests.test_core import core\n")
    _write(tmp_path, "tests/support/stores.py", "from test_core import core\n")
    assert _findings(tmp_path) == [  # once a module it imports
        f"tests: tests/{name} imports {target}: what tests share lives in tests/support"
        for name, target in (("support/stores.py", "test_core"), ("test_two.py", "conftest"),
                             ("test_two.py", "test_one"), ("test_two.py", "tests.test_core"))]


def test_reading_a_stores_parts_outside_the_store_fails(tmp_path):
    _tree(tmp_path)
    _write(tmp_path, "connectors/extra.py", """\
def share(store):
    return store.parts.dram.share()

def engine(store):
    return getattr(store, "parts").engine

def pages(pool):
    return pool.parts(4096)  # a method of that name is not a store's parts
""")
    _write(tmp_path, "kvstore/store/extra.py", "def dram(store):\n    return store.parts.dram\n")
    _write(tmp_path, "tests/support/faults.py", "def dram(store):\n    return store.parts.dram\n")
    _write(tmp_path, "tests/support/probe.py", "def dram(store):\n    return store.parts.dram\n")
    _write(tmp_path, "tests/test_reach.py", "def test_dram(store):\n    assert store.parts.dram\n")
    assert [f.split(" reads")[0] for f in _findings(tmp_path)] == ["reach: connectors/extra.py:2",
                                                                   "reach: connectors/extra.py:5",
                                                                   "reach: tests/support/probe.py:2",
                                                                   "reach: tests/test_reach.py:2"]
    assert reaches(tmp_path, "kvstore") == [] and reaches(tmp_path, "connectors") == [
        "connectors/extra.py:2", "connectors/extra.py:5"]
