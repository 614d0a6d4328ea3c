"""NVMe-oF without a fabric: config validation, sysfs resolution and health against
generated sysfs trees, and the nvme-cli command lines `kvstore nvmeof` builds."""

import json
import os

import pytest

from bench.support.loopdev import SUBNQN, FakeNamespace, set_controller_state, write_sysfs
from kvstore.cli import main
from kvstore.config.nvmeof import dump_nvmeof, parse_nvmeof
from kvstore.config.store import dump_config, load_config
from kvstore.devices.health import Presence
from kvstore.devices.nvmeof.nvme_cli import NvmeCliError, connect_plan, disconnect_plan, preflight
from kvstore.devices.nvmeof.plans import namespace_plans
from kvstore.devices.nvmeof.sysfs import resolve
from kvstore.format.errors import ConfigError, DeviceError

BASE = {"transport": "tcp", "traddr": "192.0.2.10", "subnqn": SUBNQN}


def _tier(sysfs_root: str, *namespaces: dict, **shared) -> dict:
    return {**BASE, "sysfs_root": sysfs_root, **shared, "namespaces": list(namespaces)}


@pytest.fixture
def sysfs(tmp_path):
    """Two namespaces behind two controllers (two paths), native multipath layout."""
    root = str(tmp_path / "sys")
    write_sysfs(root, [FakeNamespace("nvme0n1", 1, "nvme0"), FakeNamespace("nvme0n2", 2, "nvme1")])
    return root


# -- config ----------------------------------------------------------------------------


def test_config_shares_fields_and_round_trips():
    config = load_config({"tiers": {"nvmeof": {**BASE, "hostnqn": "nqn.2014-08.org.nvmexpress:host1",
                                               "nr_io_queues": 8, "queue_size": 128,
                                               "ctrl_loss_tmo": 60, "reconnect_delay": 2,
                                               "namespaces": [{"nsid": 1, "capacity": "1GiB"},
                                                              {"nsid": 2, "capacity": "2GiB",
                                                               "traddr": "192.0.2.11"}]}}})
    first, second = config.nvmeof.namespaces
    assert (first.traddr, second.traddr) == ("192.0.2.10", "192.0.2.11")
    assert first.fast_io_fail_tmo == 5 and second.ctrl_loss_tmo == 60 and second.capacity == 2 << 30
    assert load_config(dump_config(config)) == config


@pytest.mark.parametrize("change,field,words", [
    ({"transport": "fc"}, "tiers.nvmeof.transport", "tcp, rdma"),
    ({"traddr": "array.local"}, "tiers.nvmeof.traddr", "IP address"),
    ({"subnqn": "kv-array"}, "tiers.nvmeof.subnqn", "nqn."),
    ({"trsvcid": 70000}, "tiers.nvmeof.trsvcid", "between"),
    ({"ctrl_loss_tmo": 3}, "namespaces[0].fast_io_fail_tmo", "must not exceed ctrl_loss_tmo"),
    ({"namespaces": [{"capacity": "1GiB"}]}, "namespaces[0].nsid", "exactly one of nsid or uuid"),
    ({"namespaces": [{"nsid": 1}]}, "namespaces[0].capacity", "required"),
    ({"namespaces": [{"uuid": "not-a-uuid", "capacity": "1GiB"}]}, "namespaces[0].uuid", "UUID"),
    ({"namespaces": [{"nsid": 1, "capacity": "1GiB"}, {"nsid": 1, "capacity": "1GiB"}]},
     "namespaces[1]", "same namespace"),
    ({"namespaces": []}, "tiers.nvmeof.namespaces", "non-empty"),
    ({"nsqn": "x"}, "tiers.nvmeof.nsqn", "unknown key"),
])
def test_bad_nvmeof_config_names_the_field(change, field, words):
    tier = {**BASE, "namespaces": [{"nsid": 1, "capacity": "1GiB"}], **change}
    with pytest.raises(ConfigError) as caught:
        parse_nvmeof(tier)
    assert field in caught.value.field and words in str(caught.value)


