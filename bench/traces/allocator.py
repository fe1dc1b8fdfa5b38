"""What the benchmarks ask of an allocator, and how a refusal is classified."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Protocol


class Cause(enum.Enum):
    """Why a request was refused, judged on the state at the moment of the refusal.

    ``CAPACITY``: fewer free GPUs than asked, however they were arranged.
    ``HOST_SLOTS``: enough free GPUs, but fewer free proxy slots on live hosts than asked
    in all (a pool whose hosts, not GPUs, ran out; fixed servers never report it).
    ``FRAGMENTATION``: enough free GPUs (and slots) in all, but no single server or host
    can take the request: what placement's choices left scattered.
    """

    CAPACITY = "no GPU capacity"
    HOST_SLOTS = "host slots"
    FRAGMENTATION = "fragmentation"


@dataclass(frozen=True, slots=True)
class Grant:
    """One placed node: where it went (an allocator-specific key) and how many GPUs."""

    key: object
    gpus: int


class Allocator(Protocol):
    """A cluster that places nodes of whole GPUs, one at a time, and takes them back."""

    name: str
    capacity: int  # GPUs

    def allocate(self, gpus: int) -> Grant | Cause:
        """Place a node of ``gpus`` GPUs now, or say why it cannot be."""
        ...

    def release(self, grant: Grant) -> None:
        """Take back a node :meth:`allocate` granted (each grant exactly once)."""
        ...

    @property
    def allocated(self) -> int:
        """GPUs held by granted nodes now."""
        ...


def allocate_gang(allocator: Allocator, members: list[int]) -> list[Grant] | Cause:
    """All-or-nothing: place every member (a node of that many GPUs), in order; if one
    cannot be placed, release the members already placed and return its cause."""
    grants: list[Grant] = []
    for gpus in members:
        outcome = allocator.allocate(gpus)
        if isinstance(outcome, Cause):
            for grant in reversed(grants):
                allocator.release(grant)
            return outcome
        grants.append(outcome)
    return grants


def gang_members(gpus: int, per_node: int = 8) -> list[int]:
    """How a job of ``gpus`` GPUs is split into nodes of at most ``per_node``: as many
    full nodes as fit, then the rest (12 -> [8, 4]); a job that fits is one node."""
    if gpus <= 0:
        raise ValueError(f"a job needs at least one GPU, got {gpus}")
    full, rest = divmod(gpus, per_node)
    return [per_node] * full + ([rest] if rest else [])
