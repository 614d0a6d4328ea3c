"""Which disk-tier devices serve: their breakers, taking one out, bringing one back.

Each device has a DeviceHealth. A device that faults repeatedly, or whose probe
fails, is taken out of service: its chunks leave the index at once (misses, not
deadlines), nothing new is placed there, and writes in flight to it are never
published. It serves again only after revalidation: the same superblock, the
headers of those in-flight writes zeroed, and every slot's header re-read; a record
deleted (or of a namespace purged) while it was out is not brought back but zeroed then
(`forget`: a delete cannot reach a device out of service).
State changes happen under the tier's table lock. The device watch (devices/watch.py)
drives probes, taking out and revalidation from its thread.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

from kvstore.devices.health import TRIPPED, DeviceHealth, Probe, fault_reason, is_fault
from kvstore.tiers.recover import DiskParts, RecoveryReport, newest, scan_group
from kvstore.tiers.slots import Entry

log = logging.getLogger(__name__)
FORGOTTEN_MOST = 1 << 20  # keys deleted while a device is out, kept for its return (16 MiB+)
SCANS_MOST = 3  # a revalidation's scans while deletes keep coming, before it tries later


class DeviceAvailability:
    def __init__(self, disk: DiskParts, breaker_threshold: int) -> None:
        self.disk = disk
        self.breaker_threshold = breaker_threshold
        self.health = [DeviceHealth(plan.label or plan.path or "", plan.kind)
                       for plan in disk.devices.plans]
        # Per device: slots reserved for a write when it left service (zeroed on revalidation).
        self._in_flight_at_loss: list[set[int]] = [set() for _ in disk.devices.plans]
        self._serving = bool(self.health)  # any device in service; set where health changes
        # Deleted while a device was out (keys, namespaces purged): its copies are zeroed
        # when it comes back. Kept while any device is out, at most FORGOTTEN_MOST keys.
        self._forgotten: tuple[set[bytes], set[bytes]] = (set(), set())
        self._forgets = 0  # deletes told so far (a revalidation scans again if one came during its scan)

    def forget(self, keys: Sequence[bytes] = (), namespaces: Sequence[bytes] = ()) -> None:
        """These keys were deleted, or these namespaces purged: a device out of service now
        may hold copies that its revalidation must not bring back."""
        with self.disk.table.lock:
            if all(h.in_service for h in self.health):
                return
            gone_keys, gone_namespaces = self._forgotten
            room = FORGOTTEN_MOST - len(gone_keys)
            if len(keys) > room:
                self.disk.stats.add("disk.deletes_not_kept_while_out", len(keys) - room)
            gone_keys.update(keys[:max(0, room)])
            gone_namespaces.update(namespaces)
            self._forgets += 1

    def pending_namespaces(self) -> list[bytes]:
        """The namespaces purged while a device was out of service, whose records there its
        return must still zero (kept across restarts by the service: service/purge_file.py)."""
        with self.disk.table.lock:
            return sorted(self._forgotten[1])

    def any_in_service(self) -> bool:
        """Whether a write has a device to go to. A flag read without the table's lock: each
        DRAM victim a reservation looks at asks it, under the DRAM table's lock; a device
        leaving just after only fails that write, as any fault does, and one coming back
        just after costs one victim its disk copy (a miss later, never wrong KV)."""
        return self._serving

    def epoch_of(self, slot: int) -> int:
        """The epoch of the slot's device; see `still_serving`."""
        with self.disk.table.lock:
            return self.health[self.disk.table.groups.of(slot)[0]].epoch

    def still_serving(self, slot: int, epoch: int) -> bool:
        """Whether the slot's device has stayed in service since `epoch` (table lock held)."""
        health = self.health[self.disk.table.groups.of(slot)[0]]
        return health.in_service and health.epoch == epoch

    def account(self, slots: Sequence[int], results: Sequence[int], expected: Sequence[int]) -> None:
        """Feed results to each device's breaker; trip the ones that keep faulting."""
        table = self.disk.table
        with table.lock:
            for slot, result, size in zip(slots, results, expected, strict=True):
                group = table.groups.of(slot)[0]
                health = self.health[group]
                if health.record(is_fault(result, size), self.breaker_threshold):
                    self.take_out(group, TRIPPED, f"{health.consecutive_faults} faults in a row "
                                                  f"(last: {fault_reason(result)})")

    def watched(self) -> list[tuple[DeviceHealth, Probe | None, str | None]]:
        """Each device's health, probe and path, for the device watch."""
        devices = self.disk.devices
        return [(health, plan.probe, device.path) for health, plan, device
                in zip(self.health, devices.plans, devices.devices, strict=True)]

    def recheck(self, group: int) -> str | None:
        """Nothing beyond the probe: this host owns its devices, no one else reformats them."""
        return None

    def take_out(self, group: int, state: str, reason: str) -> None:
        """Stop serving a device: its chunks leave the index now."""
        table = self.disk.table
        with table.lock:
            health = self.health[group]
            health.take_out(state, reason)
            self._serving = any(h.in_service for h in self.health)
            lost, in_flight = table.service.take_out(group)
            self._in_flight_at_loss[group].update(in_flight)
        self.disk.stats.add("disk.lost_chunks", lost)
        if state == TRIPPED:
            self.disk.stats.add("disk.trips")
        log.warning("disk tier: %s taken out of service (%s): %s; %d chunks become misses",
                    health.label, state, reason, lost)

    def revalidate(self, group: int, path: str | None = None) -> bool:
        """Bring a device back, opening it at `path` if it is not open there: True when
        it serves again. Waits for nothing: if an I/O from before the loss still holds a
        slot, or any check fails, the device stays out and the caller tries later."""
        disk, table = self.disk, self.disk.table
        health = self.health[group]
        with table.lock:
            if health.in_service or table.service.held(group):
                return health.in_service
            suspects = sorted(self._in_flight_at_loss[group])
        problem, reopened = disk.devices.reopen(group, path, table.groups.sizes[group])
        layout = disk.devices.layouts[group]
        if problem is None and layout is not None and not reopened:
            problem = layout.still_ours()
        if problem is None and suspects and not all(disk.zero_headers(suspects, disk.timeout_s)):
            problem = "could not zero the headers of writes in flight at the loss"
        zeroed = 0  # records deleted while it was out
        for scans in range(1, SCANS_MOST + 1):  # again if deletes came during a scan (it missed them)
            seen = self._forgets
            found, deleted, problem = self._scan(group, problem)
            zeroed += deleted
            with table.lock:
                if problem is None and self._forgets != seen:
                    if scans < SCANS_MOST:
                        continue
                    problem = "deletes kept coming during its scans"
                if problem is not None:
                    health.reason, health.since = f"revalidation failed: {problem}", time.monotonic()
                    log.warning("disk tier: %s stays out of service: %s", health.label, problem)
                    return False
                table.service.bring_back(group, found)  # from here on a delete reaches its records
                self._in_flight_at_loss[group].clear()
                health.put_back()
                self._serving = True
                if all(h.in_service for h in self.health):
                    self._forgotten = (set(), set())
            break
        disk.stats.add("disk.deleted_while_out", zeroed)
        disk.stats.add("disk.revalidated_chunks", len(found))
        log.warning("disk tier: %s back in service; %d records verified", health.label, len(found))
        return True

    def _scan(self, group: int, problem: str | None) -> tuple[list[Entry], int, str | None]:
        """Re-read every header of a returning device: (the records to serve, how many were
        deleted while it was out, what failed). Older copies of a key and deleted records
        get their headers zeroed."""
        disk = self.disk
        if problem is not None or disk.devices.layouts[group] is None:
            return [], 0, problem
        report = RecoveryReport()
        gone_keys, gone_namespaces = self._forgotten
        scanned, deleted = scan_group(disk, group, report,
                                      lambda key, namespace: key in gone_keys or namespace in gone_namespaces)
        found, stale = newest(scanned)
        if report.io_errors:
            return found, len(deleted), f"{report.io_errors} header reads failed"
        if stale + deleted and not all(disk.zero_headers([e.slot for e in stale + deleted], disk.timeout_s)):
            return found, len(deleted), "could not zero the headers of older or deleted copies of keys"
        return found, len(deleted), None