@pytest.mark.parametrize("tier,field", [
    ({"traddr": "array.local"}, "tiers.nvmeof.traddr"),  # shared: named at the tier level
    ({"namespaces": [{"nsid": 1, "capacity": "1GiB"}, {"nsid": 2, "capacity": "1GiB", "traddr": "x"}]},
     "tiers.nvmeof.namespaces[1].traddr"),  # overridden: named on its namespace
    ({"trsvcid": True}, "tiers.nvmeof.trsvcid"),
    ({"fast_io_fail_tmo": 30, "namespaces": [{"nsid": 1, "capacity": "1GiB", "ctrl_loss_tmo": 10}]},
     "tiers.nvmeof.fast_io_fail_tmo"),
    ({"reconnect_delay": 20, "ctrl_loss_tmo": 10}, "tiers.nvmeof.reconnect_delay"),
    ({"namespaces": [{"nsid": 1, "capacity": "1GiB"}, {"nsid": "2", "capacity": "1GiB"}]},
     "tiers.nvmeof.namespaces[1].nsid"),
    ({"namespaces": [{"nsid": 1, "capacity": "1GiB", "hostnqn": "host1"}]},
     "tiers.nvmeof.namespaces[0].hostnqn"),
    ({"namespaces": [{"nsid": 1, "capacity": "1GiB", "sysfs_root": "/s"}]},
     "tiers.nvmeof.namespaces[0].sysfs_root"),
    ({"namespaces": "nsid 1"}, "tiers.nvmeof.namespaces"),
])
def test_nvmeof_errors_name_where_the_value_was_written(tier, field):
    with pytest.raises(ConfigError) as caught:
        load_config({"tiers": {"nvmeof": {**BASE, "namespaces": [{"nsid": 1, "capacity": "1GiB"}], **tier}}})
    assert caught.value.field == field


def test_a_bare_list_of_namespaces_and_null_fast_io_fail_tmo():
    config = parse_nvmeof([{**BASE, "uuid": "1B4E28BA-2FA1-11D2-883F-0016D3CCA427", "capacity": "1GiB",
                            "fast_io_fail_tmo": None}])
    (ns,) = config.namespaces
    assert ns.uuid == "1b4e28ba-2fa1-11d2-883f-0016d3cca427" and ns.fast_io_fail_tmo is None
    assert ns.label == f"{SUBNQN} uuid {ns.uuid}"
    assert ns.connection == ("tcp", "192.0.2.10", 4420, SUBNQN, None)
    assert parse_nvmeof(dump_nvmeof(config)) == config


# -- sysfs resolution and health ---------------------------------------------------------


def test_resolves_by_nsid_and_uuid_never_by_name(sysfs, tmp_path):
    by_nsid = parse_nvmeof(_tier(sysfs, {"nsid": 2, "capacity": "1GiB"})).namespaces[0]
    found = resolve(by_nsid, sysfs, "/dev")
    assert found.device == "/dev/nvme0n2" and found.logical_block_size == 4096 and found.live
    assert [c.name for c in found.controllers] == ["nvme0", "nvme1"]
    with open(os.path.join(sysfs, "class/nvme-subsystem/nvme-subsys0/nvme0n1/uuid")) as handle:
        uuid = handle.read().strip()
    by_uuid = parse_nvmeof(_tier(sysfs, {"uuid": uuid.upper(), "capacity": "1GiB"})).namespaces[0]
    assert resolve(by_uuid, sysfs, "/dev").block_name == "nvme0n1"
    other = parse_nvmeof({**_tier(sysfs, {"nsid": 1, "capacity": "1GiB"}), "subnqn": "nqn.other"})
    assert resolve(other.namespaces[0], sysfs, "/dev") is None


