"""The verdict on etcd failures, from errors real clients raise against real servers."""

from __future__ import annotations

from collections.abc import Iterator

import etcd3
import grpc
import pytest

from dxpool.store.client import EtcdAddress, connect
from dxpool.store.embedded import EmbeddedEtcd, free_port
from dxpool.store.errors import Applied, classify, unavailable


@pytest.fixture
def closed_client() -> Iterator[etcd3.MultiEndpointEtcd3Client]:
    """A client of a port nothing listens on, whose endpoint rests a minute after failing."""
    client = connect([EtcdAddress("127.0.0.1", free_port())], timeout_s=1, retry_after_s=60)
    yield client
    client.close()


def test_refused_connection_was_not_applied(closed_client: etcd3.MultiEndpointEtcd3Client) -> None:
    with pytest.raises(etcd3.exceptions.ConnectionFailedError) as raised:
        closed_client.put("/k", "v")
    failure = classify(raised.value)
    assert failure is not None
    assert (failure.code, failure.applied, failure.outage) == ("UNAVAILABLE", Applied.NO, True)
    assert "Connection refused" in failure.detail
    error = unavailable(failure, write=True)
    assert error.code == grpc.StatusCode.UNAVAILABLE
    assert error.reason == "ETCD_UNAVAILABLE"
    assert "nothing was changed" in error.message


def test_resting_endpoints_are_an_outage_not_applied(
    closed_client: etcd3.MultiEndpointEtcd3Client,
) -> None:
    with pytest.raises(etcd3.exceptions.ConnectionFailedError):
        closed_client.get("/k")
    with pytest.raises(etcd3.exceptions.NoServerAvailableError) as raised:
        closed_client.get("/k")
    failure = classify(raised.value)
    assert failure is not None
    assert (failure.code, failure.applied, failure.outage) == ("NO_ENDPOINT", Applied.NO, True)


def test_timeout_leaves_a_write_unknown(private_etcd: EmbeddedEtcd) -> None:
    client = connect(private_etcd.endpoint, timeout_s=0.3)
    client.get("/k")  # connected: the write below is sent, then never answered
    private_etcd.pause()
    try:
        with pytest.raises(etcd3.exceptions.ConnectionTimeoutError) as raised:
            client.put("/k", "v")
    finally:
        private_etcd.resume()
        client.close()
    failure = classify(raised.value)
    assert failure is not None
    assert (failure.code, failure.applied, failure.outage) == (
        "DEADLINE_EXCEEDED",
        Applied.UNKNOWN,
        True,
    )
    write_error = unavailable(failure, write=True)
    assert write_error.code == grpc.StatusCode.UNAVAILABLE
    assert write_error.reason == "ETCD_OUTCOME_UNKNOWN"
    assert "same request_id" in write_error.message
    assert unavailable(failure, write=False).reason == "ETCD_UNAVAILABLE"


def test_raw_rpc_error_of_a_rejected_request(etcd_client: etcd3.MultiEndpointEtcd3Client) -> None:
    # python3-etcd3 passes NOT_FOUND through as a raw grpc.RpcError.
    with pytest.raises(grpc.RpcError) as raised:
        etcd_client.revoke_lease(987654321)
    failure = classify(raised.value)
    assert failure is not None
    assert (failure.code, failure.applied, failure.outage) == ("NOT_FOUND", Applied.NO, False)
    assert "lease not found" in failure.detail


def test_other_errors_are_not_etcd_failures() -> None:
    assert classify(KeyError("x")) is None
    assert classify(ValueError("bad value")) is None
