"""The producer's lease table: each hold ends exactly once, by pull, free or expiry."""

from __future__ import annotations

import pytest
from kvferry.kvtransfer.lease import LeaseTable
from kvferry.kvtransfer.metrics import HoldEnd, KVTransferMetrics


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def make_table(lease_s: float = 30.0) -> tuple[LeaseTable, FakeClock, KVTransferMetrics]:
    clock, metrics = FakeClock(), KVTransferMetrics()
    return LeaseTable(lease_s, metrics, clock), clock, metrics


def test_a_hold_expires_after_the_lease() -> None:
    table, clock, metrics = make_table()
    table.hold("a", ((1, 2, 3),))
    assert table.num_blocks_held == 3 and metrics.snapshot().blocks_held == 3
    clock.now += 29.9
    assert table.expire() == []
    clock.now += 0.1
    assert table.expire() == ["a"]
    assert table.drain_ended() == ["a"]
    assert table.drain_ended() == []
    stats = metrics.snapshot()
    assert (stats.blocks_held, stats.lease_expirations) == (0, 1)


def test_renewing_extends_a_hold_by_a_full_lease() -> None:
    table, clock, _ = make_table()
    table.hold("a", ((1,),))
    clock.now += 20
    assert table.renew(["a", "unknown"], reader="decode-1") == [True, False]
    clock.now += 29
    assert table.expire() == []
    clock.now += 1
    assert table.expire() == ["a"]


def test_the_first_reader_to_renew_claims_the_hold() -> None:
    table, clock, metrics = make_table()
    table.hold("a", ((1, 2),))
    assert table.renew(["a"], reader="decode-1") == [True]
    # A second decode pod (a retried hop) is refused and cannot end the first one's hold.
    assert table.renew(["a"], reader="decode-2") == [False]
    assert not table.end("a", HoldEnd.FREED, reader="decode-2")
    assert not table.end("a", HoldEnd.PULLED, reader="decode-2")
    assert table.is_held("a") and table.num_blocks_held == 2
    # Its refused renewals did not extend the lease either.
    clock.now += 25
    assert table.renew(["a"], reader="decode-2") == [False]
    clock.now += 5
    assert table.expire() == ["a"]
    assert metrics.snapshot().lease_expirations == 1


def test_the_reader_ends_its_hold_and_an_unclaimed_hold_is_anyones() -> None:
    table, _, metrics = make_table()
    table.hold("a", ((1,),))
    table.hold("b", ((2,),))
    assert table.renew(["a"], reader="decode-1") == [True]
    assert table.end("a", HoldEnd.PULLED, reader="decode-1")
    assert table.end("b", HoldEnd.FREED, reader="decode-2")
    stats = metrics.snapshot()
    assert (stats.sends_pulled, stats.sends_freed, stats.blocks_held) == (1, 1, 0)


def test_a_caller_that_names_no_reader_can_neither_renew_nor_end_a_hold() -> None:
    table, clock, metrics = make_table()
    table.hold("unclaimed", ((1,),))
    table.hold("claimed", ((2,),))
    assert table.renew(["claimed"], reader="decode-1") == [True]
    # "" renews nothing: it neither claims the unclaimed hold nor extends a claimed one.
    assert table.renew(["unclaimed", "claimed"], reader="") == [False, False]
    assert table.claim(["unclaimed"], reader="") == [None]
    assert not table.end("unclaimed", HoldEnd.FREED, reader="")
    assert not table.end("claimed", HoldEnd.FREED, reader="")
    assert table.readers() == {"claimed": "decode-1"}
    # Nor does it keep them alive: both run out a lease after they started.
    clock.now += 30
    assert sorted(table.expire()) == ["claimed", "unclaimed"]
    stats = metrics.snapshot()
    assert (stats.sends_freed, stats.lease_expirations) == (0, 2)


def test_a_hold_ends_once_whichever_way_comes_first() -> None:
    table, clock, metrics = make_table()
    table.hold("a", ((1, 2), (7,)))
    assert table.end("a", HoldEnd.PULLED, reader="decode-1")
    assert not table.end("a", HoldEnd.FREED, reader="decode-1")
    clock.now += 60
    assert table.expire() == []
    assert table.drain_ended() == ["a"]
    stats = metrics.snapshot()
    assert (stats.sends_pulled, stats.sends_freed, stats.lease_expirations) == (1, 0, 0)
    assert stats.blocks_held == 0


def test_a_request_cannot_hold_twice() -> None:
    table, _, _ = make_table()
    table.hold("a", ((1,),))
    with pytest.raises(RuntimeError, match="already holds"):
        table.hold("a", ((2,),))


def test_a_hold_its_reader_pulled_is_remembered_as_pulled_by_it_for_a_lease() -> None:
    table, clock, _ = make_table()
    for req_id in ("pulled", "freed", "expiring"):
        table.hold(req_id, ((1,),))
        assert table.renew([req_id], reader="decode-1") == [True]
    assert table.end("pulled", HoldEnd.PULLED, reader="decode-1")
    assert table.end("freed", HoldEnd.FREED, reader="decode-1")
    clock.now += 29
    assert table.renew(["expiring"], reader="decode-1") == [True]
    # A heartbeat that crossed the read's notification: not held, but pulled by its reader.
    names = ["pulled", "freed", "expiring", "unknown"]
    assert table.renew(names, reader="decode-1") == [False, False, True, False]
    assert table.pulled_by(names, reader="decode-1") == [True, False, False, False]
    assert table.pulled_by(["pulled"], reader="decode-2") == [False]
    assert table.pulled_by(["pulled"], reader="") == [False]
    clock.now += 30  # a lease after the pull: forgotten; the other hold expired unpulled
    assert table.expire() == ["expiring"]
    assert table.pulled_by(names, reader="decode-1") == [False] * 4


def test_the_remembered_pulls_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvferry.kvtransfer import lease

    monkeypatch.setattr(lease, "MAX_REMEMBERED_PULLS", 3)
    table, _, _ = make_table()
    for i in range(5):
        table.hold(f"r{i}", ((1,),))
        assert table.end(f"r{i}", HoldEnd.PULLED, reader="decode-1")
    assert table.pulled_by([f"r{i}" for i in range(5)], reader="decode-1") == [
        False, False, True, True, True]
