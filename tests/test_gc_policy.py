"""The collector policy against the real collector: what it freezes, when, what a full
reclaim frees, what it reports, and that concurrent callers never collect twice."""

from __future__ import annotations

import gc
import threading
import weakref
from collections.abc import Callable, Iterator

import pytest

from dxpool.gc_policy import (
    FULL_RECLAIM,
    START,
    YOUNG_BATCH,
    CollectorPolicy,
    CollectorSettings,
)

# The collector's own threshold, far above any batch here: no automatic young collection
# empties generation 0 behind a test's back.
NO_AUTOMATIC = 10_000_000


class Cycle:
    """An object in a reference cycle with itself: only the cyclic collector frees it."""

    def __init__(self) -> None:
        self.me = self


def about(frozen: int) -> bool:
    """Whether ``frozen`` is the collector's frozen count now, give or take the few frozen
    objects (frames, temporaries) that reference counting freed since."""
    return 0 <= frozen - gc.get_freeze_count() <= 100


def tracked(count: int) -> list[list[int]]:
    """``count`` new container objects the collector tracks, kept alive by the caller."""
    return [[n] for n in range(count)]


@pytest.fixture
def policies() -> Iterator[Callable[..., CollectorPolicy]]:
    """Makes policies; afterwards stops them and puts the collector back as it was found
    (thresholds), with nothing frozen."""
    found = gc.get_threshold()
    made: list[CollectorPolicy] = []

    def make(
        observer: Callable[[str, float, int], None] | None = None,
        clock: Callable[[], float] | None = None,
        **settings: object,
    ) -> CollectorPolicy:
        values: dict[str, object] = {"young_limit": NO_AUTOMATIC, "reclaim_interval_s": 0}
        values.update(settings)
        policy = CollectorPolicy(
            CollectorSettings(**values),  # type: ignore[arg-type]
            observer,
            *(() if clock is None else (clock,)),
        )
        made.append(policy)
        return policy

    yield make
    for policy in made:
        policy.stop()
    gc.unfreeze()
    gc.set_threshold(*found)


def test_start_freezes_without_a_full_collection_and_sets_the_safety_net(
    policies: Callable[..., CollectorPolicy],
) -> None:
    garbage = Cycle()
    gone = weakref.ref(garbage)
    del garbage
    policy = policies(young_batch=1000, young_limit=40_000, middle_limit=7, old_limit=9)
    policy.start()
    assert gone() is not None, "start freezes what is there, as the broker's start did"
    assert gc.get_threshold() == (40_000, 7, 9)
    assert policy.frozen > 0 and about(policy.frozen)
    with pytest.raises(RuntimeError, match="already started"):
        policy.start()
    policy.reclaim()
    assert gone() is None, "the full reclaim frees what was frozen dead"


def test_between_does_nothing_below_the_batch(policies: Callable[..., CollectorPolicy]) -> None:
    policy = policies(young_batch=50_000)
    policy.start()
    frozen = gc.get_freeze_count()
    kept = tracked(100)
    young = gc.get_count()[0]
    assert policy.between() is None
    assert gc.get_freeze_count() == frozen
    assert gc.get_count()[0] >= young, "no collection ran"
    assert kept


def test_between_collects_the_young_and_freezes_the_survivors_at_the_batch(
    policies: Callable[..., CollectorPolicy],
) -> None:
    policy = policies(young_batch=2000)
    policy.start()
    frozen = gc.get_freeze_count()
    kept = tracked(3000)
    garbage = Cycle()
    gone = weakref.ref(garbage)
    del garbage
    assert gc.get_count()[0] >= 2000
    assert policy.between() == YOUNG_BATCH
    assert gone() is None, "the young cycle that died was collected"
    assert gc.get_freeze_count() >= frozen + len(kept), "the survivors were frozen"
    assert gc.get_count()[0] < 2000
    assert about(policy.frozen)


def test_a_cycle_frozen_alive_that_dies_later_is_freed_by_the_full_reclaim_when_due(
    policies: Callable[..., CollectorPolicy],
) -> None:
    now = [100.0]
    policy = policies(clock=lambda: now[0], young_batch=50_000, reclaim_interval_s=60)
    cycle = Cycle()
    gone = weakref.ref(cycle)
    policy.start()  # frozen alive
    del cycle
    gc.collect()
    assert gone() is not None, "a frozen cycle is out of every collection's reach"
    now[0] += 59
    assert policy.between() is None
    assert gone() is not None
    now[0] += 1
    assert policy.between() == FULL_RECLAIM
    assert gone() is None, "the full reclaim unfroze and collected it"
    assert policy.frozen > 0 and about(policy.frozen), "and froze the rest again"
    assert policy.between() is None, "the interval starts again from the reclaim"


