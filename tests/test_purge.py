"""`kvstore purge`: a namespace's records leave every tier of this host, others' stay.

Records carry their namespace digest in the header (a put names it); the service keeps
what engines announced about each namespace; the owner purges by model, weights and
generation, or by digest, with a dry run that only counts. (An `allowed_uids` client is
refused: tests/test_security.py.)"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support.services import service_config, serving
from support.stores import CHUNK_BYTES, make_payloads

from kvstore.config.store import load_config
from kvstore.format.errors import KVStoreError
from kvstore.format.keys import KVNamespace, Weights, chunk_keys
from kvstore.format.malformed import MalformedCounts
from kvstore.format.record import record_bytes
from kvstore.service.client import StoreClient, stop_service
from kvstore.service.namespaces import NamespaceBook
from kvstore.service.purge_file import PendingPurges

SLOT = record_bytes(CHUNK_BYTES)
OLD = KVNamespace("llama", "float16", "cpu", 16, weights=Weights("xxh3:aa"))
NEW = KVNamespace("llama", "float16", "cpu", 16, weights=Weights("xxh3:aa", "9f01"))
OTHER = KVNamespace("qwen", "float16", "cpu", 16, weights=Weights("xxh3:bb"))


def tiers(directory: str, dram_slots: int = 4) -> dict:
    return {"tiers": {"dram": {"capacity": dram_slots * SLOT},
                      "disk": [{"path": os.path.join(directory, "disk"), "capacity": 64 * SLOT}]}}


def listed(book: NamespaceBook) -> list[dict]:
    """A small book's namespaces: its first page."""
    return book.page(None)


def put_chain(store, namespace: KVNamespace, chunks: int, seed: int) -> list[bytes]:
    keys = chunk_keys(range(seed, seed + 16 * chunks), namespace)
    stored = store.put_many(keys, make_payloads(chunks, seed=seed), namespace=namespace.digest())
    assert stored == [True] * chunks
    return keys


def test_a_purge_removes_one_namespace_from_dram_and_disk_and_nothing_else(disk_dir, store_factory):
    store = store_factory(tiers(disk_dir), background=False)
    new = put_chain(store, NEW, 2, seed=1000)
    other = put_chain(store, OTHER, 2, seed=2000)
    unnamed = chunk_keys(range(16), OLD)[:1]
    store.put_many(unnamed, make_payloads(1, seed=3))  # no namespace: the store's (zeros)
    old = put_chain(store, OLD, 6, seed=1)  # more than DRAM holds: some written down to disk
    assert {tier for key in old for tier in store.lookup([key]).tiers} == {"dram", "disk"}

    dry = store.admin.purge([OLD.digest()], dry_run=True)
    assert dry["chunks"] == 6 and dry["removed"] == 0
    assert dry["dram_chunks"] + dry["disk_chunks"] >= 6 and dry["bytes"] == (
        dry["dram_chunks"] + dry["disk_chunks"]) * CHUNK_BYTES
    assert store.lookup(old).count == 6  # a dry run touches nothing

    done = store.admin.purge([OLD.digest()])
    assert done["removed"] >= 6 and done["chunks"] == 6
    assert all(store.lookup([key]).count == 0 for key in old)
    assert store.lookup(new).count == 2 and store.lookup(other).count == 2
    assert store.lookup(unnamed).count == 1
    store.close()
    reopened = store_factory(tiers(disk_dir), background=False)  # the disk headers were zeroed
    assert all(reopened.lookup([key]).count == 0 for key in old)
    assert reopened.lookup(other).count == 2
    assert reopened.admin.purge([OLD.digest()], dry_run=True)["chunks"] == 0


