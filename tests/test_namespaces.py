"""The announced namespaces stay bounded, listable and purgeable whoever floods them.

Each distinct cache salt of an HTTP request makes a vLLM engine announce new namespaces,
and an allowed user may announce what it likes. Replayed here: tens of thousands
announced to a real service, then `kvstore purge --list` (a page at a time), across a
restart; an allowed uid held to its share of the book (its uid given to the book's
`handle`, as the service gives the peer's); the room made by dropping only namespaces
that hold no records (a real store's records, puts under way); an engine that forgets
salts it has not used lately; and a reply over the frame limit answered as an error on a
connection that goes on serving. (The purge itself: tests/test_purge.py.)"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import socket
import subprocess
import sys
import tracemalloc

from hypothesis import given, settings
from hypothesis import strategies as st
from support.services import service_config, stop_service, write_config
from support.stores import CHUNK_BYTES, make_keys, make_payloads

from engine_plugin.vllm.namespaces import MAX_SALTS, EngineNamespaces
from kvstore.config.store import load_config
from kvstore.format.keys import KVNamespace, Weights
from kvstore.format.malformed import MalformedCounts
from kvstore.format.record import record_bytes
from kvstore.service import namespaces as N
from kvstore.service import protocol as P
from kvstore.service.client import StoreClient
from kvstore.service.counters import ClientCounters
from kvstore.service.namespaces import NamespaceBook
from kvstore.service.server import send_reply

MODEL = KVNamespace("meta-llama/Llama-3.1-8B-Instruct", "bfloat16",
                    "cpu/kv:auto/FullAttentionSpec:L32:b16:h8:d128", 16,
                    weights=Weights("xxh3:0123456789abcdef"))
OWNER = os.geteuid()
OTHER_UID = OWNER + 1000


def salted(count: int, start: int = 0, model: KVNamespace = MODEL) -> list[tuple[bytes, dict]]:
    """(digest, description) of `count` namespaces of one model, one per cache salt."""
    made = [dataclasses.replace(model, salt=f"user-{i}") for i in range(start, start + count)]
    return [(ns.digest(), ns.description()) for ns in made]


def digests(count: int, start: int = 0) -> list[tuple[bytes, dict]]:
    """`count` made-up namespaces with a small description (fast to announce)."""
    return [(i.to_bytes(16, "big"), {"model": "m"}) for i in range(start, start + count)]


def announce(book: NamespaceBook, uid: int, namespaces: list[tuple[bytes, dict]]) -> None:
    """As the service does for a client of `uid`: announcements of at most MAX_ANNOUNCED."""
    for first in range(0, len(namespaces), P.MAX_ANNOUNCED):
        book.handle(uid, P.Announce(namespaces[first : first + P.MAX_ANNOUNCED]))


def walk(book: NamespaceBook, limit: int = P.MAX_PAGE) -> list[list[dict]]:
    """Every page of the book, `limit` at most each, as the owner asks for them (each after
    the last one's last digest, until an empty one)."""
    pages = [book.handle(OWNER, P.Namespaces(None, limit))]
    while pages[-1]:
        after = bytes.fromhex(pages[-1][-1]["namespace"])
        pages.append(book.handle(OWNER, P.Namespaces(after, limit)))
    return pages[:-1]


def kept(book: NamespaceBook) -> list[dict]:
    return [entry for page in walk(book) for entry in page]


# -- listing a page at a time ---------------------------------------------------------------


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2500), st.integers(1, P.MAX_PAGE), st.integers(1, P.MAX_TEXT), st.randoms())
def test_the_pager_returns_every_namespace_once(size, limit, text, random):
    """Whatever the book's size, the page bound and the descriptions' size (a page also
    stops at about PAGE_BYTES), every namespace comes exactly once, in digest order."""
    book = NamespaceBook(None)
    made = [(random.randbytes(16), {"model": "m" * text, "salt": str(i)}) for i in range(size)]
    announce(book, OWNER, made)
    pages = walk(book, limit)
    listed = [entry["namespace"] for page in pages for entry in page]
    assert listed == sorted({digest.hex() for digest, _ in made})
    assert all(0 < len(page) <= limit for page in pages)
    assert all(sum(len(json.dumps(e["description"])) for e in page[:-1]) < P.PAGE_BYTES for page in pages)


