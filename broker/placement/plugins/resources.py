"""Balance of a host's CPU and memory against its proxy slots.

A host that declares CPU and memory strands whatever it has left of one when another
runs out: free slots with no CPU to run their GPUs' work, or CPU with no slot to hang a
GPU on. :class:`HostResourceBalance` prefers the host whose leftovers after the node
stay in proportion: the share of its CPU (and of its memory) left free should match the
share of its proxy slots left free, so a CPU-heavy node goes where CPU is plentiful per
free slot and a GPU-heavy one where slots are.

The raw score depends on the host's CPU and memory, not only on the proposal's takes and
free slots, so the plugin does not score by host class: a pipeline with it scores every
host for every request. It is therefore not in the default pipeline (see
``bench/RESULTS.md`` for what it did on the openb trace).
"""

from __future__ import annotations

from collections.abc import Sequence

from dxpool.broker.placement.framework import Proposal, scale_to_best
from dxpool.broker.placement.model import PlacementRequest

BALANCED = 2.0
"""The raw score of a proposal that leaves CPU, memory and slots in the same proportion
(or that asks for no CPU or memory, or lands on a host that declares none)."""


class HostResourceBalance:
    """Prefers the host whose free CPU and memory after the node are the same share of
    what it declares as its free proxy slots are of its slots.

    Raw score: ``2 - |cpu_left/cpu - slots_left/slots| - |memory_left/memory -
    slots_left/slots|`` (0 to 2, higher better); a resource the host does not declare or
    the request does not ask for counts as balanced. Normalized by the best.
    """

    name = "host_resource_balance"
    by_host_class = False  # reads the host's CPU and memory

    def score(self, request: PlacementRequest, proposal: Proposal) -> float:
        if not (request.cpu_cores or request.host_memory_mib):
            return BALANCED
        host = proposal.host
        capacity = host.slot_capacity
        if capacity <= 0:
            return BALANCED
        slots_left = (proposal.free_slots - proposal.gpu_count) / capacity
        raw = BALANCED
        if host.cpu_cores:
            cpu_left = host.cpu_cores - host.used_cpu_cores - request.cpu_cores
            raw -= abs(cpu_left / host.cpu_cores - slots_left)
        if host.memory_mib:
            memory_left = host.memory_mib - host.used_memory_mib - request.host_memory_mib
            raw -= abs(memory_left / host.memory_mib - slots_left)
        return max(raw, 0.0)

    def normalize(self, scores: Sequence[float]) -> list[float]:
        return scale_to_best(scores)
