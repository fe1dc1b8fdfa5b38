"""The nearest of a few tightest boxes per host class, kept up as the few change.

:class:`~dxpool.broker.placement.nearest_few.NearestFew` answers every host class at
once and, on each change of the few, only the groups that rest on what changed. Its
answers, a far one resolved to the box it stands for, must be the nearest few box asked
pair by pair (the lowest box id among equally near ones), after any sequence of changes.
"""

from __future__ import annotations

import random

import pytest

from dxpool.broker.placement import nearest_few
from dxpool.broker.placement.framework import BoxSupply
from dxpool.broker.placement.model import BoxInfo
from dxpool.broker.placement.nearest_few import Nearest, NearestFew
from dxpool.broker.placement.tiered import FarTightest
from dxpool.fabric.latency import Place, TopologyLatencyModel
from dxpool.fabric.topology import Topology

# Uneven switch latencies, so the pods of a site are not all alike, and two sites.
TOPOLOGY = """
proxy_ns: 600
links: {rack_ns: 250, pod_ns: 500, site_ns: 1000, inter_site_ns: 40000}
sites:
  - name: s0
    pods:
      - name: p0
        pod_ns: 450
        racks: [{name: r0, rack_ns: 300}, {name: r1}, {name: r2, rack_ns: 200}, {name: r3}]
      - name: p1
      - name: p2
      - name: p3
  - name: s1
    rack_ns: 275
"""

SITES = ("s0", "s1")
PODS = ("p0", "p1", "p2", "p3")
RACKS = ("r0", "r1", "r2", "r3")


