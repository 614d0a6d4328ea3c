"""The NVMe-oF tier end to end on loop devices standing in for namespaces: resolution
through a generated sysfs tree, raw O_DIRECT block I/O, striping, controller loss
and return, restart."""

import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest
from support.services import service_config
from support.stores import CHUNK_BYTES, attached, make_keys, make_payloads, read_back, require_loop_devices

from bench.support.loopdev import FakeNamespace, LoopDevices, LoopNamespaces, write_sysfs
from kvstore.devices.health import IN_SERVICE, OFFLINE
from kvstore.format.record import record_bytes

pytestmark = pytest.mark.loopdev
SLOT = record_bytes(CHUNK_BYTES)


@pytest.fixture
def namespaces(disk_dir):
    with attached(LoopNamespaces(disk_dir, count=2, size=16 << 20)) as fake:
        yield fake


def _config(fake, engine):
    return {"tiers": {"nvmeof": fake.tier_config(capacity="12MiB")},
            "io": {"engine": engine, "queue_depth": 8, "timeout_s": 5}}


def test_striped_namespaces_lose_and_regain_one_path(namespaces, engine, store_factory):
    store = store_factory(_config(namespaces, engine), background=False)  # the monitor: step() below
    assert [d.path for d in store.probe.devices()] == namespaces.devices
    assert all(d.block for d in store.probe.devices())
    keys, payloads = make_keys(40), make_payloads(40)
    assert all(store.put_many(keys, payloads))
    groups = [namespaces.devices.index(store.probe.where(k).device) for k in keys]
    assert groups.count(0) == groups.count(1) == 20  # one prompt's chunks use both namespaces
    assert store.lookup(keys).tiers == ("nvmeof",) * 40

    namespaces.set_state(0, "connecting")
    store.step()
    health = store.probe.devices()[0]
    assert health.state == OFFLINE and health.reason == "controller state connecting"
    ok, outs = read_back(store, keys)
    assert ok == [g == 1 for g in groups]  # only namespace 0's chunks are lost
    assert all(np.array_equal(o, p) for served, o, p in zip(ok, outs, payloads, strict=True) if served)

    namespaces.set_state(0, "live")
    store.step()
    assert store.probe.devices()[0].state == IN_SERVICE
    ok, outs = read_back(store, keys)
    assert all(ok) and all(np.array_equal(o, p) for o, p in zip(outs, payloads, strict=True))
    store.close()

    reopened = store_factory(_config(namespaces, engine))
    assert reopened.probe.recovery()["records"] == 40 and reopened.probe.recovery()["from_checkpoint"] == 2
    ok, outs = read_back(reopened, keys)
    assert all(ok) and all(np.array_equal(o, p) for o, p in zip(outs, payloads, strict=True))


def test_the_monitor_thread_acts_on_its_own(namespaces, store_factory):
    store = store_factory(_config(namespaces, "auto"))
    keys, payloads = make_keys(4), make_payloads(4)
    assert all(store.put_many(keys, payloads))
    namespaces.set_state(1, "resetting")
    deadline = time.monotonic() + 10
    while store.probe.devices()[1].state == IN_SERVICE and time.monotonic() < deadline:
        time.sleep(0.05)
    assert store.probe.devices()[1].state == OFFLINE
    assert store.lookup(keys).count == 1  # chunk 1 sat on namespace 1: the run stops there
    namespaces.set_state(1, "live")
    while store.probe.devices()[1].state != IN_SERVICE and time.monotonic() < deadline:
        time.sleep(0.05)
    assert store.lookup(keys).count == 4


