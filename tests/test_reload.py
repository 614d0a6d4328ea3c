"""SIGHUP reload keeps the service and its engines: an engine connected before a reload
that changed a live key reconnects with the config it started with and loads; a file
that cannot be read (not UTF-8, unreadable, nested or aliased past bounds, too large)
leaves the service serving with its old config, counted as malformed.config; and a
SIGHUP while a spawned service starts (through its first store, recovery included)
never ends it; and a state file the service reads (`SOCKET.learned` at the first hello or
at a reload that switches to `learned`, `SOCKET.namespaces` at start) that is nested a
million deep, huge or garbage is moved aside (`.bad`) and counted, the service serving
from cold. Each test runs a real `kvstore serve`."""

from __future__ import annotations

import ctypes
import errno
import json
import os
import platform
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from support.services import service_config, serving, stop_service, wait_for_log
from support.stores import CHUNK_BYTES, make_keys, make_payloads

from kvstore.config.store import load_config
from kvstore.format.errors import KVStoreError
from kvstore.format.record import record_bytes
from kvstore.service.client import StoreClient


def _raw(tmp_path: Path, disk_dir: str, **changes) -> dict:
    slot = record_bytes(CHUNK_BYTES)
    return {**service_config(tmp_path, dram=4 * slot, disk_dir=disk_dir, disk=32 * slot, io={"timeout_s": 5},
                             socket="run/kv.sock", spawn=False),
            **changes}


def _put(client: StoreClient, keys, payloads) -> None:
    for i, payload in enumerate(payloads):
        client.memory.slot(i)[:] = payload.tobytes()
    assert client.put(keys, list(range(len(keys)))) == [True] * len(keys)


def _loads(client: StoreClient, keys, payloads) -> bool:
    slots = list(range(len(keys)))
    return client.get(keys, slots) == [True] * len(keys) and all(
        bytes(client.memory.slot(i)) == payload.tobytes() for i, payload in enumerate(payloads))


@dataclass
class TwoChunks:
    """A `kvstore serve` started from its config file and a client that stored two chunks."""

    service: subprocess.Popen[bytes]
    log: Path
    raw: dict
    client: StoreClient
    keys: list[bytes]
    payloads: list


@contextmanager
def serving_two_chunks(tmp_path: Path, disk_dir: str, seed: int) -> Iterator[TwoChunks]:
    path, log = tmp_path / "kv.yaml", tmp_path / "serve.log"
    raw = _raw(tmp_path, disk_dir)
    path.write_text(yaml.safe_dump(raw))
    keys, payloads = make_keys(2, seed=seed), make_payloads(2, seed=seed)
    with serving(path, log) as service:
        client = StoreClient(load_config(raw), CHUNK_BYTES)
        _put(client, keys, payloads)  # the store's threads and this client's exist now
        yield TwoChunks(service, log, raw, client, keys, payloads)


def test_an_engine_connected_before_a_reload_that_changed_eviction_reconnects_and_loads(tmp_path, disk_dir):
    path, log = tmp_path / "kv.yaml", tmp_path / "serve.log"
    started = _raw(tmp_path, disk_dir)
    path.write_text(yaml.safe_dump(started))
    keys, payloads = make_keys(3, seed=5), make_payloads(3, seed=5)
    with serving(path, log) as service:
        engine = StoreClient(load_config(started), CHUNK_BYTES)  # the config it started with
        _put(engine, keys, payloads)
        seen = len(log.read_text())
        path.write_text(yaml.safe_dump({**started, "eviction": "cost", "disk_admission": "second-touch"}))
        service.send_signal(signal.SIGHUP)
        wait_for_log(log, "reload: disk_admission second-touch, eviction cost", seen)
        assert _loads(engine, keys, payloads)  # its connection kept
        engine.close()  # engines reconnect after any missed deadline
        engine = StoreClient(load_config(started), CHUNK_BYTES)
        assert _loads(engine, keys, payloads)
        newer = StoreClient(load_config(str(path)), CHUNK_BYTES)  # and one started after the reload
        assert _loads(newer, keys, payloads)
        for client in (engine, newer):
            client.close()
        other = {**started, "write_behind_chunks": 3}  # a key the reload does not apply: still refused
        with pytest.raises(KVStoreError, match=r"another config listens there \(they differ in write_behind"):
            StoreClient(load_config(other), CHUNK_BYTES)
        stop_service(started)
        assert service.wait(timeout=30) == 0


