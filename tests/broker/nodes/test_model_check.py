"""A model no GPU in the pool has is FAILED_PRECONDITION (UNKNOWN_MODEL), confirmed with
etcd before it is said: real etcd, real cache."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from dxpool.api.v1 import nodes_pb2
from dxpool.api.v1 import resources_pb2 as pb
from dxpool.broker.nodes import model_check
from dxpool.broker.nodes.model_check import check_model_known, models_in_pool
from dxpool.broker.state.cache import Cache
from dxpool.errors import FailedPrecondition
from dxpool.store import keys as k
from dxpool.store.keys import KeySchema
from dxpool.store.typed import Store
from tests.conftest import Stubs, add_box


@pytest.fixture
def schema(key_prefix: str) -> KeySchema:
    return KeySchema(key_prefix)


@pytest.fixture
def store(etcd_client: Any, schema: KeySchema) -> Store:
    return Store(etcd_client, schema)


@pytest.fixture
def cache(etcd_client: Any, schema: KeySchema) -> Iterator[Cache]:
    cache = Cache(etcd_client, schema)
    cache.start()
    yield cache
    cache.stop()


def put_gpu(etcd_client: Any, schema: KeySchema, box: str, slot: int, model: str) -> None:
    gpu = pb.Gpu(name=f"boxes/{box}/gpus/{slot}", box=f"boxes/{box}", slot=slot, model=model)
    etcd_client.put(schema.gpu(box, slot), gpu.SerializeToString())


def test_a_model_in_the_pool_passes_in_any_spelling(
    etcd_client: Any, schema: KeySchema, store: Store, cache: Cache
) -> None:
    put_gpu(etcd_client, schema, "hbox", 0, "H100")
    assert cache.wait_for_revision(store.current_revision(), 5)
    check_model_known(store, cache, "H100")
    check_model_known(store, cache, "h100")
    check_model_known(store, cache, "")  # any model


def test_an_unknown_model_names_the_models_there_are(
    etcd_client: Any, schema: KeySchema, store: Store, cache: Cache
) -> None:
    put_gpu(etcd_client, schema, "hbox", 0, "H100")
    put_gpu(etcd_client, schema, "hbox", 1, "H100")
    put_gpu(etcd_client, schema, "abox", 0, "A100")
    assert cache.wait_for_revision(store.current_revision(), 5)
    assert models_in_pool(cache) == ["A100", "H100"]
    with pytest.raises(FailedPrecondition) as error:
        check_model_known(store, cache, "B200")
    assert error.value.reason == "UNKNOWN_MODEL"
    assert "no GPU of model 'B200' is in the pool" in error.value.message
    assert "the pool has A100, H100" in error.value.message
    assert error.value.metadata == {"model": "B200", "models": "A100,H100"}


def test_an_empty_pool_says_so(store: Store, cache: Cache) -> None:
    with pytest.raises(FailedPrecondition, match="the pool has no GPUs yet") as error:
        check_model_known(store, cache, "H100")
    assert error.value.metadata["models"] == ""


def test_a_model_etcd_has_but_the_cache_has_not_applied_yet_is_known(
    etcd_client: Any, schema: KeySchema, store: Store, cache: Cache
) -> None:
    # Holding the cache's lock keeps its watch from applying the new GPU: the first look
    # misses it, as it would right after another broker registered the box. The check
    # must then wait for the cache to reach etcd's revision (which lets the watch in)
    # and find the model, not call it unknown.
    with cache._lock:
        put_gpu(etcd_client, schema, "bbox", 0, "B200")
        assert cache.get(k.GPUS, "bbox/0") is None
        check_model_known(store, cache, "B200")
    assert cache.get(k.GPUS, "bbox/0") is not None


def test_a_cache_that_cannot_catch_up_reports_nothing(
    etcd_client: Any,
    schema: KeySchema,
    store: Store,
    cache: Cache,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    # A cache whose watch has stopped never reaches etcd's revision: the absence cannot
    # be confirmed, so the check stays silent and the caller answers the retryable
    # NO_CAPACITY instead of a wrong UNKNOWN_MODEL.
    monkeypatch.setattr(model_check, "CATCH_UP_TIMEOUT_S", 0.2)
    cache.stop()
    put_gpu(etcd_client, schema, "bbox", 0, "B200")
    check_model_known(store, cache, "B200")
    assert "cache behind etcd; model not confirmed unknown" in caplog.text


@pytest.mark.parametrize("rpc", ["ComposeNode", "PlanNode"])
def test_compose_and_plan_answer_unknown_model_over_grpc(stubs: Stubs, rpc: str) -> None:
    add_box(stubs, "box1", gpus=2, model="H100")
    spec = pb.NodeSpec(gpus=pb.GpuRequest(model="B200", count=1))
    request: Any = (
        nodes_pb2.PlanNodeRequest(spec=spec)
        if rpc == "PlanNode"
        else nodes_pb2.ComposeNodeRequest(spec=spec)
    )
    with pytest.raises(grpc.RpcError) as error:
        getattr(stubs.nodes, rpc)(request)
    assert error.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "the pool has H100" in (error.value.details() or "")
    status = rpc_status.from_call(error.value)
    assert status is not None
    info = error_details_pb2.ErrorInfo()
    assert status.details[0].Unpack(info)
    assert info.reason == "UNKNOWN_MODEL"


def test_a_known_model_with_nothing_free_stays_no_capacity(stubs: Stubs) -> None:
    add_box(stubs, "box1", gpus=2, model="H100")  # no host registered: nothing can fit
    request = nodes_pb2.ComposeNodeRequest(
        spec=pb.NodeSpec(gpus=pb.GpuRequest(model="h100", count=1))
    )
    with pytest.raises(grpc.RpcError) as error:
        stubs.nodes.ComposeNode(request)
    assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_a_model_last_in_listing_order_is_found(
    etcd_client: Any, schema: KeySchema, store: Store, cache: Cache
) -> None:
    for slot in range(5):
        put_gpu(etcd_client, schema, "hbox", slot, "H100")
    put_gpu(etcd_client, schema, "zbox", 0, "B200")  # last in listing order
    assert cache.wait_for_revision(store.current_revision(), 5)
    check_model_known(store, cache, "b200")
    assert models_in_pool(cache) == ["B200", "H100"]
    with pytest.raises(FailedPrecondition, match="the pool has B200, H100"):
        check_model_known(store, cache, "A100")


def test_a_model_set_is_known_when_any_of_its_models_is_in_the_pool(
    etcd_client: Any, schema: KeySchema, store: Store, cache: Cache
) -> None:
    put_gpu(etcd_client, schema, "abox", 0, "A100")
    assert cache.wait_for_revision(store.current_revision(), 5)
    check_model_known(store, cache, "H100|a100")
    with pytest.raises(FailedPrecondition) as error:
        check_model_known(store, cache, "H100|B200")
    assert error.value.reason == "UNKNOWN_MODEL"
    assert "no GPU of any model of 'H100|B200' is in the pool" in error.value.message
    assert "register boxes of one of H100, B200" in error.value.message
