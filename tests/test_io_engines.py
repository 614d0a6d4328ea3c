"""Both I/O engines against a real O_DIRECT file: scatter/gather, queue refills, per-request errors,
a read batch out a quarter at a time, a device that never answers holds back only its own, and a
read that outlives its caller's deadline keeps its memory until it lands (io/base.py)."""

from __future__ import annotations

import errno
import os

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvstore.format.record import BLOCK
from kvstore.io import IoRequest, make_engine
from kvstore.io.aligned import AlignedBuffer
from kvstore.io.base import TIMED_OUT, Gate, IoBuffer
from kvstore.io.faulty import Fault
from kvstore.io.regions import address_of
from kvstore.io.staging import StagingPool

PIECES = 3  # buffers per request: one readv/writev fills several places
REQUESTS = 40  # five times the queue depth, so the ring's head and tail wrap repeatedly


@pytest.fixture
def direct_file(disk_dir):
    fd = os.open(os.path.join(disk_dir, "data"), os.O_RDWR | os.O_CREAT | os.O_DIRECT)
    yield fd
    os.close(fd)


def _views(buffer: AlignedBuffer, request: int) -> list[memoryview]:
    start = request * PIECES * BLOCK
    return [buffer.view[start + piece * BLOCK:start + (piece + 1) * BLOCK] for piece in range(PIECES)]


def _memory(buffer: AlignedBuffer, request: int) -> list[IoBuffer]:
    return [IoBuffer(_views(buffer, request))]


@pytest.mark.parametrize("engine_name", ["uring", "threads"])
def test_scattered_writes_read_back_through_a_refilled_queue(direct_file, engine_name):
    engine = make_engine(engine_name, 8)
    source, target = AlignedBuffer(REQUESTS * PIECES * BLOCK), AlignedBuffer(REQUESTS * PIECES * BLOCK)
    source.view[:] = os.urandom(len(source.view))
    extent = PIECES * BLOCK
    writes = [IoRequest(direct_file, i * extent, _memory(source, i), write=True) for i in range(REQUESTS)]
    assert engine.run(writes, timeout_s=30) == [extent] * REQUESTS
    finished = []
    # Read in reverse file order so each buffer's position differs from its offset's.
    reads = [IoRequest(direct_file, (REQUESTS - 1 - i) * extent, _memory(target, i)) for i in range(REQUESTS)]
    results = engine.run(reads, timeout_s=30, on_complete=lambda i, r: finished.append((i, r)))
    assert results == [extent] * REQUESTS
    assert sorted(finished) == [(i, extent) for i in range(REQUESTS)]
    for i in range(REQUESTS):
        assert bytes(_views(target, i)[0]) == bytes(_views(source, REQUESTS - 1 - i)[0])
        assert bytes(_views(target, i)[-1]) == bytes(_views(source, REQUESTS - 1 - i)[-1])
    engine.close()


@pytest.mark.parametrize("engine_name", ["uring", "threads"])
def test_a_failed_request_costs_only_itself(direct_file, engine_name):
    engine = make_engine(engine_name, 4)
    buffer = AlignedBuffer(4 * BLOCK)
    closed = os.open(os.devnull, os.O_RDONLY)
    os.close(closed)
    unaligned = buffer.view[1:BLOCK + 1]  # O_DIRECT refuses a misaligned buffer
    first = IoBuffer([buffer.view[:BLOCK]])
    assert engine.run([IoRequest(direct_file, 0, [first], write=True)], 30) == [BLOCK]
    requests = [IoRequest(fd, 0, [IoBuffer([view])]) for fd, view in
                [(direct_file, buffer.view[:BLOCK]), (closed, buffer.view[BLOCK:2 * BLOCK]),
                 (direct_file, unaligned), (direct_file, buffer.view[3 * BLOCK:])]]
    assert engine.run(requests, timeout_s=30) == [BLOCK, -errno.EBADF, -errno.EINVAL, BLOCK]
    engine.close()


def _read_bytes() -> int:
    """Bytes this process has asked its block devices for (every thread's)."""
    with open("/proc/self/io") as io:
        return next(int(line.split()[1]) for line in io if line.startswith("read_bytes:"))


@pytest.mark.parametrize("engine_name", ["uring", "threads"])
def test_a_read_batch_goes_out_a_quarter_at_a_time(direct_file, engine_name):
    """So the checks on the first reads run while later ones are read: a device may
    complete everything in flight at once (the virtual disk this was measured on does)."""
    count, extent = 64, 16 * BLOCK
    engine, shallow = make_engine(engine_name, count), make_engine(engine_name, 4)
    buffer = AlignedBuffer(count * extent)
    try:
        checks = lambda i, r: None  # noqa: E731 (completion work: a checksum, in the tiers)
        assert engine.in_flight(count, checks) == count // 4 and engine.in_flight(8, checks) == 8
        assert engine.in_flight(count, None) == count  # no completion work: nothing to overlap
        assert shallow.in_flight(count, checks) == 4  # never past queue_depth
        buffer.view[:] = os.urandom(len(buffer.view))
        views = [IoBuffer([buffer.view[i * extent:(i + 1) * extent]]) for i in range(count)]
        writes = [IoRequest(direct_file, i * extent, [views[i]], write=True) for i in range(count)]
        assert engine.run(writes, 30) == [extent] * count
        asked: list[int] = []
        before = _read_bytes()
        results = engine.run([IoRequest(direct_file, i * extent, [views[i]]) for i in range(count)], 30,
                             lambda i, r: asked.append(_read_bytes() - before))
        assert results == [extent] * count
        if asked[-1] < count * extent:
            pytest.skip("this filesystem does not count direct reads in /proc/self/io")
        assert asked[0] <= count // 2 * extent, asked[:4]  # a quarter out, a quarter more refilled at most
    finally:
        engine.close()
        shallow.close()
        views = []
        buffer.close()


