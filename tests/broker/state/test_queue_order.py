"""The queue's order: priority, then turns between tenants, then age (pure)."""

from __future__ import annotations

import random

from dxpool.broker.state.queue_order import Waiting, ordered


def w(name: str, tenant: str, enqueued: float, priority: int = 0) -> Waiting:
    return Waiting(name, tenant, priority, enqueued, 1)


def test_priority_first_then_tenant_turns_then_age() -> None:
    entries = [
        w("a1", "a", 1), w("a2", "a", 2), w("a3", "a", 3),
        w("b1", "b", 5), w("b2", "b", 6),
        w("none", "", 4),
        w("urgent", "c", 9, priority=7),
    ]  # fmt: skip
    names = [e.name for e in ordered(entries)]
    assert names == ["urgent", "a1", "none", "b1", "a2", "b2", "a3"]


def test_a_tenant_that_queues_many_delays_another_by_one_turn_at_most() -> None:
    flood = [w(f"f{i}", "flood", float(i)) for i in range(1000)]
    late = w("late", "quiet", 5000.0)
    names = [e.name for e in ordered([*flood, late])]
    assert names.index("late") == 1


def test_the_order_does_not_depend_on_the_order_given() -> None:
    rng = random.Random(3)
    entries = [w(f"n{i}", rng.choice("abc"), rng.random(), rng.choice((0, 5))) for i in range(200)]
    expected = ordered(entries)
    for _ in range(5):
        rng.shuffle(entries)
        assert ordered(entries) == expected


def test_ties_in_age_are_broken_by_name() -> None:
    assert [e.name for e in ordered([w("y", "t", 1.0), w("x", "t", 1.0)])] == ["x", "y"]