def test_tens_of_thousands_of_namespaces_are_listed_a_page_at_a_time(tmp_path, disk_dir):
    """20,000 salts' namespaces (over 4 MiB of descriptions): `kvstore purge --list` lists
    them all, and `--model` purges them, before and after a restart."""
    slot = record_bytes(CHUNK_BYTES)
    raw = service_config(tmp_path, dram=4 * slot, disk_dir=disk_dir, disk=16 * slot, io={"timeout_s": 5},
                         socket="run/kvstore.sock")
    config_file = write_config(tmp_path / "kvstore.json", raw)
    made = salted(20_000)

    def purge(*args: str) -> subprocess.CompletedProcess:
        command = [sys.executable, "-m", "kvstore.cli", "purge", "--config", str(config_file), *args]
        return subprocess.run(command, capture_output=True, text=True, timeout=120)

    client = StoreClient(load_config(raw), CHUNK_BYTES)
    try:
        for first in range(0, len(made), P.MAX_ANNOUNCED):
            client.announce(made[first : first + P.MAX_ANNOUNCED])
        assert len(client.namespaces()) == P.MAX_PAGE  # a page: the rest come after it
        for restarted in (False, True):
            if restarted:
                client.close()
                stop_service(raw)
                client = StoreClient(load_config(raw), CHUNK_BYTES)
            listing = purge("--list", "--json")
            assert listing.returncode == 0, listing.stderr
            listed = sorted(entry["namespace"] for entry in json.loads(listing.stdout))
            assert listed == sorted(digest.hex() for digest, _ in made)
            grouped = purge("--list")
            assert f"{MODEL.model}  weights xxh3:0123456789abcdef  generation base: 20000 namespaces" \
                in grouped.stdout, grouped.stderr
        dry = purge("--model", MODEL.model, "--dry-run", "--json")
        assert dry.returncode == 0 and json.loads(dry.stdout)["namespaces"] == 20_000, dry.stderr
    finally:
        client.close()
        stop_service(raw)


# -- bounds: each uid's share, the book's, and the room made --------------------------------


def test_an_allowed_uid_is_held_to_its_share_and_the_owner_keeps_room():
    book = NamespaceBook(None)
    share = N.MAX_NAMESPACES // N.SHARE
    announce(book, OTHER_UID, digests(share + 1000))
    assert book.counters()["namespaces.refused"] == 1000
    announce(book, OWNER, digests(2000, start=1 << 40))  # the owner's own still fit
    uids = [entry["uid"] for entry in kept(book)]
    assert uids.count(OTHER_UID) == share and uids.count(OWNER) == 2000
    assert book.counters()["namespaces.refused"] == 1000