def test_non_multipath_layout_and_hidden_path_devices(tmp_path):
    root = str(tmp_path / "sys")
    controller = os.path.join(root, "class", "nvme", "nvme3")
    for sub in ("nvme3n1", "nvme3c3n1"):  # the block device, and a hidden per-path node
        os.makedirs(os.path.join(controller, sub))
        with open(os.path.join(controller, sub, "nsid"), "w") as handle:
            handle.write("1\n")
    for name, value in (("subsysnqn", SUBNQN), ("state", "live"), ("transport", "rdma"),
                        ("address", "traddr=192.0.2.10,trsvcid=4420")):
        with open(os.path.join(controller, name), "w") as handle:
            handle.write(value + "\n")
    ns = parse_nvmeof(_tier(root, {"nsid": 1, "capacity": "1GiB"})).namespaces[0]
    found = resolve(ns, root, "/dev")
    assert found.block_name == "nvme3n1" and found.live and found.controllers[0].transport == "rdma"


def test_live_while_any_path_is_live(sysfs):
    ns = parse_nvmeof(_tier(sysfs, {"nsid": 1, "capacity": "1GiB"})).namespaces[0]
    set_controller_state(sysfs, "nvme0", "connecting")
    assert resolve(ns, sysfs, "/dev").live  # nvme1 still live
    set_controller_state(sysfs, "nvme1", "resetting")
    found = resolve(ns, sysfs, "/dev")
    assert not found.live and found.state == "connecting,resetting"


def test_probe_follows_controller_state_and_renames(sysfs, tmp_path):
    dev_root = tmp_path / "dev"
    dev_root.mkdir()
    config = parse_nvmeof(_tier(sysfs, {"nsid": 1, "capacity": "1GiB"}, dev_root=str(dev_root)))
    (plan,) = namespace_plans(config)
    assert plan.kind == "nvmeof" and plan.path == str(dev_root / "nvme0n1")
    assert plan.probe() == Presence(True, "", plan.path)
    for controller in ("nvme0", "nvme1"):
        set_controller_state(sysfs, controller, "connecting")
    assert plan.probe() == Presence(False, "controller state connecting", plan.path)
    for controller in ("nvme0", "nvme1"):
        set_controller_state(sysfs, controller, "live")
    subsystem = os.path.join(sysfs, "class/nvme-subsystem/nvme-subsys0")
    os.rename(os.path.join(subsystem, "nvme0n1"), os.path.join(subsystem, "nvme0n7"))
    assert plan.probe() == Presence(True, "", str(dev_root / "nvme0n7"))


def test_a_namespace_missing_or_down_at_start_up_is_planned_absent(sysfs, caplog):
    (missing,) = namespace_plans(parse_nvmeof(_tier(sysfs, {"nsid": 9, "capacity": "1GiB"})))
    assert missing.path is None and missing.probe().path is None
    assert f"{SUBNQN} nsid 9: no such namespace" in caplog.text and "nvmeof connect" in caplog.text
    for controller in ("nvme0", "nvme1"):
        set_controller_state(sysfs, controller, "dead")
    (down,) = namespace_plans(parse_nvmeof(_tier(sysfs, {"nsid": 1, "capacity": "1GiB"})))
    assert down.path is None and down.probe() == Presence(False, "controller state dead", "/dev/nvme0n1")


def test_a_logical_block_size_that_cannot_work_is_an_error(tmp_path):
    root = str(tmp_path / "sys")
    write_sysfs(root, [FakeNamespace("nvme0n1", 1, "nvme0", logical_block_size=8192)])
    with pytest.raises(DeviceError, match="logical block size 8192 does not divide 4096"):
        namespace_plans(parse_nvmeof(_tier(root, {"nsid": 1, "capacity": "1GiB"})))


# -- nvme-cli -------------------------------------------------------------------------------