def test_a_device_that_never_answers_holds_back_only_its_own_requests():
    """The disk tier stripes a batch across devices: each file has its own bound."""
    requests = [IoRequest(fd, 0, []) for fd in (3, 4) * 40]  # 40 each, interleaved
    gate = Gate(requests, lambda count: count // 4)  # 10 each
    taken = []
    while (index := gate.take()) is not None:
        taken.append(index)
    assert sorted(requests[i].fd for i in taken) == [3] * 10 + [4] * 10
    for index in [i for i in taken if requests[i].fd == 4]:  # fd 3's never finish
        gate.finished(index)
    while (index := gate.take()) is not None:
        taken.append(index)
        if requests[index].fd == 4:
            gate.finished(index)
    assert sum(requests[i].fd == 4 for i in taken) == 40 and sum(requests[i].fd == 3 for i in taken) == 10
    assert len(set(taken)) == len(taken)  # each taken once


@pytest.mark.parametrize("engine_name", ["uring", "threads"])
def test_files_sharing_one_queue_each_get_an_even_part_of_it(engine_name):
    """A ring is one queue for every file: a file whose requests never return may hold
    only its part of it, so the other files' requests still go out (writes: no quarter)."""
    engine = make_engine(engine_name, 8)
    try:
        requests = [IoRequest(fd, 0, [], write=True) for fd in (3, 4) * 40]
        gate = engine.gate(requests, None)
        taken = []
        while (index := gate.take()) is not None:
            taken.append(index)
        per_file = 4 if engine.one_queue else 8  # a ring of 8 shared, or a pool of 8 per file
        assert sorted(requests[i].fd for i in taken) == [3] * per_file + [4] * per_file
    finally:
        engine.close()


def _late_read(faulty, fd: int, memory: IoBuffer) -> Fault:
    """A read of block 0 into `memory` that the engine carries out only after its caller's
    deadline (at `land`), which its caller gives up on and closes `memory` after."""
    late = faulty.add(Fault("late", remaining=1))
    assert faulty.run([IoRequest(fd, 0, [memory])], timeout_s=0.1) == [TIMED_OUT]
    memory.close()
    return late


def test_a_late_read_owns_its_buffer_until_it_lands(direct_file, faulty):
    """Its caller closed the buffer at the deadline: it goes back (`give_back`) only once the
    real engine has read into it, never while the read may still write it."""
    data = AlignedBuffer(BLOCK)
    data.view[:] = os.urandom(BLOCK)
    assert faulty.run([IoRequest(direct_file, 0, [IoBuffer([data.view])], write=True)], 30) == [BLOCK]
    target, back = AlignedBuffer(BLOCK), []
    memory = IoBuffer([target.view], back.append)
    late = _late_read(faulty, direct_file, memory)
    assert back == [] and memory.late  # still the read's
    assert bytes(target.view) == bytes(BLOCK)
    late.land()
    assert late.wait_landed(10)
    assert back == [memory]
    assert bytes(target.view) == bytes(data.view)  # it did land, after its caller left


def test_a_staging_buffer_a_late_read_holds_is_not_handed_out_until_it_lands(direct_file, faulty):
    """The pool grows while a late read holds its buffer, and shrinks back once it lands."""
    pool = StagingPool(BLOCK, 1)
    try:
        first = pool.acquire()
        where = address_of(first.views[0])
        late = _late_read(faulty, direct_file, first)
        other = pool.acquire()
        assert address_of(other.views[0]) != where  # the pool grew instead
        assert pool.mapped_bytes == 2 * BLOCK
        other.close()
        assert pool.mapped_bytes == 2 * BLOCK  # free, and the only one free: kept
        late.land()
        assert late.wait_landed(10)
        assert pool.mapped_bytes == BLOCK  # two free past a pool of one: the grown one unmapped
        assert address_of(pool.acquire().views[0]) == where
    finally:
        pool.close()


@given(count=st.integers(1, 4), moves=st.lists(st.integers(-1, 7), max_size=40))
def test_a_staging_pool_maps_at_most_its_count_past_the_buffers_lent(count, moves):
    """Whatever the order buffers are taken and given back in: at most `count` buffers
    are mapped beyond those lent, and all but the base map go once every one is back."""
    pool = StagingPool(BLOCK, count)
    lent: list[IoBuffer] = []
    try:
        for move in moves:
            if move < 0 or not lent:
                lent.append(pool.acquire())
            else:
                lent.pop(move % len(lent)).close()
            assert pool.mapped_bytes <= (len(lent) + count) * BLOCK
        for buffer in lent:
            buffer.close()
        assert pool.mapped_bytes == count * BLOCK
    finally:
        pool.close()
