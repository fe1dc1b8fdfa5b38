"""Serving the queue: one pass over the waiting requests, in order.

The leading broker runs a pass whenever capacity may have freed (a GPU freed, a node
released or shrunk, a box added or uncordoned, a host back, a quota raised, a request
queued) and once a second (queue deadlines). A pass looks at the waiting requests in
queue order (:mod:`dxpool.broker.state.queue_order`) and for each:

1. a request past its deadline, or whose tenant was deleted, fails;
2. one that fits now is admitted (:mod:`dxpool.broker.nodes.admission`): placed and
   committed with one compare-and-swap on its record, so another broker serving the
   same request at the same moment (a deposed leader) cannot commit it twice;
3. one that does not fit may take GPUs from borrowed nodes
   (:mod:`dxpool.broker.nodes.preemption`): within its tenant's guarantee any borrowed node
   of another tenant, else borrowed nodes of lower priority. The victims get notices
   (:mod:`dxpool.broker.control.notices`) and the request names them in
   ``queue.preempting``; it is admitted like any other once their GPUs are free;
4. otherwise it keeps waiting, its ``queue.reason`` saying why (written only when the
   reason changes, so a waiting queue costs no writes).

**What a preempting request keeps.** GPUs freed by its victims would otherwise go to
whatever asks first. Two rules keep them for it. Within one pass, a request behind a
preempting one is admitted only if the usable free GPUs it could use, less those the
preempting requests ahead still wait for, hold it. And while a request within its
tenant's guarantee waits for capacity, its ``queue.reclaiming`` pauses lending
(:mod:`dxpool.broker.nodes.compose_gate`): no tenant borrows GPUs it could use.

The queue is best effort: a request that does not fit does not hold back smaller ones
behind it (beyond the rule above).

**What a pass costs.** A pass is bounded by the placements it makes
(``max_placements``): an admission that got as far as placing counts (``Outcome.
placed``), one that stopped before (its tenant's quota, paused lending, a deadline) does
not, so any number of requests held back by their quota cannot use up the bound and
starve requests of other tenants behind them. Requests with the same placement request
as one that just found no capacity are not placed again in that pass, and an ask the
preemption planner found nothing for is not planned again in that pass while the
candidates are the same (the pass's snapshot does not change, and the candidates only
lose members as notices go out), so a long queue of one shape costs one placement and
one plan per pass, not one per request.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from dxpool import lifecycle
from dxpool.api.v1 import resources_pb2 as pb
from dxpool.broker.control.notices import Notices
from dxpool.broker.nodes import loaning
from dxpool.broker.nodes.admission import ADMITTED, WAITING, Admitter, Outcome
from dxpool.broker.nodes.compose import Composer
from dxpool.broker.nodes.compose_gate import ComposeGate
from dxpool.broker.nodes.fit import placement_request
from dxpool.broker.nodes.preemption import Ask, HeldGpu, HeldNode, Holder, plan, usable_free
from dxpool.broker.placement import PlacementRequest, Snapshot
from dxpool.broker.state import metrics
from dxpool.broker.state.cache import Cache
from dxpool.broker.state.queue_index import QueueIndex, models_overlap
from dxpool.broker.state.queue_order import Waiting
from dxpool.broker.state.records import seconds
from dxpool.names import parse_gang, parse_gpu, parse_host, parse_node

log = logging.getLogger(__name__)

MAX_PLACEMENTS_PER_PASS = 64


class GangAdmitter(Protocol):
    """Serves a QUEUED gang (:mod:`dxpool.broker.nodes.gang_chunks`)."""

    def admit_queued(self, gang_id: str) -> Outcome: ...

    def note_queued(self, gang_id: str, reason: str, *, reclaiming: bool | None = None) -> bool: ...

    def queued(self, gang_id: str) -> pb.GangRecord | None: ...


def holders(cache: Cache, now: float) -> list[Holder]:
    """Every borrowed node or gang that holds GPUs and is under no notice, as the
    planner sees it. A gang with any member under a notice is left out whole."""
    nodes: dict[str, list[HeldNode]] = {}
    meta: dict[str, tuple[str, int]] = {}
    noticed: set[str] = set()
    for _, record in cache.nodes.items():
        node = record.value
        if not node.preemptible or node.state not in lifecycle.LOSABLE_NODE_STATES:
            continue
        key = node.gang or node.name
        if node.HasField("preemption"):
            noticed.add(key)
            continue
        gpus = []
        for binding in node.gpus:
            ref = parse_gpu(binding.gpu)
            gpus.append(HeldGpu(binding.gpu, ref.box, ref.slot, binding.model, binding.host_slot))
        ran = now - seconds(node.ready_time) if node.HasField("ready_time") else 0.0
        held = HeldNode(
            node.name,
            parse_host(node.host) if node.host else "",
            tuple(gpus),
            node.spec.min_gpus,
            len(gpus) * max(ran, 0.0) / 3600.0,
        )
        nodes.setdefault(key, []).append(held)
        meta[key] = (node.spec.tenant, node.spec.priority)
    return [
        Holder(key, meta[key][0], meta[key][1], tuple(held))
        for key, held in sorted(nodes.items())
        if key not in noticed
    ]


def node_ask(node: pb.VirtualNode, within_guarantee: bool) -> Ask:
    host = parse_host(node.spec.host) if node.spec.host else None
    return Ask(
        (placement_request(node.spec, host),),
        node.spec.tenant,
        node.spec.priority,
        within_guarantee,
    )


def gang_requests(gang: pb.GangRecord) -> tuple[PlacementRequest, ...]:
    """One placement request per member of ``gang``."""
    specs = list(gang.members) if len(gang.members) > 1 else list(gang.members) * gang.size
    return tuple(
        placement_request(spec, parse_host(spec.host) if spec.host else None) for spec in specs
    )


def _request_key(request: PlacementRequest) -> PlacementRequest:
    return request  # frozen and hashable: equal requests place equally on one snapshot


@dataclass
class _Pass:
    """What one pass keeps as it goes."""

    snapshot: Snapshot
    placements: int = 0
    promised: list[tuple[str, int, str]] | None = None  # (model, GPUs, request) ahead
    no_capacity: dict[tuple[PlacementRequest, ...], str] | None = None
    holders: list[Holder] | None = None
    free: dict[tuple[PlacementRequest, ...], int] | None = None
    unplannable: set[Ask] | None = None  # asks the planner found nothing for (``holders``)

    def __post_init__(self) -> None:
        self.promised = []
        self.no_capacity = {}
        self.free = {}
        self.unplannable = set()


class Dispatcher:
    """One pass over the queue at a time (see the module docstring); run by the leader."""

    def __init__(
        self,
        composer: Composer,
        queue: QueueIndex,
        gate: ComposeGate,
        admitter: Admitter,
        notices: Notices,
        *,
        gangs: GangAdmitter | None = None,
        max_placements: int = MAX_PLACEMENTS_PER_PASS,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._composer = composer
        self._cache = composer.cache
        self._queue = queue
        self._gate = gate
        self._admitter = admitter
        self._notices = notices
        self._gangs = gangs
        self._max_placements = max_placements
        self._clock = clock

    def serve(self) -> int:
        """One pass; returns how many requests were admitted."""
        order = self._queue.ordered()
        if not order:
            return 0
        state = _Pass(self._composer.index.snapshot())
        admitted = 0
        for entry in order:
            if entry.name.startswith("gangs/"):
                admitted += self._serve_gang(entry, state)
            else:
                admitted += self._serve_node(entry, state)
        return admitted

    # -- nodes ---------------------------------------------------------------------------

    def _serve_node(self, entry: Waiting, state: _Pass) -> int:
        node_id = parse_node(entry.name)
        node = self._admitter.queued(node_id)
        if node is None:
            return 0
        ask = node_ask(node, self._within_guarantee(node.spec, entry.gpus))
        blocked = self._promised_away(entry, ask, state)
        if blocked is not None and not self._expired(node.queue):
            self._admitter.note(node_id, blocked, reclaiming=ask.within_guarantee)
            return 0
        known = state.no_capacity.get(ask.requests) if state.no_capacity is not None else None
        if known is not None and not self._expired(node.queue):
            self._after_no_capacity(entry, node.queue, ask, known, state)
            return 0
        if state.placements >= self._max_placements:
            return 0
        outcome = self._admitter.admit(node_id)
        self._composer.between_decisions()
        if outcome.placed:
            state.placements += 1
        if outcome.kind == ADMITTED:
            self._admitted(node.queue)
            return 1
        if outcome.kind != WAITING:
            if outcome.kind == "failed":
                metrics.QUEUE_ADMISSIONS.labels(result="failed").inc()
            return 0
        if outcome.capacity:
            assert state.no_capacity is not None
            state.no_capacity[ask.requests] = outcome.reason
            self._after_no_capacity(entry, node.queue, ask, outcome.reason, state)
        else:
            self._admitter.note(node_id, outcome.reason, reclaiming=False)
        return 0

    def _expired(self, queue: pb.QueueStatus) -> bool:
        return queue.HasField("deadline") and self._clock() > seconds(queue.deadline)

    def _within_guarantee(self, spec: pb.NodeSpec, gpus: int) -> bool:
        return loaning.terms(self._gate.tenant(spec.tenant), gpus).within_guarantee

    def _admitted(self, queue: pb.QueueStatus) -> None:
        metrics.QUEUE_ADMISSIONS.labels(result="admitted").inc()
        metrics.QUEUE_WAIT_SECONDS.observe(max(0.0, self._clock() - seconds(queue.enqueue_time)))

    def _promised_away(self, entry: Waiting, ask: Ask, state: _Pass) -> str | None:
        """Why ``entry`` may not take what is free: GPUs being freed for preempting
        requests ahead of it; None when what is free holds it and them."""
        assert state.promised is not None and state.free is not None
        ahead = [(m, n, who) for m, n, who in state.promised if models_overlap(m, entry.model)]
        if not ahead:
            return None
        free = state.free.get(ask.requests)
        if free is None:
            free = state.free[ask.requests] = usable_free(state.snapshot, ask)
        owed = sum(n for _, n, _ in ahead)
        if free - owed >= entry.gpus:
            return None
        names = ", ".join(sorted({who for _, _, who in ahead})[:3])
        return (
            f"the GPUs being freed are taken for requests ahead of it ({names}); "
            f"{free} usable GPUs free, {owed} owed to them"
        )

    def _after_no_capacity(
        self, entry: Waiting, queue: pb.QueueStatus, ask: Ask, reason: str, state: _Pass
    ) -> None:
        """A request that does not fit: wait for its victims, preempt, or just wait."""
        assert state.promised is not None
        waiting_for = [v for v in queue.preempting if self._notices.outstanding(v, entry.name)]
        if waiting_for:
            state.promised.append((entry.model, entry.gpus, entry.name))
            self._note(
                entry,
                f"waiting for {len(waiting_for)} preempted node(s) to let go of their "
                f"GPUs ({', '.join(waiting_for[:3])})",
                ask.within_guarantee,
            )
            return
        assert state.unplannable is not None
        if ask in state.unplannable:
            self._note(entry, reason, ask.within_guarantee)
            return
        if state.holders is None:
            state.holders = holders(self._cache, self._clock())
        found = plan(ask, state.holders, state.snapshot, self._composer.latency.current())
        if found is None:
            state.unplannable.add(ask)
        else:
            what = "lent capacity taken back" if ask.within_guarantee else "lower priority"
            text = (
                f"{what}: waiting for {len(found.cuts)} node(s) to let go of "
                f"{found.freed} GPUs after their notice"
            )
            if self._notices.issue(entry.name, found, reclaiming=ask.within_guarantee, reason=text):
                state.promised.append((entry.model, entry.gpus, entry.name))
                state.holders = None  # the victims are under notice now
                state.unplannable.clear()  # judged on the candidates before
                return
        self._note(entry, reason, ask.within_guarantee)

    def _note(self, entry: Waiting, reason: str, reclaiming: bool) -> None:
        if entry.name.startswith("gangs/"):
            if self._gangs is not None:
                self._gangs.note_queued(parse_gang(entry.name), reason, reclaiming=reclaiming)
        else:
            self._admitter.note(parse_node(entry.name), reason, reclaiming=reclaiming)

    # -- gangs ---------------------------------------------------------------------------

    def _serve_gang(self, entry: Waiting, state: _Pass) -> int:
        if self._gangs is None:
            return 0
        gang_id = parse_gang(entry.name)
        gang = self._gangs.queued(gang_id)
        if gang is None:
            return 0
        first = gang.members[0] if gang.members else pb.NodeSpec()
        ask = Ask(
            gang_requests(gang),
            first.tenant,
            first.priority,
            self._within_guarantee(first, entry.gpus),
        )
        blocked = self._promised_away(entry, ask, state)
        if blocked is not None and not self._expired(gang.queue):
            self._gangs.note_queued(gang_id, blocked, reclaiming=ask.within_guarantee)
            return 0
        if state.placements >= self._max_placements:
            return 0
        outcome = self._gangs.admit_queued(gang_id)
        self._composer.between_decisions()
        if outcome.placed:
            state.placements += len(ask.requests)
        if outcome.kind == ADMITTED:
            self._admitted(gang.queue)
            return 1
        if outcome.kind == WAITING:
            if outcome.capacity:
                self._after_no_capacity(entry, gang.queue, ask, outcome.reason, state)
            else:
                self._gangs.note_queued(gang_id, outcome.reason, reclaiming=False)
        elif outcome.kind == "failed":
            metrics.QUEUE_ADMISSIONS.labels(result="failed").inc()
        return 0


__all__ = ["Dispatcher", "GangAdmitter", "gang_requests", "holders", "node_ask"]