def _nested(depth: int) -> str:
    return "tiers: " + "[" * depth + "]" * depth + "\n"


def _aliased(levels: int) -> str:
    """A YAML alias bomb: a few hundred bytes that name 10**levels values."""
    lines = ['a0: &a0 ["x", "x", "x", "x", "x", "x", "x", "x", "x", "x"]']
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, levels + 1)]
    return "\n".join(lines) + "\n"


def test_a_file_that_cannot_be_read_leaves_the_service_serving(tmp_path, disk_dir):
    path, log = tmp_path / "kv.yaml", tmp_path / "serve.log"
    raw = _raw(tmp_path, disk_dir)
    path.write_text(yaml.safe_dump(raw))
    keys, payloads = make_keys(2, seed=6), make_payloads(2, seed=6)
    good = path.read_bytes()
    bad = {"not UTF-8": good + b"# caf\xe9\n", "nested too deep": _nested(20_000).encode(),
           "aliased past bounds": _aliased(9).encode(), "too large": b"# " + b"x" * (2 << 20) + b"\n",
           "unreadable": None}  # a file whose read fails (EIO) whoever reads it, root included
    with serving(path, log) as service:
        client = StoreClient(load_config(raw), CHUNK_BYTES)
        _put(client, keys, payloads)
        for what, content in bad.items():
            path.unlink()
            if content is None:
                path.symlink_to("/proc/self/mem")  # the service's own memory, read at address 0
            else:
                path.write_bytes(content)
            seen = len(log.read_text())
            service.send_signal(signal.SIGHUP)
            wait_for_log(log, "reload: the config is unchanged", seen)
            assert service.poll() is None, what
            assert _loads(client, keys, payloads), what
        assert client.info()["counters"]["malformed.config"] == len(bad)
        client.close()
        path.unlink()
        path.write_bytes(good)
        stop_service(raw)
        assert service.wait(timeout=30) == 0
    text = log.read_text()
    assert "Traceback" not in text
    assert "cannot be read" in text and "not UTF-8" in text and "nested too deeply" in text
    assert "more than 100000 values" in text and "larger than" in text


def test_sighup_while_a_spawned_service_starts_never_ends_it(tmp_path, disk_dir):
    """A service an engine spawns gets SIGHUP over and over from its first instant, through
    its first store (the disk tier's recovery): it comes up, serves, and reloads."""
    raw = _raw(tmp_path, disk_dir)
    raw["service"]["spawn"] = True
    keys, payloads = make_keys(4, seed=7), make_payloads(4, seed=7)
    first = StoreClient(load_config(raw), CHUNK_BYTES)  # records on disk for the next recovery
    _put(first, keys, payloads)
    first.close()
    stop_service(raw)
    service_argv = [b"-m", b"kvstore.cli", b"serve", b"--config", f"{raw['service']['socket']}.json".encode()]
    hups, done = [0], threading.Event()

    def hang_up_on_it() -> None:
        while not done.is_set():
            for pid in _processes_running(service_argv):
                try:
                    os.kill(pid, signal.SIGHUP)
                    hups[0] += 1
                except ProcessLookupError:
                    pass
            time.sleep(0.002)

    storm = threading.Thread(target=hang_up_on_it)
    storm.start()
    try:
        client = StoreClient(load_config(raw), CHUNK_BYTES)  # spawns it, its hello makes the store
        assert _loads(client, keys, payloads)
    finally:
        done.set()
        storm.join()
    assert hups[0] > 0
    pid = client.info()["service_pid"]  # still there after the storm
    log_path = Path(raw["service"]["socket"] + ".log")
    os.kill(pid, signal.SIGHUP)  # the storm may have ended before its handler was set: it reloads
    wait_for_log(log_path, "reload: no policy changed")
    client.close()
    stop_service(raw)
    assert "Traceback" not in log_path.read_text()


