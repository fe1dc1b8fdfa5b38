"""Checks on what a host agent sends, before the broker writes it for the agent.

An agent may write only its own host's registration (``hosts/{host}``) and status
(``hoststatus/{host}``), and only through a broker, which checks every record here
first: names must be the host's own, numbers in range, text printable and bounded
(``dxpool.limits``: ``MAX_STATUS_ENTRIES``, ``MAX_ROUND_TRIPS``, ``MAX_STATUS_TEXT``,
``MAX_TEXT``), and the record small, so a hostile agent cannot fill etcd. Each function
returns the record as the broker stores it (a copy; output-only fields cleared, the
host's name set) or raises :class:`~dxpool.errors.InvalidArgument` naming the field to
fix. Agents clean their own text first (:func:`dxpool.text.clean_text`), so a driver's
error message never gets a status write refused.
"""

from __future__ import annotations

from dxpool.api.v1 import resources_pb2 as pb
from dxpool.broker.nodes.validation import check_enum, check_location
from dxpool.errors import InvalidArgument
from dxpool.limits import (
    MAX_HOST_SLOTS,
    MAX_ROUND_TRIPS,
    MAX_STATUS_ENTRIES,
    MAX_STATUS_TEXT,
    MAX_TEXT,
)
from dxpool.names import host_name, parse_box, parse_gpu
from dxpool.request import check_host_resources
from dxpool.text import check_labels, check_text

__all__ = ["check_host_registration", "check_host_status"]


def check_host_registration(host_id: str, host: pb.Host) -> pb.Host:
    """The Host record to store for ``host_id``'s agent: ``host`` checked, its
    output-only fields (alive, slots used) cleared."""
    if host.name != host_name(host_id):
        raise InvalidArgument(
            f"the registration names {host.name[:80]!r}; an agent may register its own "
            f"host only: set host.name to {host_name(host_id)}",
            reason="NOT_OWN_HOST",
        )
    if not 1 <= host.slot_capacity <= MAX_HOST_SLOTS:
        raise InvalidArgument(
            f"host.slot_capacity {host.slot_capacity} is out of range: give the host's proxy "
            f"slots, 1 to {MAX_HOST_SLOTS}",
            reason="INVALID_SLOT_CAPACITY",
        )
    check_location(host.location, "host.location")
    check_labels(host.labels, "host.labels")
    check_text(host.agent_endpoint, "host.agent_endpoint", MAX_TEXT)
    check_text(host.driver, "host.driver", MAX_TEXT)
    check_host_resources(host.cpu_cores, host.memory_mib, "host.cpu_cores", "host.memory_mib")
    record = pb.Host()
    record.CopyFrom(host)
    record.ClearField("alive")
    record.ClearField("slots_used")
    record.ClearField("used_slots")
    return record


def check_host_status(host_id: str, status: pb.HostStatus) -> pb.HostStatus:
    """The HostStatus record to store for ``host_id``'s agent (its ``host`` set)."""
    if status.host and status.host != host_name(host_id):
        raise InvalidArgument(
            f"status.host names {status.host[:80]!r}; an agent reports its own host only: "
            f"leave status.host empty or set it to {host_name(host_id)}",
            reason="NOT_OWN_HOST",
        )
    if len(status.attachments) > MAX_STATUS_ENTRIES:
        raise InvalidArgument(
            f"status has {len(status.attachments)} attachments; send at most {MAX_STATUS_ENTRIES}",
            reason="STATUS_TOO_LARGE",
        )
    if len(status.round_trips) > MAX_ROUND_TRIPS:
        raise InvalidArgument(
            f"status has {len(status.round_trips)} round trips; send at most {MAX_ROUND_TRIPS}",
            reason="STATUS_TOO_LARGE",
        )
    seen: set[str] = set()
    for index, entry in enumerate(status.attachments):
        field = f"status.attachments[{index}]"
        parse_gpu(entry.gpu)
        if entry.gpu in seen:
            raise InvalidArgument(
                f"{field}: {entry.gpu} is reported twice; send each GPU once",
                reason="DUPLICATE_GPU",
            )
        seen.add(entry.gpu)
        check_enum(entry.phase, pb.AttachmentPhase.DESCRIPTOR, f"{field}.phase")
        check_enum(entry.health, pb.GpuHealth.DESCRIPTOR, f"{field}.health")
        if not 0 <= entry.host_slot < MAX_HOST_SLOTS:
            raise InvalidArgument(
                f"{field}.host_slot {entry.host_slot} is out of range: give the proxy slot "
                f"the GPU is at, 0-{MAX_HOST_SLOTS - 1}",
                reason="INVALID_HOST_SLOT",
            )
        check_text(entry.bdf, f"{field}.bdf", MAX_TEXT)
        check_text(entry.uuid, f"{field}.uuid", MAX_TEXT)
        check_text(entry.serial, f"{field}.serial", MAX_TEXT)
        check_text(entry.message, f"{field}.message", MAX_STATUS_TEXT)
        check_text(entry.health_reason, f"{field}.health_reason", MAX_STATUS_TEXT)
    for index, sample in enumerate(status.round_trips):
        parse_box(sample.box)
        if sample.round_trip_ns < 0:
            raise InvalidArgument(
                f"status.round_trips[{index}].round_trip_ns is negative: send the measured "
                "round trip, 0 or more",
                reason="INVALID_ROUND_TRIP",
            )
    record = pb.HostStatus()
    record.CopyFrom(status)
    record.host = host_name(host_id)
    return record
