"""Every rule of a sync round (``core.rounds.RoundBook``), without Ray or asyncio: who a round
waits for, when it closes, quorum, rejection, late and duplicate messages, timeouts, what each
replica is answered (update, nothing, resync), what is kept and for how long, and the events."""

from __future__ import annotations

import math

import pytest

from ray_diloco.core.rounds import RoundBook
from ray_diloco.core.wire import DROPPED, FAILED, OK, REJECTED


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def _book(members=None, quorum=1, fragments=2, keep=1) -> tuple[RoundBook, Clock]:
    clock = Clock()
    book = RoundBook({0: 0, 1: 0} if members is None else members, quorum, 30.0, keep, clock=clock)
    book.set_fragments(fragments)
    return book, clock


def _kinds(book: RoundBook) -> list[tuple]:
    return [(e["event"], e["replica"]) for e in book.take_events()]


def _step(book: RoundBook, f: int, s: int, version: int | None = None, message="msg", size=8):
    terms = book.terms(f, s)
    out = book.failed(f, s) if terms is None else book.stepped(f, s, version or book.versions[f] + 1, message, size, 1.5)
    book.finish(f, s, out)
    return terms, out


def test_a_round_closes_once_every_expected_member_arrived_and_steps_in_replica_order():
    book, _ = _book({0: 0, 1: 0, 2: 10})  # replica 2 joined at step 10: not expected at step 5
    assert book.admits(0, 5, 1) and book.expected(5) == {0, 1}
    assert not book.arrive(0, 5, 1, 3.0, 2.0, size=4, parts=["p1"])
    assert book.arrive(0, 5, 0, 1.0, 1.0, size=4, parts=["p0"])  # complete: closed now
    assert book.is_closed(0, 5) and not book.admits(0, 5, 0)
    assert not book.admits(0, 5, 2)  # a member's message for a closed round is late, whenever it joined
    assert book.rounds[(0, 5)].parts == {0: ["p0"], 1: ["p1"]}
    terms, out = _step(book, 0, 5)
    assert terms == [(0, 1.0), (1, 3.0)] and out.included == {0, 1} and book.versions == [1, 0]
    assert book.stats == [{"fragment": 0, "step": 5, "update_norm": 1.5, "delta_norms": {0: 1.0, 1: 2.0},
                           "replicas": [0, 1], "bytes_up": 8, "bytes_down": 16}]
    assert (0, 5) not in book.rounds and book.last_finished == [5, 0]
    # the answers: the update for a receiver at the base version, nothing for a current one, a
    # resync for a stale one; replica 2 (not expected) is answered dropped
    a = book.answer(0, 5, 1, 0)
    assert (a.status, a.version, a.message, a.size, a.resync) == (OK, 1, "msg", 8, False)
    assert (book.answer(0, 5, 1, 1).message, book.answer(0, 5, 1, 1).resync) == (None, False)
    stale = book.answer(0, 5, 2, 7)
    assert (stale.status, stale.version, stale.resync) == (DROPPED, 1, True)
    assert _kinds(book) == [("late", 0), ("late", 2)]  # tries after the round closed


def test_a_rejected_or_abstaining_replica_is_left_out_and_told_so():
    book, _ = _book({0: 0, 1: 0, 2: 0})
    book.arrive(1, 5, 0, 1.0, None)  # a non-finite pseudo-gradient (or an abstention)
    book.arrive(1, 5, 1, math.nan, 1.0)  # a weight that is not finite
    assert book.arrive(1, 5, 2, 2.0, 4.0)
    terms, _ = _step(book, 1, 5)
    assert terms == [(2, 2.0)]
    assert [book.answer(1, 5, m, 0).status for m in (0, 1, 2)] == [REJECTED, REJECTED, OK]
    assert _kinds(book) == [("rejected", 0), ("rejected", 1)]


def test_without_quorum_a_round_fails_and_leaves_the_versions():
    book, _ = _book(quorum=2)
    book.arrive(0, 5, 0, 1.0, 1.0)
    assert book.arrive(0, 5, 1, 1.0, None)
    terms, out = _step(book, 0, 5)
    assert terms is None and out.failed and book.versions == [0, 0] and book.failed_rounds == 1
    assert [book.answer(0, 5, m, 0).status for m in (0, 1)] == [FAILED, REJECTED]
    ev = book.take_events()[-1]
    assert ev["event"] == "round_failed" and (ev["valid"], ev["quorum"], ev["cause"]) == (1, 2, "complete")


