"""One node request: what a node asks of the pool, immutable once built.

A :class:`NodeRequest` is the client side's whole description of a node (its GPUs, the
host it may go to, its latency, slowdown, affinity and spread bounds, what it needs of its
host, its tenant, labels and sharing terms). It is built in one of three ways, all ending
in the same checks:

* :func:`parse_node_request` (or :meth:`NodeRequest.parse`): the one parser, from the
  keyword form the client has always taken (``"H100:4"``, ``max_latency="4us"``,
  ``min_memory="80GiB"``, ``spread="boxes:2"``, ...) or from the typed values the CLI's
  option types produce (nanoseconds, MiB, a box limit);
* the constructor, from typed values (``max_latency_ns=4000``), checked the same way;
* :meth:`NodeRequest.from_proto`, from a ``NodeSpec`` (a node's ``spec`` as the broker
  returns it).

Once built it is never changed: :meth:`NodeRequest.copy` returns a new request with some
fields replaced, given in the keyword form and parsed and checked as a new request is.
:meth:`NodeRequest.to_proto` is the one conversion to the API's ``NodeSpec``; the request
then travels whole (the client sends it as ComposeNode's, PlanNode's or every gang
member's spec).

The checks here are the client side's: each value has the shape its field takes (a GPU
request of :mod:`dxpool.request`'s grammar, a host name, a latency up to
``MAX_LATENCY_NS``, a slowdown bound with a workload that parses, a known affinity, a box
limit, host resources in range, host names to exclude), each refused with
:class:`~dxpool.errors.InvalidArgument` and the ErrorInfo reason the broker gives for the
same mistake. What depends on the pool (does the model exist, does the tenant, does it
fit) and the limits that protect the broker are the broker's to check, in
``broker/nodes/validation.py`` and placement.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any, Final, TypedDict, Unpack

from dxpool import names
from dxpool.api.v1 import resources_pb2
from dxpool.errors import InvalidArgument
from dxpool.fabric.overhead import check_slowdown
from dxpool.limits import MAX_GPU_MEMORY_MIB, MAX_LATENCY_NS
from dxpool.request import (
    GpuSpec,
    check_host_resources,
    parse_duration_ns,
    parse_gpus,
    parse_host_memory_mib,
    parse_memory_mib,
    parse_spread,
)

__all__ = [
    "GpusLike",
    "NodeRequest",
    "NodeRequestChanges",
    "NodeRequestFields",
    "gpu_request_proto",
    "parse_node_request",
]

GpusLike = str | Mapping[str, object] | GpuSpec
"""A GPU request as :func:`dxpool.request.parse_gpus` takes it: ``"H100:4"``, a mapping
or a :class:`~dxpool.request.GpuSpec`."""


class NodeRequestFields(TypedDict, total=False):
    """The keyword form of a node request, as :func:`parse_node_request`,
    :meth:`NodeRequest.copy` and the client's ``compose_node``, ``plan_node`` and
    ``compose_gang`` take it. Every field may be left out (its default: no bound)."""

    host: str | None
    """Pin to this host: ``"h1"`` or ``"hosts/h1"``."""
    max_latency: str | int | None
    """The most host-to-box round trip: a duration (``"4us"``) or nanoseconds."""
    min_memory: str | int | None
    """The least memory per GPU: a size (``"80GiB"``) or MiB; replaces the GPU
    request's own ``min_memory_mib``."""
    vfio: bool
    max_slowdown: float | None
    """The most predicted slowdown of ``workload`` (``1.05``)."""
    workload: str | None
    """A profile name or ``ROUND_TRIPS@STEP_TIME`` (:mod:`dxpool.fabric.overhead`)."""
    affinity: str | None
    """``"box"`` (every GPU from one box) or ``"switch"`` (from boxes under one rack
    switch)."""
    spread: str | int | None
    """``"boxes"``, ``"boxes:M"`` or M: the most GPUs from any one box."""
    host_selector: Mapping[str, str] | None
    """key=value pairs the host's labels must all hold."""
    cpus: int | None
    """CPU cores the node needs free on its host."""
    host_memory: str | int | None
    """Memory the node needs free on its host: a size (``"64GiB"``) or MiB."""
    exclude_hosts: Iterable[str]
    """Hosts (ids or ``hosts/{host}`` names) the node must not go to."""
    tenant: str
    labels: Mapping[str, str] | None
    priority: int
    """0-1000: orders waiting requests; may preempt borrowed nodes of lower priority."""
    min_gpus: int
    """An elastic node's floor (0: not elastic)."""
    preemption_grace_s: int | None
    """The notice before a preemption takes the GPUs (None: the broker's default)."""