def test_connect_command_lines(tmp_path):
    config = parse_nvmeof(_tier(str(tmp_path / "empty-sys"), {"nsid": 1, "capacity": "1GiB"},
                                {"nsid": 2, "capacity": "1GiB"},
                                {"nsid": 1, "capacity": "1GiB", "subnqn": "nqn.2026-12.io.example:b",
                                 "transport": "rdma", "trsvcid": 4421},
                                hostnqn="nqn.2014-08.org.nvmexpress:host1", nr_io_queues=8,
                                queue_size=256, ctrl_loss_tmo=120, reconnect_delay=2))
    steps = connect_plan(config)
    assert [" ".join(s.argv) for s in steps] == [
        f"nvme connect --transport=tcp --traddr=192.0.2.10 --trsvcid=4420 --nqn={SUBNQN} "
        "--hostnqn=nqn.2014-08.org.nvmexpress:host1 --nr-io-queues=8 --queue-size=256 "
        "--ctrl-loss-tmo=120 --reconnect-delay=2 --fast_io_fail_tmo=5",
        "nvme connect --transport=rdma --traddr=192.0.2.10 --trsvcid=4421 --nqn=nqn.2026-12.io.example:b "
        "--hostnqn=nqn.2014-08.org.nvmexpress:host1 --nr-io-queues=8 --queue-size=256 "
        "--ctrl-loss-tmo=120 --reconnect-delay=2 --fast_io_fail_tmo=5",
    ]  # two namespaces of one subsystem share one connection
    assert not any(s.skip_reason for s in steps)
    assert [" ".join(s.argv) for s in disconnect_plan(config)] == [
        f"nvme disconnect --nqn={SUBNQN}", "nvme disconnect --nqn=nqn.2026-12.io.example:b"]


def test_connect_skips_a_connection_that_is_already_live(sysfs):
    steps = connect_plan(parse_nvmeof(_tier(sysfs, {"nsid": 1, "capacity": "1GiB"})))
    assert steps[0].skip_reason == "already connected and live"


def test_missing_nvme_cli_or_kernel_module_is_a_clear_error(tmp_path, monkeypatch, capsys):
    config_path = tmp_path / "kv.json"
    config_path.write_text(json.dumps({"tiers": {"nvmeof": _tier(str(tmp_path / "sys"),
                                                                 {"nsid": 1, "capacity": "1GiB"})}}))
    monkeypatch.setenv("PATH", str(tmp_path / "no-bin"))
    assert main(["nvmeof", "connect", "--config", str(config_path)]) == 2
    assert "nvme-cli not found" in capsys.readouterr().err
    assert main(["nvmeof", "connect", "--config", str(config_path), "--dry-run"]) == 0
    assert capsys.readouterr().out.startswith("nvme connect --transport=tcp")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "nvme").write_text("#!/bin/sh\nexit 0\n")
    (bin_dir / "nvme").chmod(0o755)
    monkeypatch.setenv("PATH", str(bin_dir))
    with pytest.raises(NvmeCliError, match="kernel module nvme_tcp is not loaded"):
        preflight(load_config(str(config_path)).nvmeof)


def test_status_json(sysfs, tmp_path, capsys):
    config_path = tmp_path / "kv.json"
    config_path.write_text(json.dumps({"tiers": {"nvmeof": _tier("/nonexistent",
                                                                 {"nsid": 1, "capacity": "1GiB"},
                                                                 {"nsid": 5, "capacity": "1GiB"})},
                                       "service": {"socket": str(tmp_path / "none.sock"),
                                                   "spawn": False}}))
    code = main(["nvmeof", "status", "--config", str(config_path), "--sysfs-root", sysfs, "--json"])
    rows = json.loads(capsys.readouterr().out)["namespaces"]
    assert code == 0
    assert rows[0]["device"] == "/dev/nvme0n1" and rows[0]["state"] == "live"
    assert rows[0]["transport"] == "tcp" and rows[0]["address"].startswith("traddr=192.0.2.10")
    assert rows[0]["tier"] == "no service running" and len(rows[0]["controllers"]) == 2
    assert rows[1]["device"] is None and rows[1]["state"] == "not connected"
    assert main(["nvmeof", "status", "--config", str(config_path), "--sysfs-root", sysfs]) == 1


def test_bench_refuses_a_namespace_that_is_not_connected(sysfs, tmp_path, capsys):
    config_path = tmp_path / "kv.json"
    config_path.write_text(json.dumps({"tiers": {"nvmeof": _tier(sysfs, {"nsid": 9, "capacity": "1GiB"})}}))
    assert main(["bench", "--tiers", "nvmeof", "--nvmeof", str(config_path), "--no-fio"]) == 2
    assert f"not connected and live: {SUBNQN} nsid 9" in capsys.readouterr().err
