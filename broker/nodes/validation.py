"""Checks on API requests, before anything is read or written.

Every function raises :class:`~dxpool.errors.InvalidArgument` with a message that names
the field and says what to change. The limits (``dxpool.limits``) protect etcd (keys,
record sizes), placement (loop bounds) and the people reading the output.

Free text (labels, reasons, locations, endpoints) must be printable; see
:mod:`dxpool.text`, which host agents use too.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from google.protobuf.descriptor import EnumDescriptor

from dxpool.api.v1 import resources_pb2 as pb
from dxpool.errors import InvalidArgument
from dxpool.fabric.overhead import check_slowdown
from dxpool.limits import (
    DEFAULT_PAGE_SIZE,
    MAX_EXCLUDED_HOSTS,
    MAX_GPU_MEMORY_MIB,
    MAX_GPUS_PER_BOX,
    MAX_GRACE_S,
    MAX_LABEL_KEY,
    MAX_LABEL_VALUE,
    MAX_LABELS,
    MAX_LATENCY_NS,
    MAX_LOCATION_PART,
    MAX_PAGE_SIZE,
    MAX_PCI_ID,
    MAX_PRIORITY,
    MAX_QUEUE_TIMEOUT_S,
    MAX_TENANT,
    MAX_TEXT,
)
from dxpool.names import ID_PATTERN, ID_RULE, check_id, parse_host
from dxpool.request import check_box_spread, check_host_resources, validate_gpu_request
from dxpool.text import check_labels, check_text

# Kept under their old names for callers that import them from here.
MAX_MEMORY_MIB = MAX_GPU_MEMORY_MIB
__all__ = [
    "MAX_GPUS_PER_BOX",
    "MAX_LABELS",
    "MAX_LABEL_KEY",
    "MAX_LABEL_VALUE",
    "MAX_LATENCY_NS",
    "MAX_MEMORY_MIB",
    "MAX_TEXT",
    "check_box",
    "check_enum",
    "check_excluded_hosts",
    "check_labels",
    "check_location",
    "check_node_spec",
    "check_page_size",
    "check_pci_id",
    "check_queue_timeout",
    "check_text",
]

_PCI_ID = re.compile(r"[0-9a-fA-F]{4}:[0-9a-fA-F]{4}")


def check_location(location: pb.Location, field: str) -> None:
    for part in ("site", "pod", "rack"):
        check_text(getattr(location, part), f"{field}.{part}", MAX_LOCATION_PART)


def check_enum(value: int, enum: EnumDescriptor, field: str) -> None:
    """``value`` must be one of ``enum``'s values (proto3 enums accept any int32)."""
    if value not in enum.values_by_number:
        names = ", ".join(v.name for v in enum.values)
        raise InvalidArgument(
            f"{field} {value} is not a {enum.name}; use one of {names}",
            reason="INVALID_ENUM",
        )


def check_pci_id(value: str, field: str) -> str:
    """Empty, or a PCI vendor:device id such as ``10de:2330``."""
    if value and (len(value) > MAX_PCI_ID or not _PCI_ID.fullmatch(value)):
        raise InvalidArgument(
            f"{field} {value[:MAX_PCI_ID]!r} is not a PCI id: use vendor:device in hex, "
            "e.g. 10de:2330, or leave it empty",
            reason="INVALID_PCI_ID",
        )
    return value


def check_node_spec(spec: pb.NodeSpec) -> None:
    """Validate a ComposeNode spec (GPU request, host pin, latency and slowdown bounds,
    tenant, labels, hosts excluded)."""
    validate_gpu_request(
        spec.gpus.model, spec.gpus.count, spec.gpus.min_memory_mib, spec.gpus.mixed_models
    )
    if spec.host:
        parse_host(spec.host)
    if not 0 <= spec.max_latency_ns <= MAX_LATENCY_NS:
        raise InvalidArgument(
            f"spec.max_latency_ns {spec.max_latency_ns} is out of range: use 0 (no bound) "
            f"up to {MAX_LATENCY_NS} (10s)",
            reason="INVALID_DURATION",
        )
    check_text(spec.workload, "spec.workload")
    check_slowdown(spec.max_slowdown, spec.workload, "spec.max_slowdown")
    check_enum(spec.affinity, pb.GpuAffinity.DESCRIPTOR, "spec.affinity")
    check_box_spread(
        spec.max_gpus_per_box,
        same_box=spec.affinity == pb.GPU_AFFINITY_BOX,
        field="spec.max_gpus_per_box",
    )
    check_text(spec.tenant, "spec.tenant", MAX_TENANT)
    if spec.tenant and not ID_PATTERN.fullmatch(spec.tenant):
        raise InvalidArgument(
            f"invalid spec.tenant {spec.tenant!r}: a tenant id is {ID_RULE}, or leave it "
            "empty to charge the node to no tenant",
            reason="INVALID_NAME",
        )
    check_labels(spec.labels, "spec.labels")
    check_labels(spec.host_selector, "spec.host_selector")
    check_host_resources(
        spec.cpu_cores, spec.host_memory_mib, "spec.cpu_cores", "spec.host_memory_mib"
    )
    _check_sharing(spec)
    check_excluded_hosts(spec.exclude_hosts)


