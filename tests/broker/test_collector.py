"""The broker's collector policy: survivors of full collections are frozen, and the
long-lived placement state it freezes makes no cyclic garbage (which freezing would
keep forever)."""

from __future__ import annotations

import gc
import subprocess
import sys
from collections.abc import Iterator

import pytest

from dxpool.broker.collector import _after_collection, freeze_survivors


@pytest.fixture
def thawed() -> Iterator[None]:
    """Leaves the process's generations as it found them (nothing frozen by the test)."""
    yield
    gc.unfreeze()


class _Held:
    """A container the collector tracks."""

    def __init__(self) -> None:
        self.items: list[object] = []


@pytest.mark.usefixtures("thawed")
def test_survivors_of_a_full_collection_are_frozen_until_released() -> None:
    release = freeze_survivors()
    try:
        assert _after_collection in gc.callbacks
        frozen = gc.get_freeze_count()
        made = [_Held() for _ in range(1000)]
        gc.collect()  # a full collection: what survived it is frozen
        assert gc.get_freeze_count() >= frozen + len(made)
    finally:
        release()
    release()  # a second call changes nothing
    assert _after_collection not in gc.callbacks
    before = gc.get_freeze_count()
    gc.collect()
    assert gc.get_freeze_count() == before


@pytest.mark.usefixtures("thawed")
def test_the_policy_stays_while_any_holder_keeps_it() -> None:
    first, second = freeze_survivors(), freeze_survivors()
    first()
    first()
    assert _after_collection in gc.callbacks
    second()
    assert _after_collection not in gc.callbacks


_STREAM = """
import gc, random
from dxpool.broker.placement import PlacementRequest, default_pipeline, place
from dxpool.broker.placement.pool import InMemoryPool

rng = random.Random(3)
pool = InMemoryPool(pipeline=default_pipeline(), clock=lambda: 1000.0)
for index in range(32):
    location = ("dc0", f"p{index // 16}", f"r{index // 4 % 4}")
    pool.add_box(f"b{index:02d}", "H100", 8, location=location)
    pool.add_host(f"h{index:02d}", 8, cpu_cores=64, memory_mib=512 * 1024, location=location)
live = []
gc.collect()
gc.disable()
for step in range(300):
    request = PlacementRequest(
        "H100", rng.randint(1, 8), cpu_cores=rng.choice((0, 4, 16)), host_memory_mib=0
    )
    result = place(request, pool.snapshot(), pool.latency, pool.pipeline)
    if result.placement is not None:
        pool.commit(f"n{step}", request, result.placement)
        live.append(f"n{step}")
    while len(live) > 12:
        pool.release(live.pop(0))
gc.set_debug(gc.DEBUG_SAVEALL)
found = gc.collect()
print(found, sorted({type(item).__qualname__ for item in gc.garbage})[:20])
"""


def test_placements_commits_and_releases_make_no_cyclic_garbage() -> None:
    """What the policy freezes must not form cycles: a steady stream on the broker's
    cache, index and carried placement parts leaves nothing for the cyclic collector.
    Run in a process of its own, so no other test's threads add garbage meanwhile."""
    done = subprocess.run(
        [sys.executable, "-c", _STREAM], capture_output=True, text=True, timeout=600, check=False
    )
    assert done.returncode == 0, done.stderr
    found, _, kinds = done.stdout.strip().partition(" ")
    assert found == "0", kinds