def test_the_frozen_set_growing_by_its_share_brings_the_full_reclaim(
    policies: Callable[..., CollectorPolicy],
) -> None:
    policy = policies(young_batch=2000)
    policy.start()
    cycle = Cycle()
    gone = weakref.ref(cycle)
    kept = tracked(int(0.3 * policy.frozen) + 3000)  # more than a quarter of what froze
    assert policy.between() == YOUNG_BATCH  # the cycle and the new objects freeze
    del cycle
    more = tracked(3000)
    assert policy.between() == FULL_RECLAIM
    assert gone() is None
    more.extend(tracked(3000))
    assert policy.between() == YOUNG_BATCH, "grown by less than a quarter since the reclaim"
    assert kept and more


def test_frozen_objects_freed_by_reference_counting_bring_no_full_reclaim(
    policies: Callable[..., CollectorPolicy],
) -> None:
    policy = policies(young_batch=2000)
    policy.start()
    kept = tracked(int(0.3 * policy.frozen) + 3000)
    assert policy.between() == YOUNG_BATCH
    assert policy.frozen >= len(kept), "the batch counted what it froze"
    del kept  # frozen, then freed by reference counting: no growth left
    more = tracked(3000)
    assert policy.between() == YOUNG_BATCH, "the policy counted again and found no growth"
    assert about(policy.frozen)
    counted = policy.frozen
    walks: list[int] = []
    real_count = gc.get_freeze_count

    def counting() -> int:
        walks.append(1)
        return real_count()

    gc.get_freeze_count = counting  # type: ignore[assignment]
    try:
        more.extend(tracked(3000))
        assert policy.between() == YOUNG_BATCH
        assert walks == [], "no second walk before the kept count grew by another share"
        assert policy.frozen >= counted + 3000
    finally:
        gc.get_freeze_count = real_count


def test_every_collection_is_reported_with_its_kind_duration_and_frozen_count(
    policies: Callable[..., CollectorPolicy],
) -> None:
    seen: list[tuple[str, float, int]] = []
    policy = policies(lambda *report: seen.append(report), young_batch=2000)
    policy.start()
    kept = tracked(3000)
    policy.between()
    policy.reclaim()
    assert [kind for kind, _, _ in seen] == [START, YOUNG_BATCH, FULL_RECLAIM]
    assert all(seconds > 0 for _, seconds, _ in seen)
    assert seen[1][2] >= seen[0][2] + len(kept)
    assert about(seen[2][2])


def test_a_caller_arriving_while_another_collects_returns_at_once_without_collecting(
    policies: Callable[..., CollectorPolicy],
) -> None:
    inside, go_on = threading.Event(), threading.Event()
    kinds: list[str] = []

    def observer(kind: str, seconds: float, frozen: int) -> None:
        kinds.append(kind)
        if kind == YOUNG_BATCH:
            inside.set()
            assert go_on.wait(30)

    policy = policies(observer, young_batch=2000)
    policy.start()
    kept = tracked(3000)
    first = threading.Thread(target=policy.between)
    first.start()
    try:
        assert inside.wait(30), "the first caller never collected"
        more = tracked(3000)  # over the batch again: only the lock holds the second back
        assert policy.between() is None
        assert kinds == [START, YOUNG_BATCH]
    finally:
        go_on.set()
        first.join(30)
    assert kept and more


def test_disabled_it_freezes_once_and_leaves_the_collector_alone(
    policies: Callable[..., CollectorPolicy],
) -> None:
    found = gc.get_threshold()
    policy = policies(enabled=False, young_batch=1)
    policy.start()
    assert gc.get_freeze_count() > 0
    assert gc.get_threshold() == found
    kept = tracked(100)
    assert policy.between() is None
    assert kept


def test_the_last_policy_to_stop_puts_back_the_thresholds_the_first_found(
    policies: Callable[..., CollectorPolicy],
) -> None:
    found = gc.get_threshold()
    first, second = policies(young_limit=30_000), policies(young_limit=40_000)
    first.start()
    second.start()
    first.stop()
    assert gc.get_threshold()[0] == 40_000, "the running policy's thresholds stay"
    second.stop()
    assert gc.get_threshold() == found
    assert second.between() is None, "a stopped policy collects nothing"
    second.stop()  # idempotent


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"young_batch": 0}, "young_batch must be at least 1"),
        ({"young_batch": 100, "young_limit": 50}, "young_limit .50. must be at least"),
        ({"middle_limit": 0}, "middle_limit and old_limit"),
        ({"reclaim_growth": 0}, "reclaim_growth must be above 0"),
        ({"reclaim_interval_s": -1}, "reclaim_interval_s must be 0"),
    ],
)
def test_settings_out_of_range_are_refused_naming_the_field(
    settings: dict[str, float], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        CollectorSettings(**settings)  # type: ignore[arg-type]