class NodeRequestChanges(NodeRequestFields, total=False):
    """The keyword form with the GPUs too, as the client's node calls take it beside
    (or instead of) their first argument."""

    gpus: GpusLike
    """``"H100:4"``, a mapping or a :class:`~dxpool.request.GpuSpec`."""


_FIELD_NAMES: Final = frozenset(NodeRequestFields.__annotations__)

_AFFINITIES: Final[Mapping[str, resources_pb2.GpuAffinity.ValueType]] = {
    "": resources_pb2.GPU_AFFINITY_UNSPECIFIED,
    "box": resources_pb2.GPU_AFFINITY_BOX,
    "switch": resources_pb2.GPU_AFFINITY_SWITCH,
}
"""The affinities a request may require, by the name the client and the CLI take."""
_AFFINITY_NAMES: Final = {value: name for name, value in _AFFINITIES.items()}

_NO_LABELS: Final[Mapping[str, str]] = MappingProxyType({})


def _no_labels() -> Mapping[str, str]:
    return _NO_LABELS


@dataclass(frozen=True)
class NodeRequest:
    """An immutable node request; see the module's docstring.

    Fields hold typed, checked values: ``host`` and ``exclude_hosts`` are full names
    (``hosts/h1``), durations are nanoseconds, sizes MiB, ``affinity`` is ``""``,
    ``"box"`` or ``"switch"``, ``max_gpus_per_box`` 0 for no limit, ``labels`` and
    ``host_selector`` read-only mappings. Two requests are equal when every field is.
    """

    gpus: GpuSpec
    host: str = ""
    max_latency_ns: int = 0
    max_slowdown: float = 0.0
    workload: str = ""
    vfio: bool = False
    tenant: str = ""
    labels: Mapping[str, str] = field(default_factory=_no_labels)
    affinity: str = ""
    max_gpus_per_box: int = 0
    host_selector: Mapping[str, str] = field(default_factory=_no_labels)
    cpu_cores: int = 0
    host_memory_mib: int = 0
    exclude_hosts: tuple[str, ...] = ()
    priority: int = 0
    min_gpus: int = 0
    preemption_grace_s: int | None = None

    def __post_init__(self) -> None:
        """Check every field's shape, and hold names, mappings and sequences in their
        canonical, read-only form."""
        if not isinstance(self.gpus, GpuSpec):
            raise TypeError(f"gpus must be a GpuSpec, got {type(self.gpus).__name__}")
        set_field = object.__setattr__
        set_field(self, "host", _host(self.host))
        set_field(self, "max_latency_ns", _latency_ns(self.max_latency_ns))
        set_field(self, "max_slowdown", _slowdown(self.max_slowdown, self.workload))
        set_field(self, "workload", self.workload or "")
        set_field(self, "affinity", _affinity_name(self.affinity))
        set_field(self, "max_gpus_per_box", _spread(self.max_gpus_per_box))
        set_field(self, "cpu_cores", _cpus(self.cpu_cores))
        set_field(self, "host_memory_mib", _host_memory_mib(self.host_memory_mib))
        set_field(self, "exclude_hosts", _excluded_hosts(self.exclude_hosts))
        set_field(self, "labels", _frozen_mapping(self.labels))
        set_field(self, "host_selector", _frozen_mapping(self.host_selector))

    def __hash__(self) -> int:
        return hash(
            (
                self.gpus,
                self.host,
                self.max_latency_ns,
                self.max_slowdown,
                self.workload,
                self.vfio,
                self.tenant,
                tuple(sorted(self.labels.items())),
                self.affinity,
                self.max_gpus_per_box,
                tuple(sorted(self.host_selector.items())),
                self.cpu_cores,
                self.host_memory_mib,
                self.exclude_hosts,
                self.priority,
                self.min_gpus,
                self.preemption_grace_s,
            )
        )

    @classmethod
    def parse(cls, gpus: GpusLike, **fields: Unpack[NodeRequestFields]) -> NodeRequest:
        """:func:`parse_node_request`."""
        return parse_node_request(gpus, **fields)

    def copy(
        self, *, gpus: GpusLike | None = None, **changes: Unpack[NodeRequestFields]
    ) -> NodeRequest:
        """A new request: this one with ``gpus`` and the ``changes`` (the keyword form)
        in place of its own values, parsed and checked as a new request is; this one is
        unchanged. A ``gpus`` change keeps this request's ``min_memory`` unless
        ``min_memory`` is given too."""
        unknown = set(changes) - _FIELD_NAMES
        if unknown:
            raise TypeError(f"unknown node request field(s): {', '.join(sorted(unknown))}")
        fields: dict[str, Any] = {
            "host": self.host,
            "max_latency": self.max_latency_ns,
            "min_memory": self.gpus.min_memory_mib,
            "vfio": self.vfio,
            "max_slowdown": self.max_slowdown,
            "workload": self.workload,
            "affinity": self.affinity,
            "spread": self.max_gpus_per_box,
            "host_selector": self.host_selector,
            "cpus": self.cpu_cores,
            "host_memory": self.host_memory_mib,
            "exclude_hosts": self.exclude_hosts,
            "tenant": self.tenant,
            "labels": self.labels,
            "priority": self.priority,
            "min_gpus": self.min_gpus,
            "preemption_grace_s": self.preemption_grace_s,
        }
        fields.update(changes)
        return parse_node_request(self.gpus if gpus is None else gpus, **fields)

    def to_proto(self) -> resources_pb2.NodeSpec:
        """The request as the API's ``NodeSpec``: the one conversion, used for every
        call that sends a node's spec."""
        spec = resources_pb2.NodeSpec(
            gpus=gpu_request_proto(self.gpus),
            host=self.host,
            max_latency_ns=self.max_latency_ns,
            max_slowdown=self.max_slowdown,
            workload=self.workload,
            vfio=self.vfio,
            tenant=self.tenant,
            labels=dict(self.labels),
            affinity=_AFFINITIES[self.affinity],
            max_gpus_per_box=self.max_gpus_per_box,
            host_selector=dict(self.host_selector),
            cpu_cores=self.cpu_cores,
            host_memory_mib=self.host_memory_mib,
            exclude_hosts=list(self.exclude_hosts),
            priority=self.priority,
            min_gpus=self.min_gpus,
        )
        if self.preemption_grace_s is not None:
            spec.preemption_grace_s = self.preemption_grace_s
        return spec

    @classmethod
    def from_proto(cls, spec: resources_pb2.NodeSpec) -> NodeRequest:
        """The request a ``NodeSpec`` describes (a node's ``spec``, say, to compose another
        like it with :meth:`copy`); InvalidArgument where a field has no valid request
        value. ``from_proto(request.to_proto()) == request`` for every request."""
        affinity = _AFFINITY_NAMES.get(spec.affinity)
        if affinity is None:
            raise InvalidArgument(
                f"invalid affinity {spec.affinity}: a NodeSpec's affinity is one of "
                f"{', '.join(resources_pb2.GpuAffinity.keys())}",
                reason="INVALID_AFFINITY",
            )
        return cls(
            gpus=GpuSpec(
                spec.gpus.model,
                spec.gpus.count,
                spec.gpus.min_memory_mib,
                spec.gpus.mixed_models,
            ),
            host=spec.host,
            max_latency_ns=spec.max_latency_ns,
            max_slowdown=spec.max_slowdown,
            workload=spec.workload,
            vfio=spec.vfio,
            tenant=spec.tenant,
            labels=dict(spec.labels),
            affinity=affinity,
            max_gpus_per_box=spec.max_gpus_per_box,
            host_selector=dict(spec.host_selector),
            cpu_cores=spec.cpu_cores,
            host_memory_mib=spec.host_memory_mib,
            exclude_hosts=tuple(spec.exclude_hosts),
            priority=spec.priority,
            min_gpus=spec.min_gpus,
            preemption_grace_s=(
                spec.preemption_grace_s if spec.HasField("preemption_grace_s") else None
            ),
        )