def test_bench_reports_one_and_all_namespaces(disk_dir, tmp_path):
    require_loop_devices()
    out = tmp_path / "bench.json"
    done = subprocess.run([sys.executable, "-m", "kvstore.cli", "bench", "--tiers", "nvmeof",
                           "--nvmeof-loop", "2", "--chunk-size", "256KiB", "--queue-depth", "4",
                           "--total", "8MiB", "--fio-seconds", "1", "--json", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    rows = json.loads(out.read_text())["results"]
    assert sorted((r["namespaces"], r["engine"]) for r in rows) == [
        (1, "threads"), (1, "uring"), (2, "threads"), (2, "uring")]
    assert all(r["tier"] == "nvmeof" and r["read_gibps"] > 0 and "vs_one_namespace" in r for r in rows)
    assert "nvmeof x2" in done.stdout
    # Its own loop devices are gone (others' may come and go meanwhile on a shared machine).
    workdir = done.stderr.split(" per case on ", 1)[1].split()[0]
    assert workdir not in subprocess.run(["losetup", "-a"], capture_output=True, text=True).stdout


def test_status_shows_the_running_services_view(namespaces, tmp_path, capsys):
    from support.services import stop_service

    from kvstore.cli import main
    from kvstore.config.store import load_config
    from kvstore.service.client import StoreClient

    raw = {"tiers": {"nvmeof": namespaces.tier_config(capacity="12MiB")},
           **service_config(tmp_path, socket="kv.sock")}
    path = tmp_path / "kv.json"
    path.write_text(json.dumps(raw))
    client = StoreClient(load_config(raw), CHUNK_BYTES)  # starts the service on the namespaces
    try:
        assert main(["nvmeof", "status", "--config", str(path), "--json"]) == 0
        rows = json.loads(capsys.readouterr().out)["namespaces"]
        assert [r["device"] for r in rows] == namespaces.devices
        assert all(r["state"] == "live" and r["tier"]["state"] == "in_service" for r in rows)
    finally:
        client.close()
        stop_service(raw)


def test_a_namespace_absent_at_start_up_is_added_when_it_appears(namespaces, disk_dir, store_factory):
    config = _config(namespaces, "auto")
    config["tiers"]["nvmeof"]["namespaces"].append(
        {"subnqn": LoopNamespaces.subnqn(2), "nsid": 1, "capacity": "12MiB"})
    store = store_factory(config, background=False)  # starts without the third namespace
    assert store.probe.devices()[2].state == OFFLINE
    keys, payloads = make_keys(6), make_payloads(6)
    assert all(store.put_many(keys, payloads))  # striped over the two present ones
    later = os.path.join(disk_dir, "later")
    os.mkdir(later)
    with LoopDevices(later, count=1, size=16 << 20) as third:
        write_sysfs(namespaces.sysfs_root, [FakeNamespace(os.path.basename(third.devices[0]), 1, "nvme2")],
                    LoopNamespaces.subnqn(2), subsystem_index=2)
        store.step()
        devices = store.probe.devices()
        assert devices[2].state == IN_SERVICE and devices[2].path == third.devices[0]
        more, more_payloads = make_keys(6, seed=4), make_payloads(6, seed=4)
        assert all(store.put_many(more, more_payloads))
        assert {store.probe.where(k).device for k in more} == {d.path for d in devices}
        ok, outs = read_back(store, keys + more)
        assert all(ok) and all(np.array_equal(o, p) for o, p in zip(outs, payloads + more_payloads,
                                                                   strict=True))
        store.close()


def test_a_namespace_back_under_another_name_is_reopened(namespaces, tmp_path, store_factory):
    """After ctrl_loss_tmo a reconnect can give the namespace a new device name; the
    tier finds it by NQN and NSID, reopens it there and serves its records again."""
    dev_root = tmp_path / "dev"
    dev_root.mkdir()
    for device in namespaces.devices:
        os.symlink(device, dev_root / os.path.basename(device))
    config = _config(namespaces, "auto")
    config["tiers"]["nvmeof"]["dev_root"] = str(dev_root)
    store = store_factory(config, background=False)
    keys, payloads = make_keys(8), make_payloads(8)
    assert all(store.put_many(keys, payloads))
    old_name = os.path.basename(namespaces.devices[0])
    subsystem = os.path.join(namespaces.sysfs_root, "class", "nvme-subsystem", "nvme-subsys0")
    os.rename(os.path.join(subsystem, old_name), os.path.join(subsystem, "nvme7n1"))
    os.symlink(namespaces.devices[0], dev_root / "nvme7n1")
    store.step()  # still live, but elsewhere: out
    health = store.probe.devices()[0]
    assert health.state == OFFLINE and "moved to" in health.reason
    store.step()  # reopened at the new name, revalidated
    health = store.probe.devices()[0]
    assert health.state == IN_SERVICE and health.path == str(dev_root / "nvme7n1")
    ok, outs = read_back(store, keys)
    assert all(ok) and all(np.array_equal(o, p) for o, p in zip(outs, payloads, strict=True))