def test_the_service_lists_announced_namespaces_and_purges_by_model_and_generation(disk_dir, tmp_path):
    raw = {**tiers(disk_dir), **service_config(tmp_path, io={"timeout_s": 5}, socket="run/kvstore.sock")}
    config_file = tmp_path / "kvstore.json"
    config_file.write_text(json.dumps(raw))
    config = load_config(raw)

    def purge(*args: str) -> subprocess.CompletedProcess:
        command = [sys.executable, "-m", "kvstore.cli", "purge", "--config", str(config_file), *args]
        return subprocess.run(command, capture_output=True, text=True, timeout=60)

    client = StoreClient(config, CHUNK_BYTES)
    try:
        stored = {}
        for number, namespace in enumerate((OLD, NEW, OTHER)):
            keys = chunk_keys(range(number * 100, number * 100 + 48), namespace)
            for slot, payload in enumerate(make_payloads(3, seed=number)):
                client.memory.slot(slot)[:] = payload.tobytes()
            assert client.put(keys, [0, 1, 2], namespace=namespace.digest()) == [True] * 3
            stored[namespace] = keys
        client.announce([(ns.digest(), ns.description()) for ns in (OLD, NEW, OTHER)])
        listing = purge("--list")
        assert listing.returncode == 0, listing.stderr
        assert "llama  weights xxh3:aa  generation base: 1 namespaces" in listing.stdout
        assert "llama  weights xxh3:aa  generation 9f01: 1 namespaces" in listing.stdout

        dry = purge("--model", "llama", "--generation", "base", "--dry-run", "--json")
        assert json.loads(dry.stdout)["chunks"] == 3 and json.loads(dry.stdout)["removed"] == 0
        assert client.residency(stored[OLD])[0] == 3
        done = purge("--model", "llama", "--generation", "base")
        assert done.returncode == 0 and "removed 3 chunks" in done.stdout, done.stderr
        assert client.residency(stored[OLD])[0] == 0
        assert client.residency(stored[NEW])[0] == 3 and client.residency(stored[OTHER])[0] == 3
        assert purge("--model", "mistral").returncode == 1  # nothing announced by that name
        assert purge("--namespace", "beef").returncode == 2  # not a digest
        by_digest = purge("--namespace", OTHER.digest().hex(), "--json")
        assert json.loads(by_digest.stdout)["removed"] == 3
    finally:
        client.close()
        stop_service(config)
    book = NamespaceBook(raw["service"]["socket"] + ".namespaces")  # kept across a restart
    assert {entry["namespace"] for entry in listed(book)} == {ns.digest().hex() for ns in (OLD, NEW, OTHER)}


