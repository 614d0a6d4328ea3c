"""The disk tier on real block devices: loop devices with direct I/O and 4 KiB sectors."""


import numpy as np
import pytest
from support.stores import CHUNK_BYTES, attached, make_keys, make_payloads, read_back

from bench.support.loopdev import LoopDevices
from kvstore.format.errors import DeviceError
from kvstore.format.record import record_bytes

pytestmark = pytest.mark.loopdev
SLOT = record_bytes(CHUNK_BYTES)


@pytest.fixture
def loop_devices(disk_dir):
    with attached(LoopDevices(disk_dir, count=2, size=16 << 20)) as loops:
        yield loops.devices


def test_striped_block_devices_round_trip_and_recover(loop_devices, engine, store_factory):
    config = {"tiers": {"disk": [{"path": d, "capacity": "12MiB"} for d in loop_devices]},
              "io": {"engine": engine, "queue_depth": 8}}
    store = store_factory(config)
    assert all(d.block for d in store.probe.devices())
    keys, payloads = make_keys(40), make_payloads(40)
    assert all(store.put_many(keys, payloads))
    devices = [store.probe.where(k).device for k in keys]
    per_device = [devices.count(d) for d in loop_devices]
    assert per_device == [20, 20]  # one prompt's chunks alternate between the devices
    store.close()
    reopened = store_factory(config)
    ok, outs = read_back(reopened, keys)
    assert all(ok) and all(np.array_equal(o, p) for o, p in zip(outs, payloads, strict=True))


def test_block_device_with_foreign_data_is_refused(loop_devices, store_factory):
    with open(loop_devices[0], "r+b", buffering=0) as raw:
        raw.write(b"ext4 superblock, say" + bytes(4076))
    with pytest.raises(DeviceError, match="not a kvstore tier; refusing to overwrite"):
        store_factory({"tiers": {"disk": [{"path": loop_devices[0], "capacity": "8MiB"}]}})


def test_capacity_beyond_the_device_is_refused(loop_devices, store_factory):
    with pytest.raises(DeviceError, match="exceeds the device size"):
        store_factory({"tiers": {"disk": [{"path": loop_devices[0], "capacity": "1GiB"}]}})
