"""What an audit record may hold: every record, whatever it was built from, is bounded;
fields of their grammar are kept as they are, anything else by size and digest."""

from __future__ import annotations

import hashlib

from hypothesis import given, settings
from hypothesis import strategies as st

from dxpool.api.v1 import audit_pb2
from dxpool.broker.api.audit_fields import (
    MAX_MESSAGE_BYTES,
    MAX_RECORD_BYTES,
    bounded_message,
    is_resource_name,
    normalised,
)

TEXT = st.text(max_size=5000) | st.text(alphabet="n", min_size=1, max_size=200_000)


@settings(max_examples=300, deadline=None)
@given(
    identity=TEXT,
    peer=TEXT,
    rpc=TEXT,
    target=TEXT,
    request_id=TEXT,
    code=TEXT,
    message=TEXT,
    broker=TEXT,
    forged=st.lists(
        st.builds(
            audit_pb2.RejectedField, field=TEXT, size=st.integers(-(2**63), 2**63 - 1), sha256=TEXT
        ),
        max_size=20,
    ),
)
def test_every_record_is_bounded(
    identity: str,
    peer: str,
    rpc: str,
    target: str,
    request_id: str,
    code: str,
    message: str,
    broker: str,
    forged: list[audit_pb2.RejectedField],
) -> None:
    record = audit_pb2.AuditRecord(
        identity=identity, peer=peer, rpc=rpc, target=target, request_id=request_id,
        code=code, message=message, broker=broker, rejected_fields=forged,
    )  # fmt: skip
    record.time.FromNanoseconds(2**63 - 1)
    assert len(normalised(record).SerializeToString()) <= MAX_RECORD_BYTES


def test_fields_of_their_grammar_are_kept_as_they_are() -> None:
    record = audit_pb2.AuditRecord(
        identity="dxpool://tenant/team-a",
        peer="ipv6:[::1]:51234",
        rpc="NodeService.ReleaseNode",
        target="boxes/box-1/gpus/12",
        request_id="job-1:attempt.2_x",
        code="NOT_FOUND",
        message="node nodes/n1 not found: list nodes with `dxpool node list`",
        broker="0123456789ab",
    )
    kept = audit_pb2.AuditRecord()
    kept.CopyFrom(record)
    assert normalised(record) == kept


def test_an_oversized_target_is_recorded_by_size_and_digest() -> None:
    name = "nodes/" + "n" * 1_000_000
    record = normalised(audit_pb2.AuditRecord(target=name, request_id="ok-1"))
    assert record.target == "" and record.request_id == "ok-1"
    (field,) = record.rejected_fields
    assert (field.field, field.size) == ("target", len(name))
    assert field.sha256 == hashlib.sha256(name.encode()).hexdigest()


def test_text_that_is_not_of_its_grammar_is_digested_too() -> None:
    record = normalised(
        audit_pb2.AuditRecord(
            identity="dxpool://tenant/\x1b[31mred",
            target="nodes/N1",
            request_id="has space",
            peer="ipv4:10.0.0.1:1\u202e",
        )
    )
    assert (record.identity, record.target, record.request_id, record.peer) == ("", "", "", "")
    assert [f.field for f in record.rejected_fields] == ["target", "request_id", "identity", "peer"]


def test_resource_names() -> None:
    for name in ("boxes/b1", "boxes/b1/gpus/0", "hosts/h1", "nodes/n-1", "gangs/g1", "tenants/t"):
        assert is_resource_name(name), name
    for name in ("boxes/", "boxes/b1/gpus/x", "nodes/N", "pods/p1", "nodes/n1\n", "n" * 200, ""):
        assert not is_resource_name(name), name


def test_a_message_is_cut_to_its_bound_and_made_printable() -> None:
    assert bounded_message("bad \x1b[2J value") == "bad \ufffd[2J value"
    cut = bounded_message("é" * 1000)
    assert len(cut.encode()) <= MAX_MESSAGE_BYTES and cut.endswith("…")
    assert bounded_message("short") == "short"
