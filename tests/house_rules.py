"""The house rules, checked over any source tree: tests/test_house.py runs them on this
repository, and on small bad trees to show each rule can fail.

- Floors: the folders of kvstore/ in the order docs/architecture.md draws them (its
  house diagram lists the top first); a module imports from its own floor and the ones
  below, never above. Relative imports and `from kvstore import X` count like any other,
  and so do TYPE_CHECKING imports. A folder the diagram does not place is an error.
- Packages: kvstore < connectors < engine_plugin < bench, each importing only those
  before it; an engine (vLLM, SGLang, LMCache) only in engine_plugin and bench.
- Rooms: engine_plugin/ keeps a room per engine (vllm/, sglang/, lmcache/). A room imports
  its own engine and no other, nor another engine's room; a room's core/ imports no engine
  at all (the logic tested without one). A module at engine_plugin/'s own top (an old
  module path kept for configs) imports rooms, never an engine.
- The client side (connectors/, engine_plugin/) reaches the storage engine through its
  service: of kvstore it imports the floors format, config, io and service only (the
  types it needs from the tiers are the service's client_types.py), never the tiers,
  the data path, the cluster or the store.
- No circles: no module imports, through any chain of modules of the tree, one that
  imports it back (TYPE_CHECKING and function-level imports count: they tie the code
  the same way). A package's `__init__` is not a link of a chain.
- Bench floors: bench/ holds four folders and no module of its own: support/ (the
  harness, shared with the tests), sim/ (the trace replay's simulator and the models it
  runs, product models a command and the tests both drive), commands/ (the `kvstore`
  subcommands) and lab/ (the experiments, `python -m bench.lab NAME`). A floor imports
  those below it: support none, sim support, and commands and lab both, each other in no
  direction: what both need is support's or sim's.
- Tests reach bench through its harness: a test module imports bench.support and
  bench.sim freely and at most one module of bench.commands or bench.lab, the command or
  experiment it checks
  (through its entry point, or its parts one by one); so nothing two tests share, and
  nothing a test only borrows, lives outside support. A test may also run a command or
  an experiment in a subprocess (`kvstore NAME`, `python -m bench.lab NAME`).
- Tests share through tests/support: no module under tests/ imports a test module
  (`test_*`) or conftest.py (its fixtures reach tests by name, not by import); what two
  tests share is a helper of tests/support, or a fixture of conftest.py calling one.
- Sizes are smells, not rules (Report.smells, printed by the house test, failing nothing):
  a class with the in-project classes it derives from of more than 200 lines, a
  constructor (its `__init__`, or a dataclass's init fields with those it inherits) of
  more than 7 parameters, each asks what the class's jobs are; a line moved to get under
  the number answers nothing. They are measured in kvstore, connectors, engine_plugin and
  bench's support, sim and commands, where a dataclass without an `__init__` of its own is a
  row of measured or given values (a case's result, a hardware profile), not a
  constructor: its fields are not counted there. kvstore/ keeps at most a dozen top
  modules (a rule).
- Reach: outside kvstore/store/ no module reads a store's `parts` (`x.parts` or
  `getattr(x, "parts")`; calling a method named `parts`, `x.parts(...)`, is another
  thing): the store's front (TieredStore, its `probe`) says what they need. In tests/
  only tests/support/faults.py does, the seam where a test injects a fault (a device's
  descriptor, a clock, a stray write), each named once.

`check()` also says how much it looked at, so a run that scanned nothing cannot pass.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field
from pathlib import Path

PACKAGES = ("kvstore", "connectors", "engine_plugin", "bench")  # each may import only those before it
CLIENT_PACKAGES = ("connectors", "engine_plugin")  # the client side: engines' code
CLIENT_FLOORS = ("format", "config", "io", "service")  # what of kvstore the client side imports
ENGINES = ("vllm", "sglang", "lmcache")  # top-level packages of the engines kvstore plugs into
ENGINE_PACKAGES = ("engine_plugin", "bench")  # the packages that may import an engine
SIZED_PACKAGES = ("kvstore", "connectors", "engine_plugin", "bench.support", "bench.sim", "bench.commands")
RECORD_PACKAGES = ("bench.support", "bench.sim", "bench.commands")  # dataclasses there are rows
BENCH_FLOORS = {"support": 0, "sim": 1, "commands": 2, "lab": 2}  # each imports the floors ranked below
SHARED_BENCH = ("support", "sim")  # the floors tests import freely
TESTS = "tests"
MAX_CLASS_LINES = 200
MAX_PARAMETERS = 7
MAX_TOP_MODULES = 12
DOC = Path("docs") / "architecture.md"


@dataclass
class Report:
    floors: tuple[str, ...] = ()
    modules: dict[str, int] = field(default_factory=dict)  # package -> modules parsed
    imports: dict[str, int] = field(default_factory=dict)  # package -> imports resolved and checked
    classes: int = 0  # classes measured
    tests: int = 0  # test modules whose bench imports were checked
    problems: dict[str, list[str]] = field(default_factory=dict)  # rule -> findings
    smells: dict[str, list[str]] = field(default_factory=dict)  # size -> what asks about its jobs

    def add(self, rule: str, finding: str) -> None:
        self.problems.setdefault(rule, []).append(finding)

    def smell(self, size: str, finding: str) -> None:
        self.smells.setdefault(size, []).append(finding)


def documented_floors(root: Path) -> tuple[str, ...]:
    """The floors, lowest first, from the house diagram in docs/architecture.md: the
    fenced block after the "The house" heading, one `folder/` per line, top first."""
    text = (root / DOC).read_text()
    section = re.search(r"^## The house.*?^```\n(.*?)^```", text, re.S | re.M)
    if section is None:
        raise ValueError(f"{DOC}: no house diagram (a fenced block under '## The house')")
    floors = re.findall(r"^([a-z_]+)/\s", section.group(1), re.M)
    if not floors:
        raise ValueError(f"{DOC}: the house diagram names no floors")
    return tuple(reversed(floors))


@dataclass
class _Module:
    name: str  # dotted, e.g. kvstore.tiers.dram
    path: Path
    tree: ast.Module
    is_package: bool  # an __init__.py

    def resolve(self, node: ast.ImportFrom) -> str:
        """The absolute module a `from ... import` names (relative ones resolved)."""
        if node.level == 0:
            return node.module or ""
        parts = self.name.split(".")
        base = parts if self.is_package else parts[:-1]
        base = base[: len(base) - (node.level - 1)]
        return ".".join([*base, node.module] if node.module else base)


def _load(root: Path, package: str) -> list[_Module]:
    modules = []
    for path in sorted((root / package).rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").as_posix().split("/")
        is_package = parts[-1] == "__init__"
        if is_package:
            parts.pop()
        modules.append(_Module(".".join(parts), path, ast.parse(path.read_text(), str(path)), is_package))
    return modules


class _Names:
    """What each dotted name in the scanned tree is: a module, or a name a module binds."""

    def __init__(self, modules: list[_Module]) -> None:
        self.modules = {m.name: m for m in modules}
        self.bindings: dict[str, dict[str, str]] = {m.name: self._bindings(m) for m in modules}

    @staticmethod
    def _bindings(module: _Module) -> dict[str, str]:
        found = {}
        for node in module.tree.body:
            if isinstance(node, ast.ClassDef):
                found[node.name] = f"{module.name}.{node.name}"
        for node in ast.walk(module.tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.asname:
                        found[alias.asname] = alias.name
                    else:
                        top = alias.name.split(".")[0]
                        found.setdefault(top, top)
            elif isinstance(node, ast.ImportFrom):
                source = module.resolve(node)
                for alias in node.names:
                    found[alias.asname or alias.name] = f"{source}.{alias.name}"
        return found

    def imported(self, module: _Module) -> list[str]:
        """Each module this one imports; `from P import X` is P.X where X is a module of
        the tree, else P (the names come from P's own module)."""
        found = []
        for node in ast.walk(module.tree):
            if isinstance(node, ast.Import):
                found += [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                source = module.resolve(node)
                found += [f"{source}.{a.name}" if f"{source}.{a.name}" in self.modules else source
                          for a in node.names]
        return found

    def canonical(self, dotted: str) -> str:
        """Follow re-exports (`from kvstore import KVNamespace`) to where a name is defined."""
        for _ in range(10):
            module, _, name = dotted.rpartition(".")
            target = self.bindings.get(module, {}).get(name)
            if target is None or target == dotted:
                return dotted
            dotted = target
        return dotted

    def expression(self, module: _Module, node: ast.expr) -> str | None:
        """The dotted name a base-class expression refers to, if it is a plain name path."""
        if isinstance(node, ast.Subscript):  # Generic[T], Base[X]
            return self.expression(module, node.value)
        if isinstance(node, ast.Name):
            bound = self.bindings[module.name].get(node.id)
            return self.canonical(bound) if bound else None
        if isinstance(node, ast.Attribute):
            head = self.expression(module, node.value)
            return self.canonical(f"{head}.{node.attr}") if head else None
        return None


def _floor_of(module: str, floors: tuple[str, ...], face: int) -> int | None:
    """The floor index of a kvstore module; len(floors) for the top (cli); `face` for the
    package itself (its floor is the highest it imports); None: not kvstore."""
    parts = module.split(".")
    if parts[0] != "kvstore":
        return None
    if len(parts) == 1:
        return face
    return floors.index(parts[1]) if parts[1] in floors else len(floors)


def _check_floors(root: Path, modules: list[_Module], names: _Names, report: Report) -> None:
    floors = report.floors
    folders = {p.name for p in (root / "kvstore").iterdir() if p.is_dir() and p.name != "__pycache__"}
    if folders != set(floors):
        report.add("floors", f"{DOC} places {sorted(floors)}, kvstore/ holds {sorted(folders)}: "
                             f"place {sorted(folders - set(floors))}, drop {sorted(set(floors) - folders)}")
    face_module = names.modules.get("kvstore")
    face_imports = names.imported(face_module) if face_module else []
    face = max((f for m in face_imports if (f := _floor_of(m, floors, 0)) is not None and m != "kvstore"),
               default=0)
    for module in modules:
        if module.name == "kvstore":
            continue  # the package's face: it may import the floors it re-exports
        own = _floor_of(module.name, floors, face)
        assert own is not None
        for target in names.imported(module):
            floor = _floor_of(target, floors, face)
            if floor is not None and floor > own:
                report.add("floors", f"{module.path.relative_to(root)} ({_floor_name(own, floors)}) "
                                     f"imports {target} ({_floor_name(floor, floors)})")


def _floor_name(index: int, floors: tuple[str, ...]) -> str:
    return floors[index] if index < len(floors) else "top"


def _is_dataclass(node: ast.ClassDef) -> bool:
    """Decorated @dataclass / @dataclasses.dataclass(...) with its generated __init__."""
    for decorator in node.decorator_list:
        call = decorator if isinstance(decorator, ast.Call) else None
        target = call.func if call else decorator
        name = target.attr if isinstance(target, ast.Attribute) else getattr(target, "id", "")
        if name == "dataclass":
            return not any(k.arg == "init" and isinstance(k.value, ast.Constant) and k.value.value is False
                           for k in (call.keywords if call else []))
    return False


def _init_fields(node: ast.ClassDef) -> list[str]:
    """A dataclass's own fields that its __init__ takes."""
    found = []
    for item in node.body:
        if not isinstance(item, ast.AnnAssign) or not isinstance(item.target, ast.Name):
            continue
        annotation = ast.unparse(item.annotation)
        if "ClassVar" in annotation or "KW_ONLY" in annotation:
            continue
        value = item.value
        if isinstance(value, ast.Call) and ast.unparse(value.func).split(".")[-1] == "field" and any(
                k.arg == "init" and isinstance(k.value, ast.Constant) and k.value.value is False
                for k in value.keywords):
            continue
        found.append(item.target.id)
    return found


def _init_parameters(node: ast.ClassDef) -> int | None:
    for item in node.body:
        if isinstance(item, ast.FunctionDef) and item.name == "__init__":
            args = item.args
            return (len(args.posonlyargs) + len(args.args) - 1 + len(args.kwonlyargs)
                    + (args.vararg is not None) + (args.kwarg is not None))
    return None


def _check_classes(root: Path, modules: list[_Module], names: _Names, report: Report) -> None:
    classes: dict[str, tuple[_Module, ast.ClassDef]] = {}
    for module in modules:
        for node in ast.walk(module.tree):
            if isinstance(node, ast.ClassDef):
                classes.setdefault(f"{module.name}.{node.name}", (module, node))

    def lineage(name: str) -> list[str]:
        """The class and every in-project class it derives from, each once, own first."""
        order, todo = [], [name]
        while todo:
            current = todo.pop(0)
            if current in order or current not in classes:
                continue
            order.append(current)
            module, node = classes[current]
            todo += [b for base in node.bases if (b := names.expression(module, base))]
        return order

    for name, (module, node) in classes.items():
        if not any(module.name == p or module.name.startswith(p + ".") for p in SIZED_PACKAGES):
            continue
        report.classes += 1
        where = f"{module.path.relative_to(root)}:{node.name}"
        family = lineage(name)
        lines = sum((n.end_lineno or n.lineno) - n.lineno + 1 for _, n in (classes[c] for c in family))
        if lines > MAX_CLASS_LINES:
            bases = f" (with {', '.join(c.rsplit('.', 1)[1] for c in family[1:])})" if family[1:] else ""
            report.smell("class size", f"{where}: {lines} lines{bases}")
        count = _init_parameters(node)
        rows = any(module.name == p or module.name.startswith(p + ".") for p in RECORD_PACKAGES)
        if count is None and _is_dataclass(node) and not rows:
            count = sum(len(_init_fields(classes[c][1])) for c in family if _is_dataclass(classes[c][1]))
        if count is not None and count > MAX_PARAMETERS:
            report.smell("constructor", f"{where}.__init__: {count} parameters")


def _check_client(root: Path, modules: list[_Module], names: _Names, report: Report) -> None:
    """A client-side module's imports of kvstore: its CLIENT_FLOORS only."""
    for module in modules:
        for target in names.imported(module):
            wanted = target.split(".")
            if wanted[0] == "kvstore" and (len(wanted) == 1 or wanted[1] not in CLIENT_FLOORS):
                report.add("client", f"{module.path.relative_to(root)} imports {target}: the client side "
                           "reaches the storage engine through kvstore.service (client_types.py)")


def circles(modules: list[_Module], names: _Names) -> list[list[str]]:
    """Each set of modules that import one another in a circle (a strongly connected part
    of the import graph of more than one module, or one importing itself), names sorted."""
    graph: dict[str, set[str]] = {m.name: set() for m in modules if not m.is_package}
    for module in modules:
        if module.is_package:
            continue
        for target in names.imported(module):
            while target and target not in graph and "." in target:
                target = target.rsplit(".", 1)[0]  # a name a module binds: that module
            if target in graph:
                graph[module.name].add(target)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:  # Tarjan's strongly connected components
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in graph[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            part = []
            while True:
                top = stack.pop()
                part.append(top)
                if top == node:
                    break
            if len(part) > 1 or node in graph[node]:
                found.append(sorted(part))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(found)


def _check_rooms(root: Path, modules: list[_Module], names: _Names, report: Report) -> None:
    """Each engine_plugin module's imports of engines and rooms: its room's own engine, not
    in core/; no other room; at the package's top, rooms only."""
    for module in modules:
        parts = module.name.split(".")
        room = parts[1] if len(parts) > 1 and parts[1] in ENGINES else None
        core = room is not None and len(parts) > 2 and parts[2] == "core"
        where = module.path.relative_to(root)
        for target in names.imported(module):
            wanted = target.split(".")
            if wanted[0] in ENGINES and (wanted[0] != room or core):
                report.add("rooms", f"{where} imports {target}: "
                           + ("a core imports no engine" if core else "not its room's engine"))
            elif (room is not None and wanted[0] == "engine_plugin" and len(wanted) > 1
                  and wanted[1] in ENGINES and wanted[1] != room):
                report.add("rooms", f"{where} ({room}) imports {target}: another engine's room")


def _bench_floor(module: str) -> str | None:
    """support, sim, commands or lab for a module of bench/ (the folder it lies in); "" for a
    module of bench/'s own top (bench itself included); None outside bench."""
    parts = module.split(".")
    if parts[0] != "bench":
        return None
    return parts[1] if len(parts) > 1 and parts[1] in BENCH_FLOORS else ""


def _check_bench(root: Path, modules: list[_Module], names: _Names, report: Report) -> None:
    for module in modules:
        own = _bench_floor(module.name)
        where = module.path.relative_to(root)
        if own == "" and module.name != "bench":
            report.add("bench floors", f"{where}: a module of bench/'s own; it goes in one of "
                                       f"{'/, '.join(BENCH_FLOORS)}/")
            continue
        for target in names.imported(module):
            floor = _bench_floor(target)
            if floor and own and floor != own and BENCH_FLOORS[floor] >= BENCH_FLOORS[own]:
                report.add("bench floors", f"{where} ({own}) imports {target} ({floor})")


def _test_module(target: str) -> bool:
    """Whether an import names a test module or conftest (`test_x`, `tests.test_x.y`)."""
    parts = target.split(".")
    name = parts[1] if parts[0] == TESTS and len(parts) > 1 else parts[0]
    return name.startswith("test_") or name == "conftest"


def _check_tests(root: Path, names: _Names, report: Report) -> None:
    """Each test module's bench imports: bench.support and bench.sim, and one command or experiment;
    and no module of tests/ importing a test module or conftest."""
    for module in _load(root, TESTS):
        report.tests += 1
        borrowed = set()
        imported = names.imported(module)
        for target in sorted({t for t in imported if _test_module(t)}):
            report.add("tests", f"{module.path.relative_to(root)} imports {target}: what tests share "
                                "lives in tests/support")
        for target in imported:
            if _test_module(target):
                continue
            floor = _bench_floor(target)
            if floor is None or floor in SHARED_BENCH:
                continue
            if floor not in ("commands", "lab") or target.count(".") < 2:
                report.add("tests", f"{module.path.relative_to(root)} imports {target}: "
                                    f"tests import bench through bench.support")
                continue
            borrowed.add(".".join(target.split(".")[:3]))
        if len(borrowed) > 1:
            report.add("tests", f"{module.path.relative_to(root)} imports {', '.join(sorted(borrowed))}: "
                                "at most one command or experiment a test; what they share goes to "
                                "bench.support")


# Where a store's parts are read: the store itself, and the tests' one fault seam (faults
# are injected where the store keeps what they break).
REACH_HOMES = ("kvstore/store/", "tests/support/faults.py")


def _reaches(tree: ast.Module) -> list[int]:
    """Lines that read an attribute `parts` (not as a method call's target)."""
    called = {id(node.func) for node in ast.walk(tree) if isinstance(node, ast.Call)}
    lines = []
    for node in ast.walk(tree):
        read = isinstance(node, ast.Attribute) and node.attr == "parts" and id(node) not in called
        got = (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr"
               and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant)
               and node.args[1].value == "parts")
        if read or got:
            lines.append(node.lineno)
    return sorted(lines)


def reaches(root: Path, package: str) -> list[str]:
    """`path:line` of each read of a store's `parts` under `package` outside kvstore/store/."""
    found = []
    for path in sorted((root / package).rglob("*.py")):
        name = path.relative_to(root).as_posix()
        if not name.startswith(REACH_HOMES):
            found += [f"{name}:{line}" for line in _reaches(ast.parse(path.read_text(), name))]
    return found


def check(root: Path) -> Report:
    """Every rule over the tree at `root`; what it found is in `problems`, and what it
    looked at in `modules`, `imports` and `classes`."""
    report = Report(floors=documented_floors(root))
    modules = {package: _load(root, package) for package in PACKAGES}
    every = [m for found in modules.values() for m in found]
    names = _Names(every)
    for index, package in enumerate(PACKAGES):
        report.modules[package] = len(modules[package])
        if not modules[package]:
            report.add("scanned", f"{package}/: no modules found under {root}")
        above = set(PACKAGES[index + 1:]) | (set() if package in ENGINE_PACKAGES else set(ENGINES))
        checked = 0
        for module in modules[package]:
            for target in names.imported(module):
                checked += 1
                if target.split(".")[0] in above:
                    report.add("packages", f"{module.path.relative_to(root)} imports {target}")
        report.imports[package] = checked
    _check_floors(root, modules["kvstore"], names, report)
    _check_rooms(root, modules["engine_plugin"], names, report)
    for package in CLIENT_PACKAGES:
        _check_client(root, modules[package], names, report)
    _check_bench(root, modules["bench"], names, report)
    _check_tests(root, names, report)
    _check_classes(root, every, names, report)
    for circle in circles(every, names):
        report.add("circles", " -> ".join(circle))
    for package in (*PACKAGES, TESTS):
        for where in reaches(root, package):
            report.add("reach", f"{where} reads a store's parts: ask the store's front (TieredStore, "
                                "TieredStore.probe)")
    top = sorted(p.name for p in (root / "kvstore").glob("*.py"))
    if len(top) > MAX_TOP_MODULES:
        report.add("top modules", f"kvstore/ has {len(top)} top modules: {top}")
    return report