def test_a_storm_of_sighup_at_a_serving_service_never_ends_or_hangs_it(tmp_path, disk_dir):
    """SIGHUP sent as fast as two threads can, for seconds, while a client loads: the
    handlers (nested in each other, landing while the loop holds its locks) never end or
    hang the service; it keeps serving, reloads after the storm and stops when asked."""
    with serving_two_chunks(tmp_path, disk_dir, seed=8) as served:
        service, log = served.service, served.log
        until = time.monotonic() + 4

        def storm() -> None:
            while time.monotonic() < until and service.poll() is None:
                service.send_signal(signal.SIGHUP)

        storms = [threading.Thread(target=storm) for _ in range(2)]
        for thread in storms:
            thread.start()
        loads = 0
        while time.monotonic() < until and service.poll() is None:
            assert _loads(served.client, served.keys, served.payloads)
            loads += 1
        for thread in storms:
            thread.join()
        assert service.poll() is None, log.read_text()[-2000:]
        seen = len(log.read_text())
        service.send_signal(signal.SIGHUP)
        wait_for_log(log, "reload: ", seen)
        assert loads > 0 and _loads(served.client, served.keys, served.payloads)
        served.client.close()
        stop_service(served.raw)
        assert service.wait(timeout=30) == 0
    assert "Traceback" not in log.read_text()


_TGKILL = {"x86_64": 234, "aarch64": 131}  # the syscall's number


def _signal_thread(pid: int, tid: int, sig: int) -> bool:
    """Send `sig` to one thread of another process (tgkill), as the kernel may hand a
    signal sent to the process to any thread that does not block it; False if that
    thread has ended."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.syscall(_TGKILL[platform.machine()], pid, tid, int(sig)) == 0:
        return True
    if ctypes.get_errno() == errno.ESRCH:
        return False
    raise OSError(ctypes.get_errno(), "tgkill")


def _other_threads(pid: int) -> list[int]:
    return sorted(int(tid) for tid in os.listdir(f"/proc/{pid}/task") if int(tid) != pid)


@pytest.mark.skipif(platform.machine() not in _TGKILL, reason="tgkill's number known here")
def test_a_signal_caught_by_a_thread_other_than_the_main_one_is_acted_on(tmp_path, disk_dir):
    """The kernel hands SIGHUP or SIGTERM sent to the service to any of its threads; caught
    by a client's, the store's or a watcher's thread, it still reloads the config or stops
    the service, at once (before, the main thread slept on in its poll: a reload or a stop
    waited for the next client)."""
    with serving_two_chunks(tmp_path, disk_dir, seed=9) as served:
        pid, log = served.service.pid, served.log
        signalled = 0
        for tid in _other_threads(pid):
            seen = len(log.read_text())
            if _signal_thread(pid, tid, signal.SIGHUP):  # not a thread that has ended since
                wait_for_log(log, "reload: ", seen, timeout_s=10)
                signalled += 1
        assert signalled >= 2
        assert _loads(served.client, served.keys, served.payloads)
        served.client.close()
        assert any(_signal_thread(pid, tid, signal.SIGTERM) for tid in _other_threads(pid))
        assert served.service.wait(timeout=30) == 0
    assert "Traceback" not in log.read_text()


def _processes_running(argv: list[bytes]) -> list[int]:
    """Interpreters running `argv` (the service itself, not the launcher that names it)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    if f.read().split(b"\0")[1:-1] == argv:
                        found.append(int(entry))
            except OSError:
                continue
    return found


def test_a_config_error_names_no_password(tmp_path, disk_dir):
    """A config error quoting an index URL masks its password (ConfigError), so a reload
    that logs it does too."""
    from kvstore.format.errors import ConfigError

    url = "redis+cluster://u:hunter2@h:notaport"
    with pytest.raises(ConfigError) as raised:
        load_config(json.dumps({**_raw(tmp_path, disk_dir), "cluster": {"host_id": "a", "index_url": url}}))
    assert "hunter2" not in str(raised.value) and "u:***@h" in str(raised.value)


# -- state files: what `learned` admission learned, the announced namespaces ------------------

