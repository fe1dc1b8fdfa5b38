"""What the benchmarks ask of an allocator, and how a refusal is classified."""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Protocol


class Cause(enum.Enum):
    """Why a request was refused, judged on the state at the moment of the refusal, in
    this order (the first that holds is the cause):

    ``CAPACITY``: fewer free GPUs than asked, however they were arranged.
    ``MODEL``: enough free GPUs, but fewer of the models the request may use than asked
    (of any one of them, for a node of one model).
    ``HOST_SLOTS``: enough free GPUs, but fewer free proxy slots on live hosts than asked
    in all (a pool whose hosts, not GPUs, ran out; fixed servers never report it).
    ``CPU``, ``MEMORY``: less free CPU, or memory, than asked in all, on the hosts (or
    servers) that declare it.
    ``FRAGMENTATION``: enough of everything in all, but no single server or host has the
    GPUs (free GPUs or proxy slots) the request needs: what placement's choices left
    scattered.
    ``FRAGMENTATION_CPU``: some hosts have the GPUs, but none of them also has the CPU.
    ``FRAGMENTATION_MEMORY``: some hosts have the GPUs and the CPU, none also the memory.
    """

    CAPACITY = "no GPU capacity"
    MODEL = "no GPU capacity of the models asked"
    HOST_SLOTS = "host slots"
    CPU = "no CPU capacity"
    MEMORY = "no memory capacity"
    FRAGMENTATION = "fragmentation"
    FRAGMENTATION_CPU = "fragmentation (CPU)"
    FRAGMENTATION_MEMORY = "fragmentation (memory)"


FRAGMENTED = (Cause.FRAGMENTATION, Cause.FRAGMENTATION_CPU, Cause.FRAGMENTATION_MEMORY)
"""The causes that are fragmentation: enough in all, not on one host or server."""


@dataclass(frozen=True, slots=True)
class Resources:
    """What a request asks besides a number of GPUs: CPU (in the allocator's CPU unit)
    and memory (MiB) of one host or server, 0 for none; the GPU ``models`` it may use
    (any of them, all of one model per node; () for any model)."""

    cpu: int = 0
    memory_mib: int = 0
    models: tuple[str, ...] = ()


NONE = Resources()


@dataclass(frozen=True, slots=True)
class Grant:
    """One placed node: where it went (an allocator-specific key) and how many GPUs."""

    key: object
    gpus: int


class Allocator(Protocol):
    """A cluster that places nodes of whole GPUs, one at a time, and takes them back."""

    name: str
    capacity: int  # GPUs

    def allocate(self, gpus: int, needs: Resources = NONE) -> Grant | Cause:
        """Place a node of ``gpus`` GPUs (0: a CPU-only pod) that also needs ``needs`` of
        its host or server now, or say why it cannot be."""
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


def refusal(
    gpus: int,
    needs: Resources,
    free_gpus: int,
    totals: tuple[int, int, int],
    rooms: Iterable[tuple[int, int, int]],
    free_by_model: Mapping[str, int] | None = None,
) -> Cause | None:
    """Why ``gpus`` GPUs with ``needs`` cannot be placed now, or None when some host or
    server can take them; ``free_gpus`` free GPUs in all, ``totals`` the free (GPU room,
    CPU, memory) in all and ``rooms`` each host's or server's (its GPU room is its free
    proxy slots, or for a server its free GPUs of the models asked); ``free_by_model``
    the free GPUs of each model, for a request naming models. See :class:`Cause` for the
    order. Stops at the first host that fits."""
    if free_gpus < gpus:
        return Cause.CAPACITY
    if (
        gpus
        and needs.models
        and free_by_model is not None
        and max(free_by_model.get(model, 0) for model in needs.models) < gpus
    ):
        return Cause.MODEL
    if totals[0] < gpus:
        return Cause.HOST_SLOTS
    if totals[1] < needs.cpu:
        return Cause.CPU
    if totals[2] < needs.memory_mib:
        return Cause.MEMORY
    found = Cause.FRAGMENTATION
    for room, cpu, memory in rooms:
        if room < gpus:
            continue
        if cpu < needs.cpu:
            if found is Cause.FRAGMENTATION:
                found = Cause.FRAGMENTATION_CPU
            continue
        if memory < needs.memory_mib:
            found = Cause.FRAGMENTATION_MEMORY  # the GPUs and the CPU were there
            continue
        return None
    return found
