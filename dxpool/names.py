"""Resource names and ids (Google AIP-122 style).

Names: ``boxes/{box}``, ``boxes/{box}/gpus/{slot}``, ``hosts/{host}``, ``nodes/{node}``,
``tenants/{tenant}``.
Ids are 1-63 characters of lowercase letters, digits and ``-``, starting with a letter
and not ending with ``-`` (a DNS label), so they are safe in etcd keys, file names and
URLs. Every parser raises :class:`~dxpool.errors.InvalidArgument` with a message that
shows the expected form and echoes what it got.
"""

from __future__ import annotations

import re
from typing import NamedTuple

from dxpool.errors import InvalidArgument

# ``\A``/``\Z`` and ``fullmatch``, never ``^``/``$``: ``$`` also matches before a final
# newline, which would let ``"box1\n"`` through and into an etcd key.
ID_PATTERN = re.compile(r"\A[a-z](?:[a-z0-9-]{0,61}[a-z0-9])?\Z")
REQUEST_ID_PATTERN = re.compile(r"\A[A-Za-z0-9._:-]{1,128}\Z")
MAX_SLOT = 4095
# ASCII digits only, at most as many as MAX_SLOT has: str.isdigit() also accepts '³' and
# other digits int() rejects, and int() refuses strings of over 4300 digits.
_SLOT_PATTERN = re.compile(r"\A[0-9]{1,4}\Z")
ID_RULE = "1-63 characters of a-z, 0-9 and '-', starting with a letter and not ending with '-'"
_SHOWN = 80  # characters of a bad value echoed back in an error message


def _echo(value: str) -> str:
    shown = value if len(value) <= _SHOWN else value[:_SHOWN] + "..."
    return repr(shown)


def check_id(value: str, kind: str) -> str:
    """Return ``value`` if it is a valid id of a ``kind`` (box, host, node)."""
    if not ID_PATTERN.fullmatch(value):
        raise InvalidArgument(
            f"invalid {kind} id {_echo(value)}: use {ID_RULE}",
            reason="INVALID_NAME",
        )
    return value


def check_request_id(value: str) -> str:
    """Return ``value`` if it is empty or a valid request id."""
    if value and not REQUEST_ID_PATTERN.fullmatch(value):
        raise InvalidArgument(
            f"invalid request_id {_echo(value)}: use 1-128 characters of A-Z, a-z, 0-9, "
            "'.', '_', ':' and '-'",
            reason="INVALID_REQUEST_ID",
        )
    return value


def full_name(value: str, collection: str, kind: str) -> str:
    """A short id or a full name as the full name, validated: ``"h1"`` or ``"hosts/h1"``
    -> ``"hosts/h1"`` for ``collection`` ``"hosts"`` and ``kind`` ``"host"``."""
    if value.startswith(collection + "/"):
        check_id(value[len(collection) + 1 :], kind)
        return value
    return f"{collection}/{check_id(value, kind)}"


def _parse_simple(name: str, collection: str, kind: str) -> str:
    prefix = collection + "/"
    if not name.startswith(prefix):
        raise InvalidArgument(
            f"invalid {kind} name {_echo(name)}: expected '{prefix}{{{kind}}}'",
            reason="INVALID_NAME",
        )
    try:
        return check_id(name[len(prefix) :], kind)
    except InvalidArgument as error:
        raise InvalidArgument(
            f"invalid {kind} name {_echo(name)}: expected '{prefix}{{{kind}}}' where "
            f"{{{kind}}} is {ID_RULE}",
            reason="INVALID_NAME",
        ) from error


def box_name(box_id: str) -> str:
    return f"boxes/{box_id}"


def host_name(host_id: str) -> str:
    return f"hosts/{host_id}"


def node_name(node_id: str) -> str:
    return f"nodes/{node_id}"


def gang_name(gang_id: str) -> str:
    return f"gangs/{gang_id}"


def gang_member_id(gang_id: str, index: int) -> str:
    """The node id of a gang's ``index``-th member: ``{gang_id}-{index}``."""
    return f"{gang_id}-{index}"


def tenant_name(tenant_id: str) -> str:
    return f"tenants/{tenant_id}"


def gpu_name(box_id: str, slot: int) -> str:
    return f"boxes/{box_id}/gpus/{slot}"


def parse_box(name: str) -> str:
    """``boxes/{box}`` -> box id."""
    return _parse_simple(name, "boxes", "box")


def parse_host(name: str) -> str:
    """``hosts/{host}`` -> host id."""
    return _parse_simple(name, "hosts", "host")


def parse_node(name: str) -> str:
    """``nodes/{node}`` -> node id."""
    return _parse_simple(name, "nodes", "node")


def parse_gang(name: str) -> str:
    """``gangs/{gang}`` -> gang id."""
    return _parse_simple(name, "gangs", "gang")


def parse_tenant(name: str) -> str:
    """``tenants/{tenant}`` -> tenant id."""
    return _parse_simple(name, "tenants", "tenant")


class GpuRef(NamedTuple):
    """A GPU's place: its box id and slot."""

    box: str
    slot: int

    @property
    def name(self) -> str:
        return gpu_name(self.box, self.slot)


def parse_gpu(name: str) -> GpuRef:
    """``boxes/{box}/gpus/{slot}`` -> :class:`GpuRef`."""
    parts = name.split("/")
    if len(parts) != 4 or parts[0] != "boxes" or parts[2] != "gpus":
        raise InvalidArgument(
            f"invalid gpu name {_echo(name)}: expected 'boxes/{{box}}/gpus/{{slot}}'",
            reason="INVALID_NAME",
        )
    box = check_id(parts[1], "box")
    slot = parse_slot(parts[3])
    if slot is None:
        raise InvalidArgument(
            f"invalid gpu slot in {_echo(name)}: expected an integer 0-{MAX_SLOT} "
            "written with the digits 0-9",
            reason="INVALID_NAME",
        )
    return GpuRef(box, slot)


def parse_slot(text: str) -> int | None:
    """``"7"`` -> 7; None unless ``text`` is 1-4 ASCII digits naming a slot 0-MAX_SLOT."""
    if not _SLOT_PATTERN.fullmatch(text):
        return None
    slot = int(text)
    return slot if slot <= MAX_SLOT else None
