"""The TieredLatencyModel contract, checked over a set of places (shared by the models'
tests)."""

from __future__ import annotations

import random
from collections.abc import Sequence

from dxpool.fabric.latency import Place, TieredLatencyModel

SITES = ("dc1", "dc2")
PODS = ("p1", "p2")
RACKS = ("r1", "r2", "r3")


def random_place(rng: random.Random, name: str) -> Place:
    """A place in a small tree, sometimes incomplete (unplaced)."""
    if rng.random() < 0.1:
        return Place(name, rng.choice(SITES))
    return Place(name, rng.choice(SITES), rng.choice(PODS), rng.choice(RACKS))


def assert_tier_contract(
    model: TieredLatencyModel, hosts: Sequence[Place], boxes: Sequence[Place]
) -> None:
    """Every box class is in exactly one tier of each host class's ranking, and that
    tier's round trip is the model's round trip for the pair; tiers are nearest first."""
    host_classes = [model.host_class(host) for host in hosts]
    box_classes = [model.box_class(box) for box in boxes]
    for host, host_class in zip(hosts, host_classes, strict=True):
        ranking = model.ranking(host_class)
        tier_ns = [ns for ns, _ in ranking]
        assert tier_ns == sorted(set(tier_ns)), ranking
        for box, box_class in zip(boxes, box_classes, strict=True):
            tiers = [ns for ns, classes in ranking if box_class in classes]
            assert len(tiers) == 1, (host, box, ranking)
            assert tiers[0] == model.round_trip(host, box).round_trip_ns, (host, box)
            assert model.class_round_trip_ns(host_class, box_class) == tiers[0], (host, box)