def parse_node_request(gpus: GpusLike, **fields: Unpack[NodeRequestFields]) -> NodeRequest:
    """The one parser of node requests: ``gpus`` as :func:`dxpool.request.parse_gpus`
    reads it, the other fields in the keyword form of :class:`NodeRequestFields`
    (strings as the CLI writes them, or typed values). Raises InvalidArgument for a
    value of the wrong shape, TypeError for a field that does not exist."""
    unknown = set(fields) - _FIELD_NAMES
    if unknown:
        raise TypeError(f"unknown node request field(s): {', '.join(sorted(unknown))}")
    gpu = parse_gpus(gpus)
    min_memory = _memory_mib(fields.get("min_memory"), gpu.min_memory_mib)
    if min_memory != gpu.min_memory_mib:
        gpu = replace(gpu, min_memory_mib=min_memory)
    workload = fields.get("workload") or ""
    return NodeRequest(
        gpus=gpu,
        host=_host(fields.get("host")),
        max_latency_ns=_latency_ns(fields.get("max_latency")),
        max_slowdown=_slowdown(fields.get("max_slowdown"), workload),
        workload=workload,
        vfio=fields.get("vfio", False),
        tenant=fields.get("tenant", ""),
        labels=_frozen_mapping(fields.get("labels")),
        affinity=_affinity_name(fields.get("affinity")),
        max_gpus_per_box=_spread(fields.get("spread")),
        host_selector=_frozen_mapping(fields.get("host_selector")),
        cpu_cores=_cpus(fields.get("cpus")),
        host_memory_mib=_host_memory_mib(fields.get("host_memory")),
        exclude_hosts=_excluded_hosts(fields.get("exclude_hosts", ())),
        priority=fields.get("priority", 0),
        min_gpus=fields.get("min_gpus", 0),
        preemption_grace_s=fields.get("preemption_grace_s"),
    )