def test_a_uid_is_held_to_its_share_of_bytes_too():
    book = NamespaceBook(None)
    large = {f"f{chr(97 + i)}": "x" * P.MAX_TEXT for i in range(P.MAX_FIELDS)}  # ~8.5 KiB each
    count = 2 * (N.MAX_BYTES // N.SHARE) // len(json.dumps(large))
    announce(book, OTHER_UID, [(i.to_bytes(16, "big"), large) for i in range(count)])
    held = len(kept(book))
    assert 0 < held <= (N.MAX_BYTES // N.SHARE) // len(json.dumps(large, separators=(",", ":")))
    assert book.counters()["namespaces.refused"] == count - held


def test_room_is_made_only_of_namespaces_without_records(store_factory, disk_dir):
    """A full book, its oldest namespaces with records in a real store (DRAM and disk):
    what no longer fits is refused, then the book's upkeep drops the least recently
    announced without records, down to ROOMY, and never one that holds records."""
    slot = record_bytes(CHUNK_BYTES)
    store = store_factory({"tiers": {"dram": {"capacity": 4 * slot},
                                     "disk": [{"path": f"{disk_dir}/disk", "capacity": 16 * slot}]}},
                          background=False)
    book = NamespaceBook(None, held=store.probe.namespaces)
    oldest = digests(8)
    for i, (digest, _) in enumerate(oldest):  # 8 records: more than DRAM holds
        assert store.put_many(make_keys(1, seed=i), make_payloads(1, seed=i), namespace=digest) == [True]
    announce(book, OWNER, oldest + digests(N.MAX_NAMESPACES, start=100))
    assert book.counters()["namespaces.refused"] == 8
    book.tend()
    left = {entry["namespace"] for entry in kept(book)}
    assert {digest.hex() for digest, _ in oldest} <= left
    assert len(left) == int(N.ROOMY * N.MAX_NAMESPACES)
    assert book.counters()["namespaces.dropped"] == N.MAX_NAMESPACES - len(left)


def test_a_namespace_put_under_while_the_records_are_scanned_is_kept():
    """The scan does not see records published after it passed their table: a put under
    way when it began, or begun while it runs, keeps its namespace; and when the scan
    cannot say (a disk header unread), nothing is dropped."""
    book: NamespaceBook

    def scan_during_a_put() -> set[bytes]:
        with book.storing(b"\2" * 16):  # begun after the scan began
            pass
        return set()

    book = NamespaceBook(None, held=scan_during_a_put)
    early, during = [(b"\1" * 16, {"model": "m"})], [(b"\2" * 16, {"model": "m"})]
    announce(book, OWNER, early + during + digests(N.MAX_NAMESPACES, start=100))
    with book.storing(b"\1" * 16):  # under way when the scan begins
        book.tend()
    left = {entry["namespace"] for entry in kept(book)}
    assert {(b"\1" * 16).hex(), (b"\2" * 16).hex()} <= left and len(left) < N.MAX_NAMESPACES
    unknown = NamespaceBook(None, held=lambda: None)
    announce(unknown, OWNER, digests(N.MAX_NAMESPACES))
    unknown.tend()
    assert "namespaces.dropped" not in unknown.counters()


def test_the_file_is_written_off_the_request_path_and_only_after_a_change(tmp_path):
    path = tmp_path / "book"
    book = NamespaceBook(str(path))
    announce(book, OWNER, digests(10))
    assert not path.exists()  # an announcement never waits for a write
    book.tend()
    written = path.stat()
    announce(book, OWNER, digests(10))  # announced again: nothing new to write
    book.tend()
    book.close()
    assert path.stat().st_mtime_ns == written.st_mtime_ns and path.stat().st_ino == written.st_ino
    assert len(kept(NamespaceBook(str(path)))) == 10


# -- the engine ------------------------------------------------------------------------------


def test_an_engine_keeps_the_namespaces_of_recent_salts_only():
    """An HTTP user sending a new cache salt with every request costs the engine a bounded
    memory; a salt used again after it was forgotten is announced again."""
    engine = EngineNamespaces(MODEL, ["full", "sliding"], 2)
    tracemalloc.start()
    before = tracemalloc.take_snapshot()
    for i in range(20 * MAX_SALTS):
        engine(f"user-{i}")
    grown = sum(stat.size_diff for stat in tracemalloc.take_snapshot().compare_to(before, "filename"))
    tracemalloc.stop()
    assert grown < 8 * 1024 * MAX_SALTS  # 2 MiB here (four namespaces a salt); 30 MiB without a bound
    pending = engine.unannounced(1 << 30)
    assert len(pending) == 4 * MAX_SALTS and len(engine.unannounced(P.MAX_ANNOUNCED)) == P.MAX_ANNOUNCED
    engine.announced(pending)
    assert engine.unannounced(1) == []
    assert engine("user-0") == engine("user-0") and len(engine.unannounced(10)) == 4  # forgotten: again


# -- a reply too large to send -------------------------------------------------------------


def test_new_client_counters_past_the_bound_are_dropped_and_info_stays_small(tmp_path):
    """A client adding counters of every name its pattern allows (110,000 of them made Info's
    reply pass the frame limit): past ClientCounters.MAX_NAMES names the new ones are
    dropped and counted, the known ones still add up, and Info answers."""
    raw = service_config(tmp_path, dram=4 * record_bytes(CHUNK_BYTES), socket="run/kvstore.sock")
    client = StoreClient(load_config(raw), CHUNK_BYTES)
    try:
        for first in range(0, 110_000, 256):
            client.count({f"prefetch.{_letters(n)}": 1.0 for n in range(first, first + 256)})
        client.count({f"prefetch.{_letters(0)}": 1.0})
        counters = client.info()["counters"]
        added = {name for name in counters if name.startswith("prefetch.") and len(name) == 41}
        assert len(added) == ClientCounters.MAX_NAMES and counters[f"prefetch.{_letters(0)}"] == 2.0
        assert counters["malformed.counter"] > 0
    finally:
        client.close()
        stop_service(raw)


def test_a_co_tenant_cannot_use_up_the_counter_names_before_the_owners_engines_name_theirs():
    """A uid other than the service's own brings in at most a quarter of the names clients
    may add; the owner's engines still find room for theirs."""
    import logging

    from kvstore.format.malformed import MalformedCounts
    from kvstore.store.tiered import TieredStore

    counters = ClientCounters(MalformedCounts(logging.getLogger("test")))
    with TieredStore({"tiers": {"dram": {"capacity": 4 * record_bytes(CHUNK_BYTES)}}}, CHUNK_BYTES) as store:
        names = [f"prefetch.{_letters(n)}" for n in range(ClientCounters.MAX_NAMES)]
        counters.add(store, dict.fromkeys(names, 1.0), uid=os.geteuid() + 1)
        theirs = [name for name in names if name in store.stats.snapshot()]
        assert len(theirs) == ClientCounters.MAX_NAMES // ClientCounters.SHARE
        owners = [f"load.{_letters(n)}" for n in range(100)]
        counters.add(store, dict.fromkeys(owners, 1.0))
        assert all(store.stats.snapshot()[name] == 1.0 for name in owners)


def test_a_reply_over_the_frame_limit_is_an_error_and_the_connection_serves_on():
    """No request's reply can pass the frame limit any more (pages, bounded counters); should
    one, the client hears an error saying why on the same connection, counted, and the
    service's thread goes on: the next reply on it arrives."""
    ours, theirs = socket.socketpair()
    malformed = MalformedCounts(logging.getLogger("test"))
    server, client = P.Channel(ours), P.Channel(theirs)
    try:
        assert send_reply(server, P.Reply(True, b"x" * (P.MAX_FRAME + 1)), (), "Info", malformed)
        refused = client.recv(P.REPLY, 5)
        assert not refused.ok and "the reply to Info was not sent" in refused.error
        assert malformed.snapshot()["malformed.reply"] == 1
        assert send_reply(server, P.Reply(True, [1, 2]), (), "Residency", malformed)
        assert client.recv(P.REPLY, 5).value == [1, 2]
    finally:
        server.close()
        client.close()


def _letters(n: int) -> str:
    """`n` as 32 lowercase letters (a counter name the service accepts)."""
    return "".join(chr(97 + (n >> (4 * i)) % 16) for i in range(32))
