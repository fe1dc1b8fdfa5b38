"""Loaning terms and the quota checks that go with them (pure)."""

from __future__ import annotations

from dxpool.api.v1 import resources_pb2 as pb
from dxpool.broker.nodes import loaning
from dxpool.broker.nodes.tenants import breach, charged


def tenant(guaranteed: int | None, gpus: int = 0, borrowed: int = 0, **quota: int) -> pb.Tenant:
    record = pb.Tenant(
        name="tenants/t",
        usage=pb.TenantUsage(gpus=gpus, borrowed_gpus=borrowed),
        quota=pb.TenantQuota(**quota),
    )
    if guaranteed is not None:
        record.quota.guaranteed_gpus = guaranteed
    return record


def test_a_tenant_without_a_guarantee_takes_no_part() -> None:
    assert loaning.terms(None, 4) == loaning.NOT_LOANING
    assert loaning.terms(tenant(None), 4) == loaning.NOT_LOANING
    assert not loaning.takes_part(tenant(None, gpus=3))


def test_within_the_guarantee_guaranteed_beyond_it_borrowed() -> None:
    record = tenant(8, gpus=6, borrowed=2)  # 4 guaranteed in use, 2 borrowed
    assert loaning.guaranteed_in_use(record.usage) == 4
    assert loaning.guarantee_left(record) == 4
    assert loaning.terms(record, 4) == loaning.LoanTerms(borrowed=False, within_guarantee=True)
    assert loaning.terms(record, 5) == loaning.LoanTerms(borrowed=True, within_guarantee=False)
    assert loaning.terms(tenant(0), 1).borrowed  # a tenant that only borrows


def test_the_borrow_limit_and_a_guaranteed_grow_are_quota_refusals() -> None:
    record = tenant(4, gpus=6, borrowed=2, borrow_limit=3)
    assert breach("t", record, ["H100"]) is None  # borrows a third GPU
    refused = breach("t", record, ["H100", "H100"])
    assert refused is not None and refused.metadata["limit"] == "borrow_limit"
    hard = tenant(4, gpus=4, borrow_limit=0)
    assert breach("t", hard, ["H100"]) is not None  # a hard quota at the guarantee
    assert breach("t", hard, ["H100"], nodes=0, borrowed=False) is not None  # grow
    grow = breach("t", tenant(4, gpus=2), ["H100"] * 3, nodes=0, borrowed=False)
    assert grow is not None and grow.metadata["limit"] == "guaranteed_gpus"


def test_borrowed_usage_moves_with_the_totals() -> None:
    usage = charged(pb.TenantUsage(), ["H100"] * 3, borrowed=True)
    assert (usage.gpus, usage.nodes, usage.borrowed_gpus, usage.borrowed_nodes) == (3, 1, 3, 1)
    usage = charged(usage, ["H100"], sign=-1, nodes=0, borrowed=True)  # a shrink
    assert (usage.gpus, usage.borrowed_gpus, usage.borrowed_nodes) == (2, 2, 1)
    usage = charged(usage, ["H100"] * 2, sign=-1, borrowed=True)
    assert usage == pb.TenantUsage()


def test_priorities_are_capped_by_the_quota() -> None:
    assert loaning.priority_allowed(None, 1000)
    assert not loaning.priority_allowed(None, 1001)
    capped = tenant(None, max_priority=5)
    assert loaning.priority_allowed(capped, 5) and not loaning.priority_allowed(capped, 6)
