"""PlanNode with the tenant's quota and what preemption would do.

``dxpool node plan`` answers where a compose would go now (the placement plan, as
:meth:`Composer.plan` makes it), and besides:

* **quota**: a request its tenant's quota refuses now gets an ``unsatisfied`` line
  naming the limit, and no placement (a compose would be refused, or wait with
  ``queue``); so does a priority above the tenant's ``max_priority``, and a request
  that would borrow while lending is paused;
* **capacity kind**: ``preemptible`` says the node would be borrowed (its tenant is
  beyond its guarantee);
* **preemption**: when nothing fits now, the borrowed nodes a queued compose would take
  GPUs from (shrinks first, then whole nodes at least cost:
  :mod:`dxpool.broker.nodes.preemption`), with the placement it would then get.

Nothing is written: the plan is the dispatcher's decision on the same snapshot, not a
reservation.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from dxpool.api.v1 import nodes_pb2
from dxpool.api.v1 import resources_pb2 as pb
from dxpool.broker.control.dispatcher import holders, node_ask
from dxpool.broker.nodes import loaning
from dxpool.broker.nodes.compose import Composer
from dxpool.broker.nodes.compose_gate import ComposeGate
from dxpool.broker.nodes.preemption import plan as plan_preemption
from dxpool.broker.nodes.tenants import breach
from dxpool.errors import FailedPrecondition, ResourceExhausted


class Planner:
    """PlanNode (see the module docstring). Thread-safe; no state of its own."""

    def __init__(
        self, composer: Composer, gate: ComposeGate, clock: Callable[[], float] = time.time
    ) -> None:
        self._composer = composer
        self._gate = gate
        self._clock = clock

    def plan(self, request: nodes_pb2.ComposeNodeRequest) -> nodes_pb2.NodePlan:
        result = self._composer.plan(request)  # validates first; raises UNKNOWN_MODEL
        spec = request.spec
        record = self._gate.tenant(spec.tenant)
        refusal = self._refusal(spec, record)
        if refusal:
            result.unsatisfied.append(refusal)
            result.ClearField("host")
            del result.gpus[:]
            return result
        terms = loaning.terms(record, spec.gpus.count) if spec.tenant else loaning.NOT_LOANING
        result.preemptible = terms.borrowed
        if result.host:
            return result
        probe = pb.VirtualNode(name="nodes/(plan)", spec=spec)
        found = plan_preemption(
            node_ask(probe, terms.within_guarantee),
            holders(self._composer.cache, self._clock()),
            self._composer.index.snapshot(),
            self._composer.latency.current(),
        )
        if found is None:
            return result
        placement = found.placements[0]
        result.host = f"hosts/{placement.host}"
        result.gpus.extend(
            pb.GpuBinding(gpu=b.gpu, model=b.model, host_slot=b.host_slot, latency_ns=b.latency_ns)
            for b in placement.bindings
        )
        for cut in found.cuts:
            node = next(n for n in cut.holder.nodes if n.name == cut.node)
            result.preemptions.append(
                nodes_pb2.PlannedPreemption(
                    node=cut.node,
                    gpus=list(cut.gpus),
                    tenant=cut.holder.tenant,
                    priority=cut.holder.priority,
                    reason=cut.reason,
                    gpu_hours=node.gpu_hours,
                )
            )
        result.unsatisfied.append(
            f"nothing is free now; with queue the request would take GPUs from "
            f"{len(found.cuts)} borrowed node(s) after their notice"
        )
        return result

    def _refusal(self, spec: pb.NodeSpec, record: pb.Tenant | None) -> str:
        if not spec.tenant:
            return ""
        quota = breach(spec.tenant, record, [spec.gpus.model] * spec.gpus.count)
        if quota is not None:
            return f"quota: {quota.message}"
        try:
            self._gate.check(spec, spec.gpus.count)
        except (FailedPrecondition, ResourceExhausted) as error:
            return error.message
        return ""


__all__ = ["Planner"]
