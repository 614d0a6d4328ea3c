"""A slot table's listeners (tiers/slots.py TableLock): told outside the table's lock, in
the table's order, before the call that made the event returns, and never after they
unsubscribe."""

from __future__ import annotations

import threading

from kvstore.tiers.slots import Change, Entry, SlotTable

KEYS = [bytes([i]) * 16 for i in range(64)]


def _publish(table: SlotTable, key: bytes) -> None:
    reservation = table.reserve()
    assert reservation is not None
    with reservation:
        reservation.publish(key, None, 0)


def test_a_listener_runs_outside_the_tables_lock():
    table, reached = SlotTable([4]), []

    def listener(change: Change, entry: Entry) -> None:
        other = threading.Thread(target=lambda: reached.append(len(table.entries())))
        other.start()  # another thread takes the table's lock: it would wait if we held it
        other.join(10)
        assert not other.is_alive()

    table.subscribe(listener)
    _publish(table, KEYS[0])
    assert reached == [1]


def test_events_reach_every_listener_in_the_tables_order_under_contention():
    """Threads publish and unpublish the same keys at once; each listener's log, replayed,
    alternates per key (in, out, in...) and ends where the table ends."""
    table = SlotTable([16])
    logs: list[list[tuple[bool, bytes]]] = [[], []]
    for log in logs:
        table.subscribe(lambda change, entry, log=log: log.append((change is Change.STORED, entry.key)))

    def churn(keys: list[bytes]) -> None:
        for _ in range(200):
            for key in keys:
                if key in table:
                    table.unpublish(key)
                else:
                    _publish(table, key)

    threads = [threading.Thread(target=churn, args=(KEYS[i::4][:4],)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert logs[0] == logs[1] and len(logs[0]) > 1000
    state: dict[bytes, bool] = {}
    for published, key in logs[0]:
        assert state.get(key, False) is not published, key  # never twice in, never out unseen
        state[key] = published
    assert {key for key, held in state.items() if held} == set(table.index)


def test_a_listener_may_call_the_table_and_its_events_follow_in_order():
    table, log = SlotTable([4]), []

    def evict_on_publish(change: Change, entry: Entry) -> None:
        log.append((change, entry.key))
        if change is Change.STORED and entry.key == KEYS[0]:
            table.unpublish(KEYS[0])  # an event made while delivering: queued behind this one

    table.subscribe(evict_on_publish)
    table.subscribe(lambda change, entry: log.append(("second", change, entry.key)))
    _publish(table, KEYS[0])
    assert log == [(Change.STORED, KEYS[0]), ("second", Change.STORED, KEYS[0]),
                   (Change.REMOVED, KEYS[0]), ("second", Change.REMOVED, KEYS[0])]
    assert KEYS[0] not in table


def test_first_subscribes_ahead_and_unsubscribed_listeners_hear_nothing_more():
    table, log = SlotTable([4]), []

    def later(change: Change, entry: Entry) -> None:
        log.append("later")

    table.subscribe(later)
    table.subscribe(lambda change, entry: log.append("first"), first=True)
    _publish(table, KEYS[0])
    assert log == ["first", "later"]
    table.unsubscribe(later)
    _publish(table, KEYS[1])
    assert log == ["first", "later", "first"]
