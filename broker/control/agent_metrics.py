"""Prometheus metrics of the agent service (``dxpool_agent_session`` prefix).

=================================================  ======================================
``dxpool_agent_sessions``                          sessions this broker holds now
``dxpool_agent_sessions_opened_total``             sessions opened (takeovers included)
``dxpool_agent_sessions_refused_total{reason}``    hellos refused, by the error's reason:
                                                   HOST_HELD, NOT_OWN_HOST,
                                                   UNAUTHENTICATED, ETCD_UNAVAILABLE, ...
``dxpool_agent_sessions_expired_total``            sessions ended because the agent fell
                                                   silent for its liveness TTL
``dxpool_agent_status_writes_total{result}``       ReportStatus outcomes: OK, STALE_SPEC,
                                                   SESSION_NOT_LIVE, and refusals by code
=================================================  ======================================
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge

SESSIONS = Gauge("dxpool_agent_sessions", "Agent sessions this broker holds")
SESSIONS_OPENED = Counter(
    "dxpool_agent_sessions_opened_total", "Agent sessions opened, takeovers included"
)
SESSIONS_REFUSED = Counter(
    "dxpool_agent_sessions_refused_total", "Agent hellos refused, by reason", ["reason"]
)
SESSIONS_EXPIRED = Counter(
    "dxpool_agent_sessions_expired_total",
    "Agent sessions ended because no heartbeat arrived for the liveness TTL",
)
STATUS_WRITES = Counter(
    "dxpool_agent_status_writes_total", "ReportStatus calls by outcome", ["result"]
)

__all__ = [
    "SESSIONS",
    "SESSIONS_EXPIRED",
    "SESSIONS_OPENED",
    "SESSIONS_REFUSED",
    "STATUS_WRITES",
]
