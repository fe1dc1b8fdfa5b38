"""What an audit record may hold: bounded fields in their own grammar, nothing else.

An audit record is written for calls that fail validation too, so its fields must not
be the request as sent: a ``ReleaseNode`` whose ``name`` was a megabyte once stored a
megabyte. :func:`normalised` is applied to every record before it is stored
(:meth:`~dxpool.broker.api.audit.AuditLog.prepare`), whatever built it:

* ``target`` is kept only if it is a dxpool resource name (``boxes/b1``,
  ``boxes/b1/gpus/0``, ``hosts/h1``, ``nodes/n1``, ``gangs/g1``, ``tenants/t1``) and
  ``request_id`` only if it is a request id (``dxpool.names``); ``identity`` only if it
  is a ``dxpool://ROLE/NAME`` URI (or the empty string); ``peer`` only if it is short
  printable ASCII. Anything else is *digested*: the field is emptied and a
  :class:`~dxpool.api.v1.audit_pb2.RejectedField` records its size in bytes and its
  SHA-256, enough to match a client's log or a complaint, never its bytes.
* ``message`` (the status the broker answered with) is the broker's own text, which
  echoes at most a short excerpt of a bad value; it is cut to :data:`MAX_MESSAGE_BYTES`
  and non-printable characters are replaced.
* ``rpc``, ``code`` and ``broker`` are the broker's own names; longer ones are digested
  too, so the bound holds whatever a caller puts in a record.

So a stored record is at most :data:`MAX_RECORD_BYTES` (a test holds every record
built from arbitrary fields to it), and a group of
:data:`~dxpool.broker.api.audit.MAX_RECORDS_PER_TXN` records stays far below etcd's
request limit (1.5 MiB by default): no record can make the write of the others fail.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable

from dxpool.api.v1 import audit_pb2
from dxpool.broker.state import metrics
from dxpool.errors import InvalidArgument
from dxpool.identity import Identity
from dxpool.names import (
    REQUEST_ID_PATTERN,
    parse_box,
    parse_gang,
    parse_gpu,
    parse_host,
    parse_node,
    parse_tenant,
)

__all__ = ["MAX_MESSAGE_BYTES", "MAX_RECORD_BYTES", "digest", "is_resource_name", "normalised"]

MAX_RECORD_BYTES = 2048
"""No stored audit record is larger (serialized)."""
MAX_MESSAGE_BYTES = 512
MAX_IDENTITY_BYTES = 256
MAX_PEER_BYTES = 128
MAX_NAME_BYTES = 64  # rpc, code, broker: the broker's own words
_ELLIPSIS = "…"

_PARSERS: dict[str, Callable[[str], object]] = {
    "boxes/": parse_box,
    "hosts/": parse_host,
    "nodes/": parse_node,
    "gangs/": parse_gang,
    "tenants/": parse_tenant,
}


def is_resource_name(value: str) -> bool:
    """Whether ``value`` is the name of a dxpool resource (a box, GPU, host, node, gang
    or tenant)."""
    if len(value) > 128:  # the longest name, boxes/{63}/gpus/{4}, is 80
        return False
    collection, _, _ = value.partition("/")
    parse = _PARSERS.get(collection + "/")
    if parse is None:
        return False
    if collection == "boxes" and "/gpus/" in value:
        parse = parse_gpu
    try:
        parse(value)
    except InvalidArgument:
        return False
    return True


def _is_request_id(value: str) -> bool:
    return REQUEST_ID_PATTERN.fullmatch(value) is not None


def _is_identity(value: str) -> bool:
    if len(value.encode()) > MAX_IDENTITY_BYTES:
        return False
    try:
        Identity.parse(value)
    except (InvalidArgument, ValueError):
        return False
    return True


def _is_peer(value: str) -> bool:
    return len(value) <= MAX_PEER_BYTES and value.isascii() and value.isprintable()


def _is_word(value: str) -> bool:
    return len(value) <= MAX_NAME_BYTES and value.isascii() and value.isprintable()


def digest(field: str, value: str) -> audit_pb2.RejectedField:
    """``value`` as the audit log keeps a field it does not store: size and SHA-256."""
    data = value.encode(errors="surrogatepass")
    return audit_pb2.RejectedField(
        field=field, size=len(data), sha256=hashlib.sha256(data).hexdigest()
    )


def bounded_message(text: str) -> str:
    """``text`` with non-printable characters replaced, cut to :data:`MAX_MESSAGE_BYTES`
    of UTF-8 (with an ellipsis when cut)."""
    clean = "".join(c if c.isprintable() else "\ufffd" for c in text)
    data = clean.encode()
    if len(data) <= MAX_MESSAGE_BYTES:
        return clean
    room = MAX_MESSAGE_BYTES - len(_ELLIPSIS.encode())
    return data[:room].decode(errors="ignore") + _ELLIPSIS


# Which record fields hold what grammar; empty is always allowed.
_GRAMMARS: dict[str, Callable[[str], bool]] = {
    "target": is_resource_name,
    "request_id": _is_request_id,
    "identity": lambda v: v == "unauthenticated" or _is_identity(v),
    "peer": _is_peer,
    "rpc": _is_word,
    "code": _is_word,
    "broker": _is_word,
}


def normalised(record: audit_pb2.AuditRecord) -> audit_pb2.AuditRecord:
    """``record`` with every field bounded as the module docstring says (in place, and
    returned). A field that does not hold its grammar is emptied and digested."""
    for field, valid in _GRAMMARS.items():
        value = getattr(record, field)
        if value and not valid(value):
            setattr(record, field, "")
            record.rejected_fields.append(digest(field, value))
            metrics.AUDIT_FIELDS_DIGESTED.labels(field=field).inc()
    record.message = bounded_message(record.message)
    # Only digests of the grammars above may be kept: a caller-made list is bounded too.
    kept = [f for f in record.rejected_fields if f.field in _GRAMMARS and len(f.sha256) == 64]
    del record.rejected_fields[:]
    record.rejected_fields.extend(kept[: len(_GRAMMARS)])
    return record