def _check_sharing(spec: pb.NodeSpec) -> None:
    """The spec's priority, elastic minimum and preemption grace period."""
    if not 0 <= spec.priority <= MAX_PRIORITY:
        raise InvalidArgument(
            f"spec.priority {spec.priority} is out of range: use 0 (the lowest, the "
            f"default) up to {MAX_PRIORITY}",
            reason="INVALID_PRIORITY",
        )
    if spec.min_gpus and not 1 <= spec.min_gpus <= spec.gpus.count:
        raise InvalidArgument(
            f"spec.min_gpus {spec.min_gpus} is out of range: an elastic node shrinks to 1 "
            f"up to its {spec.gpus.count} GPUs (spec.gpus.count); use 0 for a node that "
            "is not elastic",
            reason="INVALID_GPU_COUNT",
        )
    if spec.HasField("preemption_grace_s") and not 0 <= spec.preemption_grace_s <= MAX_GRACE_S:
        raise InvalidArgument(
            f"spec.preemption_grace_s {spec.preemption_grace_s} is out of range: use 0 "
            f"(no notice) up to {MAX_GRACE_S}, or leave it unset for the broker's default",
            reason="INVALID_DURATION",
        )


def check_queue_timeout(queue: bool, timeout_s: int, field: str = "queue_timeout_s") -> None:
    """A queue timeout is 0 (wait until released) up to ``MAX_QUEUE_TIMEOUT_S``, and
    only with ``queue``."""
    if not 0 <= timeout_s <= MAX_QUEUE_TIMEOUT_S:
        raise InvalidArgument(
            f"{field} {timeout_s} is out of range: use 0 (wait until released) up to "
            f"{MAX_QUEUE_TIMEOUT_S} (7 days)",
            reason="INVALID_DURATION",
        )
    if timeout_s and not queue:
        raise InvalidArgument(
            f"{field} is set without queue: a request waits only when it is queued; set "
            "queue too, or leave the timeout out",
            reason="INVALID_DURATION",
        )


def check_excluded_hosts(hosts: Sequence[str]) -> None:
    """``spec.exclude_hosts``: at most ``MAX_EXCLUDED_HOSTS`` host names
    (``hosts/{host}``)."""
    if len(hosts) > MAX_EXCLUDED_HOSTS:
        raise InvalidArgument(
            f"spec.exclude_hosts names {len(hosts)} hosts: exclude at most "
            f"{MAX_EXCLUDED_HOSTS}, or select the hosts to use with host_selector instead",
            reason="TOO_MANY_EXCLUDED_HOSTS",
        )
    for name in hosts:
        if not name.startswith("hosts/"):
            raise InvalidArgument(
                f"spec.exclude_hosts: {name[:80]!r} is not a host name; use hosts/{{host}} "
                "(hosts/h1)",
                reason="INVALID_NAME",
            )
        parse_host(name)


def check_box(box_id: str, box: pb.Box, gpu_count: int) -> None:
    """Validate a CreateBox request's box (its id, location, endpoint, labels, size)."""
    check_id(box_id, "box")
    check_location(box.location, "box.location")
    check_text(box.fabric_endpoint, "box.fabric_endpoint")
    check_labels(box.labels, "box.labels")
    if not 1 <= gpu_count <= MAX_GPUS_PER_BOX:
        raise InvalidArgument(
            f"a box holds 1 to {MAX_GPUS_PER_BOX} GPUs; got {gpu_count} "
            "(set box.gpu_count, or list the slots in gpus)",
            reason="INVALID_GPU_COUNT",
        )


def check_page_size(page_size: int) -> int:
    """0 -> the default (100); more than the limit (1000) -> the limit; negative: invalid."""
    if page_size < 0:
        raise InvalidArgument(
            f"page_size {page_size} is negative: use 0 for the default ({DEFAULT_PAGE_SIZE}) "
            f"or up to {MAX_PAGE_SIZE}",
            reason="INVALID_PAGE_SIZE",
        )
    return min(page_size or DEFAULT_PAGE_SIZE, MAX_PAGE_SIZE)
