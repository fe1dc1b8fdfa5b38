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

from dxpool.broker.placement import HostInfo, PlacementRequest, PlacementResult, Snapshot, place
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
    allowed = {model.casefold() for model in request.models}
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
                and (not request.model or g.model.casefold() in allowed)
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
    allowed = {model.casefold() for model in request.models}
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
        assert not request.model or gpu.model.casefold() in allowed
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


def random_resource_case(
    rng: random.Random, *, mixing: bool = False
) -> tuple[Snapshot, TableLatency, PlacementRequest]:
    """A random pool of several models whose hosts declare CPU and memory (some do not,
    some hold part of it already), asked for a model set (a model sometimes named twice,
    in another case), any model, or one model, with CPU, memory and excluded hosts.
    Often every host is as near each box, so hosts tie on every score. ``mixing``: four
    models in small boxes and hosts of up to 16 slots, asked for any model, often more
    GPUs than any one model has free (so a mix must be chosen)."""
    pool = Pool()
    boxes = [f"b{i}" for i in range(rng.randint(2, 9))]
    hosts = [f"h{i}" for i in range(rng.randint(2, 8))]
    models = (*MODELS, "B200") if mixing else MODELS
    for box in boxes:
        pool.box(
            box,
            rng.randint(0, 4 if mixing else 8),
            busy=rng.randint(0, 3),
            model=rng.choice(models),
            schedulable=rng.random() > 0.1,
            unhealthy=[s for s in range(8) if rng.random() < 0.05],
        )
    alike = rng.random() < 0.6
    by_box = {box: rng.choice((1_000, 2_000, 3_000)) for box in boxes}
    table: dict[tuple[str, str], int] = {}
    for host in hosts:
        slots = rng.choice((8, 16)) if mixing else rng.choice((4, 8, 8))
        pool.host(host, slots, used=[s for s in range(slots) if rng.random() < 0.3])
        for box in boxes:
            table[(host, box)] = by_box[box] if alike else rng.choice((1_000, 2_000, 3_000))
    snapshot = pool.snapshot()
    declared = {}
    for host_id, host in snapshot.hosts.items():
        if rng.random() < 0.2:
            declared[host_id] = host  # declares nothing
            continue
        cpus, memory = rng.choice(((32, 131072), (64, 262144), (96, 393216), (16, 65536)))
        declared[host_id] = replace(
            host,
            alive=rng.random() > 0.1,
            cpu_cores=cpus,
            memory_mib=memory,
            used_cpu_cores=rng.choice((0, 0, cpus // 4, cpus // 2, cpus)),
            used_memory_mib=rng.choice((0, 0, memory // 8, memory // 2)),
        )
    request = PlacementRequest(
        ""
        if mixing
        else rng.choice(("H100|A100", "A100|h100|H100", "L40S|A100", "A100|L40S|H100", "", "A100")),
        rng.randint(2, 9) if mixing else rng.choice((1, 1, 2, 3, 4)),
        max_latency_ns=rng.choice((0, 0, 2_000)),
        cpu_cores=rng.choice((0, 0, 8, 24, 48)),
        host_memory_mib=rng.choice((0, 0, 32768, 200000)),
        exclude_hosts=frozenset(rng.sample(hosts, rng.randint(0, 2))),
    )
    return Snapshot(snapshot.boxes, declared, snapshot.gpus_by_box), TableLatency(table), request


def host_may_take(host: HostInfo, request: PlacementRequest) -> bool:
    """Brute force of the host side: not excluded, and the CPU and memory asked free."""
    if host.host in request.exclude_hosts:
        return False
    if request.cpu_cores and host.cpu_cores - host.used_cpu_cores < request.cpu_cores:
        return False
    free_memory = host.memory_mib - host.used_memory_mib
    return not request.host_memory_mib or free_memory >= request.host_memory_mib


def with_hosts_that_may_take(snapshot: Snapshot, request: PlacementRequest) -> Snapshot:
    """``snapshot`` with the hosts ``request`` may not use marked dead (so could_fit,
    which knows nothing of CPU, memory or exclusion, passes over them)."""
    hosts = {
        host_id: host if host_may_take(host, request) else replace(host, alive=False)
        for host_id, host in snapshot.hosts.items()
    }
    return Snapshot(snapshot.boxes, hosts, snapshot.gpus_by_box)


def free_by_model(snapshot: Snapshot) -> Counter[str]:
    """Free healthy GPUs of schedulable boxes, by casefolded model, counted one by one."""
    counts: Counter[str] = Counter()
    for box_id, gpus in snapshot.gpus_by_box.items():
        if snapshot.boxes[box_id].schedulable:
            counts.update(g.model.casefold() for g in gpus if g.free and g.healthy)
    return counts


def expected_models(
    snapshot: Snapshot, latency: TableLatency, request: PlacementRequest
) -> tuple[bool, frozenset[str] | None]:
    """Brute force of the model order: (whether anything fits, the casefolded models the
    node's GPUs must all be of, or None for any mix). A set tries its distinct models
    most free first, ties as written; any model tries each model most free first, ties
    by name, then mixes of the 2, 3, ... most free models (those holding enough GPUs in
    all), then any mix."""
    usable = with_hosts_that_may_take(snapshot, request)
    free = free_by_model(snapshot)
    if request.model:
        written: list[str] = []
        for model in request.model.split("|"):
            if model.casefold() not in [m.casefold() for m in written]:
                written.append(model)
        order = sorted(written, key=lambda m: -free[m.casefold()])
    else:
        order = sorted(free, key=lambda m: (-free[m], m)) if len(free) > 1 else []
    for model in order:
        if could_fit(usable, latency, replace(request, model=model)):
            return True, frozenset({model.casefold()})
    if request.model:
        return False, None
    ranked = sorted((m for m in free if free[m]), key=lambda m: (-free[m], m))
    for size in range(2, len(ranked)):
        mix = ranked[:size]
        if sum(free[m] for m in mix) < request.count:
            continue
        if could_fit(usable, latency, replace(request, model="|".join(mix), mixed_models=True)):
            return True, frozenset(mix)
    return could_fit(usable, latency, request), None


@pytest.mark.parametrize("mixing", [False, True], ids=["sets", "mixes"])
@pytest.mark.parametrize("seed", range(CASES))
def test_random_pools_with_model_sets_host_resources_and_exclusions(
    seed: int, mixing: bool
) -> None:
    """Placement fits exactly when brute force finds a host, on the model brute force
    tries first among those that fit (most free first; a mix: of the fewest most free
    models that fit), on a host that is not excluded and has the CPU and memory free;
    among the hosts of the best score the one with the least room (CPU and memory free,
    each a share of the largest host's), then the lowest id, wins."""
    rng = random.Random((7000 if mixing else 5000) + seed)
    snapshot, latency, request = random_resource_case(rng, mixing=mixing)
    result = place(request, snapshot, latency)
    fits, models_expected = expected_models(snapshot, latency, request)
    assert (result.placement is not None) == fits, request
    assert place(request, snapshot, latency) == result
    if result.placement is None:
        assert result.unsatisfied
        return
    host = snapshot.hosts[result.placement.host]
    assert host.alive and host_may_take(host, request)
    models = {binding.model.casefold() for binding in result.placement.bindings}
    allowed = {m.casefold() for m in request.model.split("|")} if request.model else None
    assert allowed is None or models <= allowed
    if models_expected is not None and len(models_expected) == 1:
        assert models == models_expected, (request, models, models_expected)
    elif models_expected is not None:  # a mix of the most free models only
        assert models <= models_expected, (request, models, models_expected)
    judged = replace(request, model="")
    if models_expected is not None and len(models_expected) > 1:
        judged = replace(request, model="|".join(sorted(models_expected)), mixed_models=True)
    check(result, with_hosts_that_may_take(snapshot, request), latency, judged)
    largest_cpu = max(h.cpu_cores for h in snapshot.hosts.values())
    largest_memory = max(h.memory_mib for h in snapshot.hosts.values())

    def room(other: HostInfo) -> int:
        cpu = max(other.cpu_cores - other.used_cpu_cores, 0)
        memory = max(other.memory_mib - other.used_memory_mib, 0)
        return cpu * max(largest_memory, 1) + memory * max(largest_cpu, 1)

    feasible = [c for c in result.candidates if c.feasible]
    best = max(c.score for c in feasible)
    tied = [snapshot.hosts[c.host] for c in feasible if c.score == best]
    assert min(tied, key=lambda h: (room(h), h.host)).host == host.host


def test_the_random_resource_cases_often_place_often_fail_and_often_tie() -> None:
    placed = tied = on_second_model = 0
    for seed in range(CASES):
        snapshot, latency, request = random_resource_case(random.Random(5000 + seed))
        result = place(request, snapshot, latency)
        if result.placement is None:
            continue
        placed += 1
        feasible = [c for c in result.candidates if c.feasible]
        tied += sum(c.score == feasible[0].score for c in feasible) > 1
        first = request.model.split("|")[0].casefold() if request.model else ""
        on_second_model += bool(first) and result.placement.bindings[0].model.casefold() != first
    assert CASES // 5 < placed < CASES - CASES // 5
    assert tied >= 10  # the least-room rule decides
    assert on_second_model >= 5  # scarcity often reorders a set


def test_the_random_mixing_cases_often_mix_only_the_most_free_models() -> None:
    placed = fewest_most_free = 0
    for seed in range(CASES):
        snapshot, latency, request = random_resource_case(random.Random(7000 + seed), mixing=True)
        if place(request, snapshot, latency).placement is None:
            continue
        placed += 1
        _, models = expected_models(snapshot, latency, request)
        fewest_most_free += models is not None and len(models) > 1
    assert CASES // 5 < placed < CASES - CASES // 5
    assert fewest_most_free >= 10  # a mix of some, not all, of the models decides
