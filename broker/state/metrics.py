"""Prometheus metrics of the broker (``dxpool_`` prefix, base units, ``_total`` counters)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

COMPOSE_TOTAL = Counter("dxpool_compose_total", "ComposeNode calls by outcome", ["result"])
COMPOSE_CONFLICTS = Counter(
    "dxpool_compose_conflicts_total", "ComposeNode commits that lost a compare and were retried"
)
TRANSACTION_CONFLICTS = Counter(
    "dxpool_transaction_conflicts_total",
    "Read-modify-commit transactions that lost a compare to a concurrent change, by operation",
    ["operation"],
)
RELEASE_TOTAL = Counter(
    "dxpool_release_total",
    "Releases started (ReleaseNode, ReleaseGang members); one of a node already "
    "RELEASING or RELEASED changes nothing and is not counted",
)
LEADER = Gauge(
    "dxpool_leader",
    "1 while this broker is the elected leader and runs the singleton duties (host loss, "
    "fencing, garbage collection, attach deadlines), else 0",
)
NODE_TRANSITIONS = Counter(
    "dxpool_node_transitions_total", "Node state changes made by the controller", ["state"]
)
GPU_FREED = Counter("dxpool_gpus_freed_total", "GPUs returned to the pool after a confirmed detach")


def method_label(method: str) -> str:
    """The ``method`` label every metric uses: ``Service.Method``, as the RPC metrics
    name it (``/dxpool.v1.NodeService/WatchNodes`` -> ``NodeService.WatchNodes``), so one
    method's series join across metrics."""
    if not method.startswith("/"):
        return method
    service, _, name = method[1:].partition("/")
    return f"{service.rsplit('.', 1)[-1]}.{name}"


RPC_TOTAL = Counter(
    "dxpool_rpc_total",
    "Broker RPCs by method and the status code they ended with (OK, NOT_FOUND, ...)",
    ["method", "code"],
)
RPC_SECONDS = Histogram(
    "dxpool_rpc_duration_seconds",
    "Broker RPC latency",
    ["method"],
    buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0),
)
COMPOSE_STAGE_SECONDS = Histogram(
    "dxpool_compose_stage_duration_seconds",
    "Time ComposeNode spends in each stage: placement, commit (the etcd transaction)",
    ["stage"],
    buckets=(0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.1),
)
COMPOSE_GROUP_SIZE = Histogram(
    "dxpool_compose_group_size",
    "Composes committed by one etcd transaction (composes waiting for one host commit together)",
    buckets=(1, 2, 4, 8, 16, 32),
)
RPC_UNDECODABLE = Counter(
    "dxpool_rpc_undecodable_total",
    "Requests rejected because their payload is not the method's request message",
    ["method"],
)
RPC_OVERSIZED = Counter(
    "dxpool_rpc_oversized_total",
    "Requests refused undecoded because they were larger than their method's limit",
    ["method"],
)

# Streams (broker/api/streams.py, broker/api/node_watch.py).
STREAMS_OPEN = Gauge("dxpool_streams_open", "Streaming RPCs being served now", ["method"])
STREAMS_REJECTED = Counter(
    "dxpool_streams_rejected_total",
    "Streaming RPCs refused because a limit was reached",
    ["method"],
)
WATCH_CUTOFFS = Counter(
    "dxpool_watch_cutoffs_total", "WatchNodes streams the broker ended early", ["reason"]
)
AUDIT_WRITE_FAILURES = Counter(
    "dxpool_audit_write_failures_total",
    "Audit records that could not be written to etcd (the call itself went through)",
)
QUEUE_ADMISSIONS = Counter(
    "dxpool_queue_admissions_total",
    "Queued requests (nodes and gangs) by what became of them: admitted, failed",
    ["result"],
)
QUEUE_WAIT_SECONDS = Histogram(
    "dxpool_queue_wait_seconds",
    "How long admitted requests waited in the queue",
    buckets=(0.1, 0.5, 1, 5, 15, 60, 300, 900, 3600, 14400),
)
PREEMPTION_NOTICES = Counter(
    "dxpool_preemption_notices_total",
    "Preemption notices given to borrowed nodes, by kind: shrink or release",
    ["kind"],
)
PREEMPTIONS = Counter(
    "dxpool_preemptions_total",
    "Preemption notices carried out or withdrawn, by outcome: released, shrunk, withdrawn",
    ["outcome"],
)
GANG_CHUNKS = Counter(
    "dxpool_gang_chunk_commits_total",
    "Transactions committing members of gangs too large for one, by outcome",
    ["result"],
)
AUDIT_REFUSED_CALLS = Counter(
    "dxpool_audit_refused_calls_total",
    "Mutating calls refused for want of authentication or permission: counted here, not "
    "recorded in the audit log one by one (role: the caller's, or none)",
    ["rpc", "code", "role"],
)
AUDIT_FIELDS_DIGESTED = Counter(
    "dxpool_audit_fields_digested_total",
    "Request fields recorded in the audit log by size and digest instead of their content",
    ["field"],
)

# The garbage collector's policy (dxpool/gc_policy.py): collections it runs between decisions.
GC_COLLECTIONS = Counter(
    "dxpool_gc_collections_total",
    "Collections the broker's collector policy ran, by kind: start (after the load), "
    "young_batch (young objects collected and the survivors frozen, between decisions), "
    "full_reclaim (everything unfrozen, collected and frozen again)",
    ["kind"],
)
GC_SECONDS = Histogram(
    "dxpool_gc_collection_duration_seconds",
    "How long each collection of the broker's collector policy took, by kind",
    ["kind"],
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5),
)
GC_FROZEN = Gauge(
    "dxpool_gc_frozen_objects",
    "Objects frozen out of the garbage collector's generations after the policy's last "
    "collection (the loaded inventory and what survived young collections)",
)


def observe_collection(kind: str, seconds: float, frozen: int) -> None:
    """A :data:`~dxpool.gc_policy.CollectionObserver` that feeds the metrics above."""
    GC_COLLECTIONS.labels(kind=kind).inc()
    GC_SECONDS.labels(kind=kind).observe(seconds)
    GC_FROZEN.set(frozen)