@pytest.fixture(params=[2, 64], ids=["large-tiers", "listed-tiers"])
def large_tier(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> int:
    """Tiers of more classes than this are read as large: 2 makes every pod's rest of
    the site one, as at scale; 64 lists every tier of this small topology."""
    monkeypatch.setattr(nearest_few, "LARGE_TIER", request.param)
    return int(request.param)


def _model() -> TopologyLatencyModel:
    model = TopologyLatencyModel(Topology.from_yaml(TOPOLOGY))
    for site in SITES:  # number every class first: the rankings then stay the same
        for pod in PODS:
            for rack in RACKS:
                model.host_class(Place(f"hosts/{site}{pod}{rack}", site, pod, rack))
    return model


def _classes(model: TopologyLatencyModel) -> list[int]:
    return sorted(
        {
            model.host_class(Place(f"hosts/{site}{pod}{rack}", site, pod, rack))
            for site in SITES
            for pod in PODS
            for rack in RACKS
        }
    )


def _box(name: str, model: TopologyLatencyModel, number: int) -> BoxSupply:
    """A box of class ``number`` (the gpus do not matter here)."""
    for site in SITES:
        for pod in PODS:
            for rack in RACKS:
                place = Place(f"boxes/{name}", site, pod, rack)
                if model.box_class(place) == number:
                    return BoxSupply(BoxInfo(name, place, True), ())
    raise AssertionError(number)


def _resolved(
    answer: Nearest, few: dict[int, BoxSupply], model: TopologyLatencyModel, host_class: int
) -> tuple[int, str]:
    """(round trip, box id) an answer stands for."""
    if isinstance(answer, FarTightest):
        inside = [box.box.box for number, box in few.items() if number in answer.tier]
        assert inside, "a far answer's tier holds one of the few"
        return answer.latency, min(inside)
    ns, number = answer
    assert model.class_round_trip_ns(host_class, number) == ns
    return ns, few[number].box.box


def _pair_by_pair(
    few: dict[int, BoxSupply], model: TopologyLatencyModel, host_class: int
) -> tuple[int, str]:
    return min((model.class_round_trip_ns(host_class, n), box.box.box) for n, box in few.items())


@pytest.mark.parametrize("seed", range(15))
def test_every_answer_is_the_nearest_few_box_asked_pair_by_pair(seed: int, large_tier: int) -> None:
    """Few classes join, leave and change their box in random order; after every change
    each host class's answer is the nearest few box pair by pair, and the classes named
    as moved are exactly those whose answer is another than before, whether the classes
    were joined before the first update or named on each."""
    rng = random.Random(seed)
    model = _model()
    classes = _classes(model)
    nearest = NearestFew(model)
    joined = seed % 2 == 0  # the classes known before any few, or named on each update
    if joined:
        nearest.join(classes)
    few: dict[int, BoxSupply] = {}
    serial = 0
    before: dict[int, Nearest] = {}
    for _ in range(60):
        for _ in range(rng.randint(1, 3)):
            number = rng.choice(classes)
            if number in few and (rng.random() < 0.5 or len(few) > 6):
                del few[number]
            else:
                serial += 1
                few[number] = _box(f"x{rng.randrange(1000):03d}-{serial}", model, number)
        if not few:
            few[classes[0]] = _box(f"y{serial}", model, classes[0])
        moved = nearest.update(tuple(sorted(few.items())), () if joined else classes)
        for host_class in classes:
            answer = nearest.answers[host_class]
            assert _resolved(answer, few, model, host_class) == _pair_by_pair(
                few, model, host_class
            )
            assert (host_class in moved) == (before.get(host_class) != answer)
        before = dict(nearest.answers)


def test_a_change_in_one_pod_answers_again_only_that_pods_classes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With large tiers (as at scale), the racks of a pod that holds none of the few
    answer "the least box of the rest of the site": a few box coming to another pod
    leaves them alone, so the classes named are those of that pod."""
    monkeypatch.setattr(nearest_few, "LARGE_TIER", 2)
    model = _model()
    classes = _classes(model)
    nearest = NearestFew(model)

    def number(pod: str, rack: str) -> int:
        return model.box_class(Place("boxes/any", "s0", pod, rack))

    first = _box("b5", model, number("p0", "r0"))
    second = _box("b1", model, number("p1", "r0"))  # a lower id, in another pod
    nearest.update(((number("p0", "r0"), first),), classes)
    p2 = model.host_class(Place("hosts/q", "s0", "p2", "r1"))
    assert isinstance(nearest.answers[p2], FarTightest)
    moved = nearest.update(
        tuple(sorted(((number("p0", "r0"), first), (number("p1", "r0"), second)))), classes
    )
    pod_p1 = {model.host_class(Place("hosts/q", "s0", "p1", rack)) for rack in RACKS}
    assert set(moved) == pod_p1
    assert isinstance(nearest.answers[p2], FarTightest)  # the same answer: now b1


def test_equally_near_few_boxes_go_to_the_lowest_box_id() -> None:
    """Two racks, equally near a host, each hold a few box: the lower box id is the
    answer; when one rack's box is replaced by one with a higher id, the other rack's
    box is, though the same racks hold them."""
    model = _model()
    host_class = model.host_class(Place("hosts/h", "s1", "p0", "r3"))
    r1 = model.box_class(Place("boxes/any", "s1", "p0", "r1"))
    r2 = model.box_class(Place("boxes/any", "s1", "p0", "r2"))
    assert model.class_round_trip_ns(host_class, r1) == model.class_round_trip_ns(host_class, r2)
    nearest = NearestFew(model)
    nearest.update(((r1, _box("t1", model, r1)), (r2, _box("t2", model, r2))), [host_class])
    assert nearest.answers[host_class] == (model.class_round_trip_ns(host_class, r1), r1)
    moved = nearest.update(((r1, _box("t9", model, r1)), (r2, _box("t2", model, r2))), [host_class])
    assert moved == [host_class]
    assert nearest.answers[host_class] == (model.class_round_trip_ns(host_class, r2), r2)


def test_a_reset_answers_afresh() -> None:
    """After a reset (the model's rankings changed) every class is answered again."""
    model = _model()
    classes = _classes(model)
    nearest = NearestFew(model)
    few = ((classes[3], _box("a", model, classes[3])),)
    assert sorted(nearest.update(few, classes)) == classes
    assert nearest.update(few, classes) == []
    nearest.reset()
    assert sorted(nearest.update(few, classes)) == classes
