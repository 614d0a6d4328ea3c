"""Another host's block tier as this host reads it: a read-only DeviceSet (the cluster's
peer devices). It opens what its owner holds locked, never writes a byte of it, keeps the
place of a device it cannot open (saying why), refuses a data file behind a link, and
follows its owner's reformat."""

from __future__ import annotations

import hashlib
import os

from kvstore.devices.device import DATA_FILE, DevicePlan
from kvstore.devices.device_set import DeviceSet
from kvstore.format.record import record_bytes
from kvstore.io import make_engine

CHUNK = 64 << 10
SLOT = record_bytes(CHUNK)
CAPACITY = 32 * SLOT


def digest(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def test_a_read_only_set_reads_an_owned_device_and_never_writes_it(disk_dir):
    engine = make_engine("threads", 4)
    owned, missing = os.path.join(disk_dir, "owner"), os.path.join(disk_dir, "absent")
    owner = DeviceSet([DevicePlan(owned, CAPACITY)], engine, SLOT, CHUNK, 5.0)  # holds the flock
    before = digest(os.path.join(owned, DATA_FILE))
    view = DeviceSet([DevicePlan(owned, CAPACITY), DevicePlan(missing, CAPACITY)], engine, SLOT, 0, 5.0,
                     read_only=True)
    try:
        layout = view.layouts[0]
        assert layout is not None and layout.sb == owner.layouts[0].sb  # type: ignore[union-attr]
        assert view.problems == [None, view.problems[1]] and "cannot open read-only" in str(view.problems[1])
        assert view.layouts[1] is None and view.locate(0, 3)[1] == owner.locate(0, 3)[1]
        layout.reread()
        assert view.reopen(0, None) == (None, True)  # read-only: always opened again
        assert digest(os.path.join(owned, DATA_FILE)) == before
        # its owner reformats it (a new device id): the view follows on its next read
        owner.close()
        os.unlink(os.path.join(owned, DATA_FILE))
        owner = DeviceSet([DevicePlan(owned, CAPACITY)], engine, SLOT, CHUNK, 5.0)
        old_id = view.layouts[0].sb.device_id  # type: ignore[union-attr]
        assert view.reopen(0, None) == (None, True)
        assert view.layouts[0].sb.device_id not in (old_id, b"")  # type: ignore[union-attr]
    finally:
        view.close()
        owner.close()
        engine.close()


def test_a_read_only_set_refuses_a_link_and_a_device_of_other_slots(disk_dir):
    engine = make_engine("threads", 4)
    owned, linked = os.path.join(disk_dir, "owner"), os.path.join(disk_dir, "linked")
    owner = DeviceSet([DevicePlan(owned, CAPACITY)], engine, SLOT, CHUNK, 5.0)
    os.mkdir(linked, 0o700)
    os.symlink(os.path.join(owned, DATA_FILE), os.path.join(linked, DATA_FILE))
    view = DeviceSet([DevicePlan(linked, CAPACITY), DevicePlan(owned, CAPACITY)], engine, 2 * SLOT, 0, 5.0,
                     read_only=True)
    try:
        assert view.layouts == [None, None]
        assert "cannot open read-only" in str(view.problems[0])  # O_NOFOLLOW
        assert "this store's slots are" in str(view.problems[1])
        assert view.reopen(1, None)[1] is False
    finally:
        view.close()
        owner.close()
        engine.close()
