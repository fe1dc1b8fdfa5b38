"""NodeRequest: one parser, one proto conversion, immutable once built."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dxpool.api.v1 import resources_pb2 as pb
from dxpool.errors import InvalidArgument
from dxpool.limits import MAX_GPUS_PER_NODE, MAX_LATENCY_NS
from dxpool.node_request import NodeRequest, parse_node_request
from dxpool.request import GpuSpec

_ID = st.from_regex(r"\A[a-z][a-z0-9]{0,10}\Z")
_MODEL = st.sampled_from(["H100", "A100", "A100-80GB", "L40S", "mi300x"])
_LABELS = st.dictionaries(_ID, st.from_regex(r"\A[a-z0-9]{0,8}\Z"), max_size=3)


@st.composite
def gpu_strings(draw: st.DrawFn) -> str:
    """GPU requests as the CLI and the client take them: MODEL:COUNT, a set, *:COUNT, COUNT."""
    count = draw(st.integers(1, MAX_GPUS_PER_NODE))
    models = draw(st.lists(_MODEL, min_size=1, max_size=3, unique=True))
    form = draw(st.sampled_from(["model", "set", "any", "count"]))
    if form == "model":
        return f"{models[0]}:{count}"
    if form == "set":
        return f"{'|'.join(models)}:{count}"
    if form == "any":
        return f"*:{count}"
    return str(count)


@st.composite
def keyword_forms(draw: st.DrawFn) -> tuple[str, dict[str, Any]]:
    """A valid request in the keyword form, with the strings the CLI writes where a field
    takes them (durations, sizes, spreads) and typed values elsewhere."""
    fields: dict[str, Any] = {}
    if draw(st.booleans()):
        fields["host"] = draw(st.one_of(_ID, _ID.map(lambda host: f"hosts/{host}")))
    if draw(st.booleans()):
        fields["max_latency"] = draw(
            st.one_of(
                st.integers(0, MAX_LATENCY_NS),
                st.integers(0, 9999).map(lambda us: f"{us}us"),
                st.integers(1, 10).map(lambda s: f"{s}s"),
            )
        )
    if draw(st.booleans()):
        fields["min_memory"] = draw(
            st.one_of(st.integers(0, 200_000), st.integers(1, 200).map(lambda g: f"{g}GiB"))
        )
    if draw(st.booleans()):
        fields["max_slowdown"] = draw(st.sampled_from([1.01, 1.05, 1.5, 2.0]))
        fields["workload"] = draw(st.sampled_from(["training", "400@5ms"]))
    affinity = draw(st.sampled_from([None, "box", "switch"]))
    if affinity:
        fields["affinity"] = affinity
    if affinity != "box" and draw(st.booleans()):
        fields["spread"] = draw(
            st.one_of(st.just("boxes"), st.integers(1, 16).map(lambda m: f"boxes:{m}"))
        )
    if draw(st.booleans()):
        fields["cpus"] = draw(st.integers(1, 256))
    if draw(st.booleans()):
        fields["host_memory"] = draw(
            st.one_of(st.integers(0, 1 << 20), st.integers(1, 512).map(lambda g: f"{g}GiB"))
        )
    fields["exclude_hosts"] = draw(st.lists(_ID, max_size=3))
    fields["labels"] = draw(_LABELS)
    fields["host_selector"] = draw(_LABELS)
    fields["vfio"] = draw(st.booleans())
    fields["tenant"] = draw(st.one_of(st.just(""), _ID))
    fields["priority"] = draw(st.integers(0, 1000))
    fields["preemption_grace_s"] = draw(st.one_of(st.none(), st.integers(0, 3600)))
    return draw(gpu_strings()), fields


@settings(max_examples=200, deadline=None)
@given(keyword_forms())
def test_a_parsed_request_comes_back_whole_through_its_proto(
    form: tuple[str, dict[str, Any]],
) -> None:
    gpus, fields = form
    request = parse_node_request(gpus, **fields)
    spec = request.to_proto()
    again = NodeRequest.from_proto(pb.NodeSpec.FromString(spec.SerializeToString()))
    assert again == request
    assert hash(again) == hash(request)
    assert again.to_proto() == spec


@settings(max_examples=100, deadline=None)
@given(keyword_forms())
def test_the_typed_form_parses_to_the_same_request(form: tuple[str, dict[str, Any]]) -> None:
    """What the CLI's option types hand over (nanoseconds, MiB, a box limit) and what a
    script writes (``"4us"``, ``"80GiB"``, ``"boxes:2"``) are one request."""
    gpus, fields = form
    request = parse_node_request(gpus, **fields)
    typed = parse_node_request(
        request.gpus,
        host=request.host or None,
        max_latency=request.max_latency_ns,
        max_slowdown=request.max_slowdown or None,
        workload=request.workload or None,
        affinity=request.affinity or None,
        spread=request.max_gpus_per_box or None,
        cpus=request.cpu_cores or None,
        host_memory=request.host_memory_mib,
        exclude_hosts=request.exclude_hosts,
        labels=request.labels,
        host_selector=request.host_selector,
        vfio=request.vfio,
        tenant=request.tenant,
        priority=request.priority,
        preemption_grace_s=request.preemption_grace_s,
    )
    assert typed == request


@settings(max_examples=100, deadline=None)
@given(keyword_forms(), keyword_forms())
def test_a_copy_is_the_request_parsed_with_the_changes(
    first: tuple[str, dict[str, Any]], second: tuple[str, dict[str, Any]]
) -> None:
    gpus, fields = first
    _, changes = second
    original = parse_node_request(gpus, **fields)
    before = original.to_proto()
    try:
        expected = parse_node_request(gpus, **{**fields, **changes})
    except InvalidArgument:
        with pytest.raises(InvalidArgument):
            original.copy(**changes)
    else:
        assert original.copy(**changes) == expected
    assert original.to_proto() == before  # the original is untouched


def test_the_example_request_reads_as_written() -> None:
    request = parse_node_request(
        "H100|A100:4",
        host="h1",
        max_latency="4us",
        min_memory="80GiB",
        spread="boxes:2",
        host_memory="64GiB",
        exclude_hosts=["h2", "hosts/h3", "h2"],
        labels={"team": "ml"},
        preemption_grace_s=30,
    )
    assert request.gpus == GpuSpec("H100|A100", 4, 81920)
    assert request.host == "hosts/h1"
    assert request.max_latency_ns == 4000
    assert request.max_gpus_per_box == 2
    assert request.host_memory_mib == 65536
    assert request.exclude_hosts == ("hosts/h2", "hosts/h3")
    spec = request.to_proto()
    assert spec.gpus == pb.GpuRequest(model="H100|A100", count=4, min_memory_mib=81920)
    assert spec.HasField("preemption_grace_s") and spec.preemption_grace_s == 30
    assert not parse_node_request("H100:1").to_proto().HasField("preemption_grace_s")


def test_a_request_cannot_be_changed_once_built() -> None:
    labels = {"team": "ml"}
    request = parse_node_request("H100:1", labels=labels, exclude_hosts=["h2"])
    labels["team"] = "other"  # the caller's mapping is not the request's
    assert request.labels == {"team": "ml"}
    with pytest.raises(dataclasses.FrozenInstanceError):
        request.host = "hosts/h9"  # type: ignore[misc]
    with pytest.raises(TypeError):
        request.labels["team"] = "other"  # type: ignore[index]
    built = NodeRequest(GpuSpec("H100", 1), labels=labels)
    labels["team"] = "third"
    assert built.labels == {"team": "other"}


def test_copy_replaces_what_it_is_given_and_checks_it() -> None:
    request = parse_node_request("H100:2", min_memory="80GiB", tenant="ml", max_latency="4us")
    moved = request.copy(host="h2", max_latency="8us")
    assert (moved.host, moved.max_latency_ns, moved.tenant) == ("hosts/h2", 8000, "ml")
    assert (request.host, request.max_latency_ns) == ("", 4000)
    regrown = request.copy(gpus="A100:4")
    assert regrown.gpus == GpuSpec("A100", 4, 81920)  # min_memory kept
    assert request.copy() == request
    with pytest.raises(InvalidArgument) as refused:
        request.copy(max_latency="11s")
    assert refused.value.reason == "INVALID_DURATION"
    with pytest.raises(TypeError, match="unknown node request field"):
        request.copy(colour="blue")  # type: ignore[call-arg]


@pytest.mark.parametrize(
    ("fields", "reason", "message"),
    [
        ({"max_latency": "soon"}, "INVALID_DURATION", "cannot parse duration"),
        ({"max_latency": MAX_LATENCY_NS + 1}, "INVALID_DURATION", "invalid max_latency"),
        ({"min_memory": "big"}, "INVALID_MEMORY", "cannot parse memory size"),
        ({"min_memory": -1}, "INVALID_MEMORY", "invalid min_memory"),
        ({"host": "Nope!"}, "INVALID_NAME", "invalid host id"),
        ({"exclude_hosts": "h1"}, "INVALID_ARGUMENT", "not one string"),
        ({"exclude_hosts": ["h1", "Bad!"]}, "INVALID_NAME", "invalid host id"),
        ({"max_slowdown": 1.05}, "UNKNOWN_WORKLOAD", "needs a workload"),
        ({"max_slowdown": 0.5, "workload": "training"}, "INVALID_SLOWDOWN", "out of range"),
        ({"affinity": "rack"}, "INVALID_AFFINITY", "use box"),
        ({"spread": "columns"}, "INVALID_SPREAD", "cannot parse spread"),
        ({"spread": True}, "INVALID_SPREAD", "invalid spread"),
        ({"cpus": -1}, "INVALID_HOST_RESOURCES", "cpus -1 is out of range"),
        ({"host_memory": "2048TiB"}, "INVALID_MEMORY", "larger than any host"),
        ({"host_memory": 1.5}, "INVALID_HOST_RESOURCES", "invalid host_memory"),
    ],
)
def test_a_bad_field_is_refused_with_its_reason(
    fields: dict[str, Any], reason: str, message: str
) -> None:
    with pytest.raises(InvalidArgument, match=message) as refused:
        parse_node_request("H100:1", **fields)
    assert refused.value.reason == reason


def test_the_constructor_checks_as_the_parser_does() -> None:
    with pytest.raises(InvalidArgument) as refused:
        NodeRequest(GpuSpec("H100", 1), max_latency_ns=-1)
    assert refused.value.reason == "INVALID_DURATION"
    with pytest.raises(InvalidArgument) as refused:
        NodeRequest(GpuSpec("H100", 1), affinity="rack")
    assert refused.value.reason == "INVALID_AFFINITY"
    with pytest.raises(TypeError, match="GpuSpec"):
        NodeRequest("H100:1")  # type: ignore[arg-type]
    assert NodeRequest(GpuSpec("H100", 1), host="h1").host == "hosts/h1"


def test_an_unknown_field_is_a_type_error() -> None:
    with pytest.raises(TypeError, match="colour"):
        parse_node_request("H100:1", colour="blue")  # type: ignore[call-arg]


def test_a_spec_with_an_unknown_affinity_is_refused() -> None:
    spec = pb.NodeSpec(gpus=pb.GpuRequest(model="H100", count=1))
    spec.affinity = 99  # type: ignore[assignment]
    with pytest.raises(InvalidArgument) as refused:
        NodeRequest.from_proto(spec)
    assert refused.value.reason == "INVALID_AFFINITY"