def _state_file(kind: str) -> bytes:
    """A state file that is not one: nested a million deep, over any bound (60 MiB), garbage."""
    if kind == "nested":
        return b"[" * 1_000_000 + b"]" * 1_000_000
    if kind == "huge":
        return b"[" + b"0," * (30 << 20) + b"0]"
    return b"\x00\xff{[\"version\": 1,"


STATE_FILES = ["nested", "huge", "garbage"]


def _placed(socket: str, suffix: str, content: bytes) -> Path:
    """`content` as the service's state file SOCKET+suffix, placed as the service would find
    it: 0600 in its private directory (made here, 0700, if it is not there yet)."""
    path = Path(socket + suffix)
    path.parent.mkdir(mode=0o700, exist_ok=True)
    path.unlink(missing_ok=True)
    path.write_bytes(content)
    path.chmod(0o600)
    return path


def _round_trip(config: dict, seed: int) -> StoreClient:
    """An engine's client: its hello makes or joins the store, a put and a get; the chunk
    events of the put come through."""
    client = StoreClient(load_config(config), CHUNK_BYTES)
    cursor = client.events(-1)[0]
    keys, payloads = make_keys(2, seed=seed), make_payloads(2, seed=seed)
    _put(client, keys, payloads)
    assert _loads(client, keys, payloads)
    assert {key for stored, key, _ in client.events(cursor)[2] if stored} >= set(keys)
    return client


@pytest.mark.parametrize("kind", STATE_FILES)
def test_a_bad_learned_file_is_set_aside_at_the_first_hello(tmp_path, disk_dir, kind):
    path, log = tmp_path / "kv.yaml", tmp_path / "serve.log"
    raw = _raw(tmp_path, disk_dir, disk_admission="learned")
    path.write_text(yaml.safe_dump(raw))
    learned = _placed(raw["service"]["socket"], ".learned", _state_file(kind))
    with serving(path, log) as service:
        client = _round_trip(raw, seed=8)
        assert client.info()["counters"]["admission.learned_refused"] == 1
        client.close()
        stop_service(raw)
        assert service.wait(timeout=30) == 0
    assert Path(f"{learned}.bad").read_bytes() == _state_file(kind)
    assert "returns" in json.loads(learned.read_text())  # written anew at the stop, from cold
    assert "Traceback" not in log.read_text()


def test_a_reload_to_learned_over_a_nested_file_leaves_the_service_serving(tmp_path, disk_dir):
    path, log = tmp_path / "kv.yaml", tmp_path / "serve.log"
    raw = _raw(tmp_path, disk_dir, disk_admission="all")
    path.write_text(yaml.safe_dump(raw))
    with serving(path, log) as service:
        client = _round_trip(raw, seed=9)
        learned = _placed(raw["service"]["socket"], ".learned", _state_file("nested"))
        path.write_text(yaml.safe_dump({**raw, "disk_admission": "learned"}))
        seen = len(log.read_text())
        service.send_signal(signal.SIGHUP)
        wait_for_log(log, "reload: disk_admission learned", seen)
        assert service.poll() is None
        client.close()
        client = _round_trip(raw, seed=10)
        assert client.info()["counters"]["admission.learned_refused"] == 1
        assert Path(f"{learned}.bad").exists()
        client.close()
        stop_service(raw)
        assert service.wait(timeout=30) == 0
    assert "Traceback" not in log.read_text()


@pytest.mark.parametrize("kind", STATE_FILES)
def test_a_bad_namespaces_file_is_set_aside_at_start(tmp_path, disk_dir, kind):
    path, log = tmp_path / "kv.yaml", tmp_path / "serve.log"
    raw = _raw(tmp_path, disk_dir)
    path.write_text(yaml.safe_dump(raw))
    book = _placed(raw["service"]["socket"], ".namespaces", _state_file(kind))
    with serving(path, log) as service:
        client = _round_trip(raw, seed=11)
        client.announce([(b"n" * 16, {"model": "m"})])
        assert [entry["namespace"] for entry in client.namespaces()] == [(b"n" * 16).hex()]
        assert client.info()["counters"]["malformed.state_file"] == 1
        client.close()
        stop_service(raw)
        assert service.wait(timeout=30) == 0
    assert Path(f"{book}.bad").read_bytes() == _state_file(kind)
    assert "Traceback" not in log.read_text()