def test_a_purge_before_any_engine_connects_is_run_when_the_store_opens(disk_dir, tmp_path):
    """The store opens at the first engine's hello (it sets the chunk size): a purge before
    that, after a restart, found nothing and its records were served again. It now waits,
    in the service's private directory, and runs before the first engine is answered."""
    raw = {**tiers(disk_dir), **service_config(tmp_path, io={"timeout_s": 5}, socket="run/kvstore.sock")}
    config_file = tmp_path / "kvstore.json"
    config_file.write_text(json.dumps(raw))
    config = load_config(raw)
    pending = raw["service"]["socket"] + ".purges"
    stored = {}
    client = StoreClient(config, CHUNK_BYTES)
    try:
        for number, namespace in enumerate((OLD, OTHER)):
            keys = chunk_keys(range(number * 100, number * 100 + 48), namespace)
            for slot, payload in enumerate(make_payloads(3, seed=number)):
                client.memory.slot(slot)[:] = payload.tobytes()
            assert client.put(keys, [0, 1, 2], namespace=namespace.digest()) == [True] * 3
            stored[namespace] = keys
    finally:
        client.close()
        stop_service(config)
    command = [sys.executable, "-m", "kvstore.cli", "purge", "--config", str(config_file),
               "--namespace", OLD.digest().hex()]
    with serving(config_file, tmp_path / "serve.log"):  # restarted as a daemon: no engine yet
        done = subprocess.run(command, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0 and "removed 0 chunks" in done.stdout, done.stdout + done.stderr
        assert "1 namespaces stay pending" in done.stdout and os.path.exists(pending)
        client = StoreClient(config, CHUNK_BYTES)  # the first engine: the store opens
        try:
            assert client.residency(stored[OLD])[0] == 0 and client.residency(stored[OTHER])[0] == 3
        finally:
            client.close()
            stop_service(config)
    assert not os.path.exists(pending)


HEX = st.text(alphabet="0123456789abcdef", max_size=40)


@settings(max_examples=150)
@given(st.one_of(st.binary(max_size=200), st.lists(st.one_of(HEX, st.integers(), st.none()), max_size=5)
                 .map(lambda rows: json.dumps(rows).encode())))
def test_a_pending_purges_file_whatever_it_holds_never_stops_the_service(tmp_path_factory, raw):
    """The file is the service's own, in its private directory; one it cannot read (damaged,
    another version's, a digest of the wrong size) is set aside and counted, never raised."""
    folder = tmp_path_factory.mktemp("purges")
    socket = str(folder / "kvstore.sock")
    (folder / "kvstore.sock.purges").write_bytes(raw)
    os.chmod(folder / "kvstore.sock.purges", 0o600)
    counters: dict = {}
    purges = PendingPurges(socket, MalformedCounts(logging.getLogger("test"), counters))
    report = purges.purge(None, [bytes(16)], dry_run=True)  # how many would wait
    if counters.get("malformed.state_file"):
        assert os.path.exists(socket + ".purges.bad") and report["pending"] == 1
    else:  # nothing, or digests of 16 bytes
        assert not raw or all(len(row) == 32 for row in json.loads(raw))


def test_a_pending_purges_file_that_is_a_link_is_not_followed(tmp_path):
    target = tmp_path / "elsewhere"
    target.write_text(json.dumps([OTHER.digest().hex()]))
    os.symlink(target, tmp_path / "kvstore.sock.purges")
    counters: dict = {}
    socket = str(tmp_path / "kvstore.sock")
    purges = PendingPurges(socket, MalformedCounts(logging.getLogger("test"), counters))
    assert counters["malformed.state_file"] == 1 and purges.purge(None, [], dry_run=True)["pending"] == 0
    assert target.read_text() == json.dumps([OTHER.digest().hex()])  # the link moved aside, not its target


def test_a_described_namespace_shows_no_salt():
    salted = KVNamespace("llama", "float16", "cpu", 16, salt="sql@xxh3:00|tenant-42")
    description = salted.description()
    assert "tenant-42" not in json.dumps(description) and len(str(description["salt"])) == 16
    assert KVNamespace("llama", "float16", "cpu", 16).description()["salt"] == ""


@given(st.one_of(st.binary(max_size=20), st.none()),
       st.one_of(st.dictionaries(st.text(max_size=40), st.one_of(st.text(max_size=600), st.integers(),
                                                                  st.booleans(), st.none(), st.floats()),
                                 max_size=20),
                 st.integers(), st.text()))
def test_an_announcement_is_kept_whole_or_refused(digest, description):
    book = NamespaceBook(None)
    try:
        book.announce(1000, [(digest, description)])  # type: ignore[list-item]
    except KVStoreError:
        assert listed(book) == []
        return
    (entry,) = listed(book)
    assert entry["description"] == description and entry["uid"] == 1000


def test_a_digest_keeps_its_first_description(tmp_path):
    book = NamespaceBook(str(tmp_path / "book"))
    book.announce(0, [(OLD.digest(), OLD.description())])
    book.announce(1000, [(OLD.digest(), OTHER.description())])  # relabelling: ignored
    (entry,) = listed(book)
    assert entry["description"] == OLD.description() and entry["uid"] == 0
    book.close()
    assert os.stat(tmp_path / "book").st_mode & 0o777 == 0o600
    assert listed(NamespaceBook(str(tmp_path / "book")))[0]["description"] == OLD.description()


@pytest.mark.parametrize("garbage", [b"", b"{", b"[{\"namespace\": 1}]", b"\xff\xfe"])
def test_a_damaged_book_is_an_empty_one(tmp_path, garbage):
    (tmp_path / "book").write_bytes(garbage)
    assert listed(NamespaceBook(str(tmp_path / "book"))) == []
