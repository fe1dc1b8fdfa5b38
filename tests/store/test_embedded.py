"""The etcd test helpers themselves: a member keeps its data across kill and restart, and
a cluster can name and move its leader."""

from __future__ import annotations

from dxpool.store.client import connect
from dxpool.store.embedded import EmbeddedEtcd, EtcdCluster


def test_killed_member_restarts_on_its_data_and_port(private_etcd: EmbeddedEtcd) -> None:
    client = connect(private_etcd.endpoint, timeout_s=2)
    try:
        client.put("/kept", b"v")
        endpoint = private_etcd.endpoint
        private_etcd.kill()
        assert not private_etcd.running
        private_etcd.start()
        assert private_etcd.endpoint == endpoint
        value, _ = client.get("/kept")
        assert value == b"v"
    finally:
        client.close()


def test_cluster_names_and_moves_its_leader(etcd_cluster: EtcdCluster) -> None:
    leader = etcd_cluster.leader()
    target = next(m for m in etcd_cluster.members if m is not leader)
    etcd_cluster.move_leader(target)
    assert etcd_cluster.leader() is target
    assert len(etcd_cluster.endpoints.split(",")) == 3
