"""Whatever the pool, a placement only ever uses what the request allows.

Many seeded random pools and requests: every placement returned is checked against the
request and the snapshot, placement fails exactly when a brute-force search finds nothing,
and every failure explains itself.
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import replace

import pytest

from dxpool.broker.placement import PlacementRequest, PlacementResult, Snapshot, place
from dxpool.fabric.latency import Place

from .pools import Pool, TableLatency

MODELS = ("H100", "A100", "L40S")
CASES = 150


def random_case(rng: random.Random) -> tuple[Snapshot, TableLatency, PlacementRequest]:
    pool = Pool()
    table: dict[tuple[str, str], int] = {}
    boxes = [f"b{i}" for i in range(rng.randint(1, 6))]
    hosts = [f"h{i}" for i in range(rng.randint(1, 5))]
    for box in boxes:
        pool.box(
            box,
            rng.randint(0, 6),
            busy=rng.randint(0, 3),
            model=rng.choice(MODELS),
            memory_mib=rng.choice((40960, 81920)),
            schedulable=rng.random() > 0.2,
            unhealthy=[s for s in range(8) if rng.random() < 0.1],
        )
    for host in hosts:
        slots = rng.randint(0, 8)
        used = [s for s in range(slots + 2) if rng.random() < 0.3]
        pool.host(host, slots, used=used, alive=rng.random() > 0.2)
        for box in boxes:
            table[(host, box)] = rng.choice((1_000, 1_500, 2_000, 3_000, 6_000))
    all_gpus = [g.name for gpus in pool.gpus.values() for g in gpus]
    request = PlacementRequest(
        rng.choice((*MODELS, "", "h100")),
        rng.choice((1, 1, 2, 3, 4, 6)),
        min_memory_mib=rng.choice((0, 0, 81920)),
        host=rng.choice((None, None, None, *hosts)),
        max_latency_ns=rng.choice((0, 0, 2_000)),
        exclude_gpus=frozenset(rng.sample(all_gpus, min(len(all_gpus), rng.randint(0, 2)))),
    )
    return pool.snapshot(), TableLatency(table), request


def could_fit(snapshot: Snapshot, latency: TableLatency, request: PlacementRequest) -> bool:
    """Brute force: some usable host reaches ``count`` usable GPUs within the bound (with
    switch affinity: under one switch; with a spread limit: counting at most that many
    per box)."""
    for host in snapshot.hosts.values():
        if not host.alive or request.host not in (None, host.host):
            continue
        if host.free_slot_count() < request.count:
            continue
        reachable: Counter[tuple[str, ...]] = Counter()
        for box_id, gpus in snapshot.gpus_by_box.items():
            box = snapshot.boxes[box_id]
            ns = latency.round_trip(host.place, box.place).round_trip_ns
            if not box.schedulable or (request.max_latency_ns and ns > request.max_latency_ns):
                continue
            usable = sum(
                1
                for g in gpus
                if g.free
                and g.healthy
                and (not request.model or g.model.casefold() == request.model.casefold())
                and g.memory_mib >= request.min_memory_mib
                and g.name not in request.exclude_gpus
            )
            if request.max_gpus_per_box:
                usable = min(usable, request.max_gpus_per_box)
            place = box.place
            rack = (place.site, place.pod, place.rack) if place.rack else ("box", box_id)
            reachable[rack if request.same_switch else ("pool",)] += usable
        if max(reachable.values(), default=0) >= request.count:
            return True
    return False


def check(
    result: PlacementResult, snapshot: Snapshot, latency: TableLatency, request: PlacementRequest
) -> None:
    assert sorted(c.host for c in result.candidates) == sorted(snapshot.hosts)
    assert all(c.reasons for c in result.candidates)
    assert (result.placement is not None) == could_fit(snapshot, latency, request)
    if result.placement is None:
        assert result.unsatisfied
        assert not any(c.feasible for c in result.candidates)
        return
    assert result.unsatisfied == ()
    host = snapshot.hosts[result.placement.host]
    assert host.alive
    assert request.host in (None, host.host)
    bindings = result.placement.bindings
    assert len(bindings) == request.count
    slots = [b.host_slot for b in bindings]
    assert len(set(slots)) == len(slots)
    assert all(0 <= s < host.slot_capacity and s not in host.used_slots for s in slots)
    assert len({b.gpu for b in bindings}) == len(bindings)
    gpus = {g.name: g for gs in snapshot.gpus_by_box.values() for g in gs}
    for binding in bindings:
        gpu = gpus[binding.gpu]
        assert gpu.free and gpu.healthy
        assert (gpu.box, gpu.slot, gpu.model) == (binding.box, binding.slot, binding.model)
        assert not request.model or gpu.model.casefold() == request.model.casefold()
        assert gpu.memory_mib >= request.min_memory_mib
        assert gpu.name not in request.exclude_gpus
        assert snapshot.boxes[gpu.box].schedulable
        assert not request.max_latency_ns or binding.latency_ns <= request.max_latency_ns
    if request.same_switch:
        places = {snapshot.boxes[binding.box].place for binding in bindings}
        assert len({(p.site, p.pod, p.rack) for p in places}) == 1
        assert all(p.rack for p in places) or len({b.box for b in bindings}) == 1
    if request.max_gpus_per_box:
        per_box = Counter(binding.box for binding in bindings)
        assert max(per_box.values()) <= request.max_gpus_per_box
    best = result.candidates[0]
    assert best.feasible and best.host == host.host and best.score == result.placement.score


@pytest.mark.parametrize("seed", range(CASES))
def test_random_pools(seed: int) -> None:
    snapshot, latency, request = random_case(random.Random(seed))
    result = place(request, snapshot, latency)
    check(result, snapshot, latency, request)
    assert place(request, snapshot, latency) == result


def random_switch_case(rng: random.Random) -> tuple[Snapshot, TableLatency, PlacementRequest]:
    """A random case whose boxes sit in a few racks (some without one), asking for
    switch affinity and sometimes a spread over the switch's boxes."""
    snapshot, latency, request = random_case(rng)
    boxes = {
        box_id: replace(box, place=Place(box.place.name, "dc1", "p1", rng.choice(("r1", "r2", ""))))
        for box_id, box in snapshot.boxes.items()
    }
    request = replace(
        request,
        model=rng.choice(("", request.model)),
        host=None,
        min_memory_mib=0,
        count=rng.choice((2, 3, 4, 6)),
        same_switch=True,
        max_gpus_per_box=rng.choice((0, 0, 2)),
    )
    return Snapshot(boxes, snapshot.hosts, snapshot.gpus_by_box), latency, request


@pytest.mark.parametrize("seed", range(CASES))
def test_random_pools_with_switch_affinity(seed: int) -> None:
    snapshot, latency, request = random_switch_case(random.Random(seed))
    result = place(request, snapshot, latency)
    check(result, snapshot, latency, request)
    assert place(request, snapshot, latency) == result


def test_the_random_switch_cases_often_place_and_often_fail() -> None:
    placed = several = 0
    for seed in range(CASES):
        snapshot, latency, request = random_switch_case(random.Random(seed))
        found = place(request, snapshot, latency).placement
        if found is not None:
            placed += 1
            several += len({binding.box for binding in found.bindings}) > 1
    assert CASES // 5 < placed < CASES - CASES // 5
    assert several >= 3  # some nodes take several boxes of one switch


def test_the_random_cases_often_place_and_often_fail() -> None:
    placed = 0
    for seed in range(CASES):
        snapshot, latency, request = random_case(random.Random(seed))
        placed += place(request, snapshot, latency).placement is not None
    assert CASES // 5 < placed < CASES - CASES // 5
