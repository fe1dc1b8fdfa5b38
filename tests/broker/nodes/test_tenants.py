"""Quota arithmetic: charging, discharging and which limit a node would break."""

from __future__ import annotations

import pytest

from dxpool.api.v1 import resources_pb2 as pb
from dxpool.broker.nodes.tenants import breach, charged, check_quota
from dxpool.errors import InvalidArgument


def tenant(usage: pb.TenantUsage, **quota: object) -> pb.Tenant:
    return pb.Tenant(name="tenants/t", quota=pb.TenantQuota(**quota), usage=usage)  # type: ignore[arg-type]


def test_charged_adds_and_takes_away_one_node() -> None:
    usage = charged(pb.TenantUsage(), ["H100", "H100", "A100"])
    assert usage == pb.TenantUsage(gpus=3, nodes=1, gpus_by_model={"H100": 2, "A100": 1})
    again = charged(usage, ["H100"])
    assert again == pb.TenantUsage(gpus=4, nodes=2, gpus_by_model={"H100": 3, "A100": 1})
    back = charged(again, ["H100", "H100", "A100"], sign=-1)
    assert back == pb.TenantUsage(gpus=1, nodes=1, gpus_by_model={"H100": 1})
    assert charged(back, ["H100"], sign=-1) == pb.TenantUsage()  # no zero entries left
    assert usage.gpus == 3  # the input is not changed


def test_no_record_or_no_quota_is_no_limit() -> None:
    assert breach("t", None, ["H100"] * 64) is None
    assert breach("t", pb.Tenant(usage=pb.TenantUsage(gpus=10_000)), ["H100"]) is None


def test_each_limit_is_checked_against_usage_plus_the_node() -> None:
    used = pb.TenantUsage(gpus=3, nodes=1, gpus_by_model={"H100": 3})
    assert breach("t", tenant(used, gpus=4), ["A100"]) is None
    over = breach("t", tenant(used, gpus=4), ["A100", "A100"])
    assert over is not None and over.reason == "QUOTA_EXCEEDED"
    assert over.metadata == {
        "tenant": "t",
        "limit": "gpus",
        "quota": "4",
        "usage": "3",
        "requested": "2",
    }
    nodes = breach("t", tenant(used, nodes=1), ["A100"])
    assert nodes is not None and nodes.metadata["limit"] == "nodes"
    model = breach("t", tenant(used, gpus_by_model={"H100": 4}), ["H100", "H100"])
    assert model is not None and model.metadata["limit"] == "gpus_by_model[H100]"
    # A model without a limit of its own, and GPUs of no model yet, count in the total only.
    assert breach("t", tenant(used, gpus_by_model={"H100": 3}), ["A100", ""]) is None
    zero = breach("t", tenant(pb.TenantUsage(), nodes=0), ["H100"])
    assert zero is not None and "quota of 0 nodes" in zero.message


@pytest.mark.parametrize(
    "quota",
    [
        pb.TenantQuota(gpus=-1),
        pb.TenantQuota(nodes=1_000_001),
        pb.TenantQuota(gpus_by_model={"": 1}),
        pb.TenantQuota(gpus_by_model={"H100": -1}),
        pb.TenantQuota(gpus_by_model={"H 100": 1}),
        pb.TenantQuota(gpus_by_model={f"m{i}": 1 for i in range(65)}),
    ],
)
def test_bad_quotas_are_refused(quota: pb.TenantQuota) -> None:
    with pytest.raises(InvalidArgument):
        check_quota(quota)


def test_good_quotas_pass() -> None:
    check_quota(pb.TenantQuota())
    check_quota(pb.TenantQuota(gpus=0, nodes=1_000_000, gpus_by_model={"H100": 8, "a.b-c_d": 0}))
