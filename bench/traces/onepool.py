"""A bound, not a cluster: every free GPU can serve any node (GPUs only, one model).

Without a queue, every allocator refuses a job when fewer GPUs are free than it asks,
and this one refuses it only then. Any allocator that places every job that fits when
it arrives (no fragmentation refusal) therefore refuses exactly the jobs this one
does: the refusals capacity alone forces on the job list. A placement rule can make a
cluster's refusals differ from these only by refusing jobs that fit, which is
admission by accident (the large jobs it strands free GPUs the small ones take), not a
better packing. CPU, memory and models are not modelled: a request naming any is an
error of use.
"""

from __future__ import annotations

from bench.traces.allocator import NONE, Cause, Grant, Resources


class OnePool:
    """``capacity`` GPUs that all reach every node."""

    def __init__(self, name: str, capacity: int) -> None:
        if capacity <= 0:
            raise ValueError(f"a pool needs at least one GPU, got {capacity}")
        self.name = name
        self.capacity = capacity
        self._allocated = 0

    @property
    def allocated(self) -> int:
        return self._allocated

    def allocate(self, gpus: int, needs: Resources = NONE) -> Grant | Cause:
        if needs != NONE:
            raise ValueError("the one-pool bound models GPUs only, not CPU, memory or models")
        if self.capacity - self._allocated < gpus:
            return Cause.CAPACITY
        self._allocated += gpus
        return Grant(None, gpus)

    def release(self, grant: Grant) -> None:
        if grant.gpus > self._allocated:
            raise ValueError(f"released {grant.gpus} GPUs, only {self._allocated} held")
        self._allocated -= grant.gpus


class ReservedPool(OnePool):
    """A one pool with an admission rule instead of a placement rule: a node of at least
    ``min_gpus`` GPUs is refused when it would leave fewer than ``reserve`` GPUs free,
    so that many stay for smaller nodes; every other node is refused only for capacity,
    as in :class:`OnePool`. A gang's members are judged one by one (a 16-GPU job is two
    8-GPU nodes). A refusal by the reserve is reported as ``CAPACITY``: the reserved
    GPUs are not capacity such a node may take."""

    def __init__(self, name: str, capacity: int, min_gpus: int, reserve: int) -> None:
        super().__init__(name, capacity)
        if min_gpus < 1 or not 0 <= reserve < capacity:
            raise ValueError(
                f"a reserve holds back nodes of at least 1 GPU and keeps 0 to "
                f"{capacity - 1} of the pool's {capacity} GPUs: got nodes of "
                f"{min_gpus}+ GPUs, {reserve} kept"
            )
        self.min_gpus = min_gpus
        self.reserve = reserve

    def allocate(self, gpus: int, needs: Resources = NONE) -> Grant | Cause:
        held_back = gpus >= self.min_gpus and self.capacity - self.allocated - gpus < self.reserve
        if held_back and needs == NONE:
            return Cause.CAPACITY
        return super().allocate(gpus, needs)  # refuses needs beyond GPUs, too
