"""Checks on API requests, before anything is read or written.

Every function raises :class:`~dxpool.errors.InvalidArgument` with a message that names
the field and says what to change. Limits here protect etcd (keys, record sizes) and
the people reading the output.
"""

from __future__ import annotations

from collections.abc import Mapping

from dxpool.api.v1 import resources_pb2 as pb
from dxpool.errors import InvalidArgument
from dxpool.names import check_id, parse_host
from dxpool.request import validate_gpu_request

MAX_LABELS = 32
MAX_LABEL_KEY = 63
MAX_LABEL_VALUE = 256
MAX_TEXT = 256  # free text: tenant, reasons, endpoints, locations
MAX_GPUS_PER_BOX = 64  # keeps a box's create/delete inside one etcd transaction
MAX_MEMORY_MIB = 16 * 1024 * 1024
MAX_LATENCY_NS = 10_000_000_000


def check_text(value: str, field: str, limit: int = MAX_TEXT) -> str:
    if len(value) > limit:
        raise InvalidArgument(
            f"{field} is {len(value)} characters long; the limit is {limit}",
            reason="FIELD_TOO_LONG",
        )
    if any(ord(ch) < 32 for ch in value):
        raise InvalidArgument(f"{field} contains control characters; remove them")
    return value


def check_labels(labels: Mapping[str, str], field: str = "labels") -> None:
    if len(labels) > MAX_LABELS:
        raise InvalidArgument(f"{field} has {len(labels)} entries; the limit is {MAX_LABELS}")
    for key, value in labels.items():
        if not key:
            raise InvalidArgument(f"{field} has an empty key")
        check_text(key, f"{field} key {key[:40]!r}", MAX_LABEL_KEY)
        check_text(value, f"{field}[{key[:40]!r}]", MAX_LABEL_VALUE)


def check_location(location: pb.Location, field: str) -> None:
    for part in ("site", "pod", "rack"):
        check_text(getattr(location, part), f"{field}.{part}", 63)


def check_node_spec(spec: pb.NodeSpec) -> None:
    """Validate a ComposeNode spec (GPU request, host pin, latency, tenant, labels)."""
    validate_gpu_request(spec.gpus.model, spec.gpus.count, spec.gpus.min_memory_mib)
    if spec.gpus.min_memory_mib > MAX_MEMORY_MIB:
        raise InvalidArgument(
            f"spec.gpus.min_memory_mib {spec.gpus.min_memory_mib} is larger than any GPU; "
            f"use at most {MAX_MEMORY_MIB}"
        )
    if spec.host:
        parse_host(spec.host)
    if not 0 <= spec.max_latency_ns <= MAX_LATENCY_NS:
        raise InvalidArgument(
            f"spec.max_latency_ns {spec.max_latency_ns} is out of range: use 0 (no bound) "
            f"up to {MAX_LATENCY_NS} (10s)",
            reason="INVALID_DURATION",
        )
    check_text(spec.tenant, "spec.tenant", 63)
    check_labels(spec.labels, "spec.labels")


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
    """0 -> default (100); at most 1000."""
    if page_size < 0:
        raise InvalidArgument(f"page_size must be 0 or more, got {page_size}")
    return min(page_size or 100, 1000)
