"""The host's registration: the Host record an agent sends in its hello.

``hosts/{host}`` is persistent (no lease), so the inventory remembers a host while its
agent is down; the broker that opens the agent's session writes it, after checking it,
in the same transaction as the host's liveness record (see
:mod:`dxpool.broker.control.agent_sessions`).
"""

from __future__ import annotations

from dxpool.api.v1 import resources_pb2
from dxpool.hostagent.config import AgentConfig
from dxpool.hostagent.status import now_timestamp
from dxpool.names import host_name


def host_record(config: AgentConfig) -> resources_pb2.Host:
    """The Host record an agent registers (output-only fields left unset)."""
    return resources_pb2.Host(
        name=host_name(config.host_id),
        location=resources_pb2.Location(site=config.site, pod=config.pod, rack=config.rack),
        agent_endpoint=config.agent_endpoint,
        slot_capacity=config.slot_capacity,
        labels=dict(config.labels),
        driver=config.driver,
        cpu_cores=config.cpu_cores,
        memory_mib=config.memory_mib,
        register_time=now_timestamp(),
    )


__all__ = ["host_record"]