def test_a_round_times_out_without_a_silent_member_at_its_deadline():
    book, clock = _book()
    book.arrive(0, 5, 0, 1.0, 1.0)
    assert book.deadline(0, 5, 2.5) == 100.0 + 30.0 + 2.5
    clock.t += 40
    assert book.time_out(0, 5) and not book.time_out(0, 5)  # closed once
    terms, _ = _step(book, 0, 5)
    assert terms == [(0, 1.0)] and book.answer(0, 5, 1, 0).status == DROPPED
    assert _kinds(book) == [("timeout", 1)]


def test_a_dead_member_releases_the_rounds_that_waited_only_for_it():
    book, _ = _book({0: 0, 1: 0, 2: 0})
    book.arrive(0, 5, 0, 1.0, 1.0), book.arrive(1, 5, 0, 1.0, 1.0), book.arrive(1, 5, 1, 1.0, 1.0)
    assert book.remove_member(2, "killed") == [(1, 5)]  # fragment 0 still waits for replica 1
    assert book.remove_member(2, "again") == []  # not a member any more: nothing happens
    assert book.remove_member(1, "killed") == [(0, 5)]
    assert not book.admits(0, 10, 1)  # a removed replica counts no more (and is no error)
    book.validate(0, 1)
    with pytest.raises(ValueError, match="replica 9: not a member"):
        book.validate(0, 9)
    with pytest.raises(ValueError, match=r"fragment 2: not in \[0, 2\)"):
        book.validate(2, 0)
    book.add_member(1, 12, slot=1)
    assert book.expected(10) == {0} and book.expected(13) == {0, 1}
    assert [e["event"] for e in book.take_events()] == ["death", "death", "join"]


def test_a_duplicate_is_refused_while_it_is_checked_and_after_it_counted():
    book, _ = _book()
    book.begin_check(0, 5, 0)
    with pytest.raises(ValueError, match="sent fragment 0 at step 5 twice"):
        book.begin_check(0, 5, 0)
    book.end_check(0, 5, 0)
    book.arrive(0, 5, 0, 1.0, 1.0)
    with pytest.raises(ValueError, match="twice"):
        book.begin_check(0, 5, 0)
    with pytest.raises(ValueError, match="twice"):
        book.not_twice(0, 5, 0)  # an abstention is refused twice too, without being checked


def test_only_the_newest_finished_round_per_fragment_is_kept_then_a_resync():
    book, _ = _book({0: 0})
    for s in (5, 10):
        book.arrive(0, s, 0, 1.0, 1.0)
        _step(book, 0, s, message=f"m{s}")
    assert set(book.finished) == {(0, 10)} and book.versions == [2, 0]
    old = book.answer(0, 5, 0, 0)  # forgotten: dropped, with the current values
    assert (old.status, old.version, old.resync) == (DROPPED, 2, True)
    assert book.is_closed(0, 5) and book.is_closed(0, 3) and not book.is_closed(0, 15)
    assert not book.admits(0, 5, 0) and _kinds(book) == [("late", 0)]


def test_a_lost_pseudo_gradient_is_dropped_from_an_open_round():
    book, _ = _book()
    book.arrive(0, 5, 0, 1.0, 1.0, parts=["p0"])
    book.drop(0, 5, 0, "its node died")
    r = book.rounds[(0, 5)]
    assert r.weights == {} and r.parts == {} and r.arrived == {0}
    assert _kinds(book) == [("lost", 0)]


def test_restore_takes_versions_completed_rounds_and_unreported_stats():
    book, _ = _book()
    book.restore([3, 4], [15, 20], [{"step": 20}, {"step": 25}])
    assert book.versions == [3, 4] and book.is_closed(1, 20) and not book.is_closed(1, 25)
    assert book.take_stats(20) == [{"step": 20}] and book.take_stats() == [{"step": 25}]


def test_a_step_redone_differently_resyncs_every_member_once_on_its_fragment():
    """A rebuilt shard took an answered round's step again without a pseudo-gradient that died
    with its node (``resync_all``): every member's next answer for that fragment is a resync of
    the current fragment, whatever version it holds, once; other fragments are untouched. (A
    break-it run, K = 7 on 3 nodes: the workers' globals differed from the outer side's.)"""
    book, _ = _book({0: 0, 1: 0, 2: 0}, fragments=2)
    for m in (0, 1, 2):
        book.arrive(0, 5, m, 1.0, 1.0, size=4, parts=[f"p{m}"])
    _step(book, 0, 5)
    assert book.answer(0, 5, 0, 0).message == "msg"  # replica 0 took the update before the redo
    book.resync_all(0)
    for m in (0, 1, 2):  # replica 0 at the new version, 1 and 2 at the base one: all resync
        a = book.answer(0, 5, m, 1 if m == 0 else 0)
        assert (a.status, a.version, a.resync, a.message) == (OK, 1, True, None)
    assert book.answer(0, 5, 1, 1).resync is False  # once
    assert book.answer(1, 5, 0, 0).resync is False  # fragment 1: as before