def gpu_request_proto(gpus: GpuSpec) -> resources_pb2.GpuRequest:
    """A GPU request as the API's ``GpuRequest``."""
    return resources_pb2.GpuRequest(
        model=gpus.model,
        count=gpus.count,
        min_memory_mib=gpus.min_memory_mib,
        mixed_models=gpus.mixed_models,
    )


# -- one check per field: raw value (keyword form or typed) -> typed value ---------------


def _host(value: str | None) -> str:
    return names.full_name(value, "hosts", "host") if value else ""


def _latency_ns(value: str | int | None) -> int:
    if value is None:
        return 0
    ns = parse_duration_ns(value) if isinstance(value, str) else value
    if isinstance(ns, bool) or not isinstance(ns, int) or not 0 <= ns <= MAX_LATENCY_NS:
        raise InvalidArgument(
            f"invalid max_latency {value!r}: give nanoseconds (0 up to {MAX_LATENCY_NS}) or "
            "a duration up to 10s such as '4us'",
            reason="INVALID_DURATION",
        )
    return ns


def _slowdown(max_slowdown: float | None, workload: str | None) -> float:
    """The slowdown bound (0: none), checked with its workload."""
    value = 0.0 if max_slowdown is None else max_slowdown
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidArgument(
            f"invalid max_slowdown {max_slowdown!r}: give a ratio such as 1.05",
            reason="INVALID_SLOWDOWN",
        )
    check_slowdown(float(value), workload or "")
    return float(value)


def _affinity_name(value: str | None) -> str:
    if not value:
        return ""
    name = value.strip().lower() if isinstance(value, str) else value
    if name not in _AFFINITIES:
        raise InvalidArgument(
            f"invalid affinity {value!r}: use box (every GPU from one box), switch (every "
            "GPU from boxes under one rack switch) or leave it out",
            reason="INVALID_AFFINITY",
        )
    return name


def _spread(value: str | int | None) -> int:
    """``"boxes"`` -> 1, ``"boxes:2"`` or 2 -> 2, None -> 0 (no limit)."""
    if value is None:
        return 0
    if isinstance(value, str):
        return parse_spread(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidArgument(
            f"invalid spread {value!r}: give 'boxes', 'boxes:M' or M, the most GPUs per box",
            reason="INVALID_SPREAD",
        )
    return value


def _cpus(value: int | None) -> int:
    cores = 0 if value is None else value
    if isinstance(cores, bool) or not isinstance(cores, int):
        raise InvalidArgument(
            f"invalid cpus {value!r}: give a whole number of CPU cores",
            reason="INVALID_HOST_RESOURCES",
        )
    check_host_resources(cores, 0, "cpus")
    return cores


def _host_memory_mib(value: str | int | None) -> int:
    mib = 0 if value is None else parse_host_memory_mib(value) if isinstance(value, str) else value
    if isinstance(mib, bool) or not isinstance(mib, int):
        raise InvalidArgument(
            f"invalid host_memory {value!r}: give MiB or a size such as '64GiB'",
            reason="INVALID_HOST_RESOURCES",
        )
    check_host_resources(0, mib, memory_field="host_memory")
    return mib


def _excluded_hosts(hosts: Iterable[str]) -> tuple[str, ...]:
    """Host ids or names as the ``hosts/{host}`` names ``NodeSpec.exclude_hosts`` holds,
    each once, in the order given (the broker checks how many)."""
    if isinstance(hosts, str):
        raise InvalidArgument("exclude_hosts takes a list of hosts, not one string")
    return tuple(dict.fromkeys(names.full_name(host, "hosts", "host") for host in hosts))


def _memory_mib(value: str | int | None, default: int) -> int:
    if value is None:
        return default
    mib = parse_memory_mib(value) if isinstance(value, str) else value
    if isinstance(mib, bool) or not isinstance(mib, int) or not 0 <= mib <= MAX_GPU_MEMORY_MIB:
        raise InvalidArgument(
            f"invalid min_memory {value!r}: give MiB (0 up to {MAX_GPU_MEMORY_MIB}) or a "
            "size such as '80GiB'",
            reason="INVALID_MEMORY",
        )
    return mib


def _frozen_mapping(value: Mapping[str, str] | None) -> Mapping[str, str]:
    """A read-only copy of ``value`` (None: empty), which no holder of ``value`` can
    change."""
    return MappingProxyType(dict(value or {})) if value else _NO_LABELS
