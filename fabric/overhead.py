"""A DxPU-style overhead model: how much a workload slows down for added PCIe latency.

DxPU (He et al., "DxPU: Large-scale Disaggregated GPU Pools in the Datacenter", ACM TACO
20(4), 2023, doi:10.1145/3617995) models the cost of disaggregation from the round-trip
latency between a host and its GPUs: a step of the workload waits for the PCIe round trips
on its critical path (a synchronization, a completion the host polls, a small copy), and
every such round trip takes the fabric's extra latency longer than it would to a local
GPU. Posted writes (kernel launches through doorbells, most DMA) do not wait, so only the
blocking round trips count. With ``n`` blocking round trips per step and a native step
time ``T``::

    slowdown(added) = (T + n x added) / T = 1 + n x added / T

so a slowdown bound ``s`` becomes a round-trip bound ``(s - 1) x T / n``: placement turns a
request's ``max_slowdown`` into a latency bound and cuts the latency model's tiers with it.

``added`` is the round trip the latency model gives for the (host, box) pair: proxies and
switches are what the fabric adds to a local PCIe path, which is already part of ``T``.

A workload is named by a profile (:data:`PROFILES`) or given inline as
``ROUND_TRIPS@STEP_TIME`` (``"400@5ms"``: 400 blocking round trips per 5 ms step). The
named profiles are **illustrative**, not measurements: the paper publishes overheads, not
round-trip counts per step, so each profile's numbers were chosen so its slowdown at the
topology model's default same-pod round trip (4.4 us) stays below the paper's headline
figure (less than 10% overhead in most AI scenarios). That the short-step online profile
is the most sensitive, and by how much, is an assumption.
Measure a workload's own blocking round trips per step (e.g. by counting synchronizations
in a trace) and give them inline for real decisions.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from dxpool.errors import InvalidArgument
from dxpool.limits import MAX_LATENCY_NS
from dxpool.request import format_duration_ns, parse_duration_ns

MAX_SLOWDOWN = 100.0
"""A slowdown bound above 100x bounds nothing a tenant would accept."""
MAX_ROUND_TRIPS_PER_STEP = 1_000_000_000
WORKLOAD_GRAMMAR = "a profile name, or ROUND_TRIPS@STEP_TIME (e.g. 400@5ms)"
_RATIO = re.compile(r"\s*[0-9]{1,3}(?:\.[0-9]{1,9})?\s*", re.ASCII)
_INLINE = re.compile(r"\s*([0-9]{1,10}(?:\.[0-9]{1,6})?)\s*@\s*(\S.*?)\s*", re.ASCII)


@dataclass(frozen=True)
class WorkloadProfile:
    """A workload's sensitivity to PCIe latency: ``round_trips_per_step`` blocking round
    trips on the critical path of a step that takes ``step_time_ns`` on a local GPU.

    Construction raises :class:`InvalidArgument` for a step time outside 1 ns to 10 s or a
    negative or absurd round-trip count.
    """

    name: str
    round_trips_per_step: float
    step_time_ns: int
    description: str = ""

    def __post_init__(self) -> None:
        rts = self.round_trips_per_step
        if not (math.isfinite(rts) and 0 <= rts <= MAX_ROUND_TRIPS_PER_STEP):
            raise InvalidArgument(
                f"workload {self.name!r}: round trips per step must be 0 to "
                f"{MAX_ROUND_TRIPS_PER_STEP}, got {rts!r}",
                reason="INVALID_WORKLOAD",
            )
        if not 0 < self.step_time_ns <= MAX_LATENCY_NS:
            raise InvalidArgument(
                f"workload {self.name!r}: step time must be more than 0 and at most 10s, "
                f"got {self.step_time_ns}ns",
                reason="INVALID_WORKLOAD",
            )

    def slowdown(self, added_round_trip_ns: int) -> float:
        """Predicted step time over native step time (1.0 = no slowdown) when every
        blocking round trip takes ``added_round_trip_ns`` longer."""
        added = max(added_round_trip_ns, 0)
        return 1.0 + self.round_trips_per_step * added / self.step_time_ns

    def max_round_trip_ns(self, max_slowdown: float) -> int:
        """The largest added round trip (ns) whose :meth:`slowdown` is at most
        ``max_slowdown``; capped at ``MAX_LATENCY_NS`` (a workload with no blocking round
        trips tolerates any fabric)."""
        if self.round_trips_per_step == 0:
            return MAX_LATENCY_NS
        budget = (max_slowdown - 1.0) * self.step_time_ns / self.round_trips_per_step
        if budget < 0:
            return 0
        if budget >= MAX_LATENCY_NS:
            return MAX_LATENCY_NS
        bound = math.floor(budget)
        # (s - 1) x T / n is rounded in floating point: settle on the exact edge
        while bound > 0 and self.slowdown(bound) > max_slowdown:
            bound -= 1
        while bound < MAX_LATENCY_NS and self.slowdown(bound + 1) <= max_slowdown:
            bound += 1
        return min(bound, MAX_LATENCY_NS)

    def describe(self) -> str:
        """``"400 round trips per 5ms step"``."""
        return (
            f"{self.round_trips_per_step:g} round trips per "
            f"{format_duration_ns(self.step_time_ns)} step"
        )


PROFILES: Mapping[str, WorkloadProfile] = MappingProxyType(
    {
        profile.name: profile
        for profile in (
            # Large-batch data-parallel training: long steps, a few thousand blocking
            # round trips (stream syncs, allreduce completions). 1.1% at 4.4 us.
            WorkloadProfile(
                "training",
                round_trips_per_step=2_500,
                step_time_ns=1_000_000_000,
                description="large-batch training (illustrative)",
            ),
            # Batch (offline) inference: medium steps, more syncs per unit of work.
            # 3.5% at 4.4 us.
            WorkloadProfile(
                "inference-batch",
                round_trips_per_step=400,
                step_time_ns=50_000_000,
                description="offline batch inference (illustrative)",
            ),
            # Online small-batch inference: short steps dominated by launches and
            # synchronizations; the most sensitive profile here. 8.8% at 4.4 us.
            WorkloadProfile(
                "inference-online",
                round_trips_per_step=100,
                step_time_ns=5_000_000,
                description="online small-batch inference (illustrative)",
            ),
            # Bulk compute with rare synchronization (rendering, batch HPC kernels).
            # 0.09% at 4.4 us.
            WorkloadProfile(
                "compute-bound",
                round_trips_per_step=200,
                step_time_ns=1_000_000_000,
                description="compute-bound batch work (illustrative)",
            ),
        )
    }
)
"""The named profiles. Illustrative (see the module docstring), not measured."""


def known_profiles() -> str:
    """``"compute-bound, inference-batch, ..."``: the profile names, for error messages."""
    return ", ".join(sorted(PROFILES))


def parse_workload(value: str) -> WorkloadProfile:
    """A profile by name, or inline as ``ROUND_TRIPS@STEP_TIME``.

    Raises :class:`InvalidArgument` (reason ``UNKNOWN_WORKLOAD``) naming the known
    profiles and the inline grammar when ``value`` is neither.
    """
    profile = PROFILES.get(value.strip())
    if profile is not None:
        return profile
    match = _INLINE.fullmatch(value)
    if match is None:
        shown = value if len(value) <= 64 else value[:64] + "..."
        raise InvalidArgument(
            f"unknown workload profile {shown!r}: use {WORKLOAD_GRAMMAR}; known profiles: "
            f"{known_profiles()}",
            reason="UNKNOWN_WORKLOAD",
        )
    step = parse_duration_ns(match.group(2))
    return WorkloadProfile(value.strip(), float(match.group(1)), step)


def parse_slowdown(value: str) -> float:
    """``"1.05"`` -> 1.05: a slowdown bound as text, above 1 and at most
    :data:`MAX_SLOWDOWN` (``"0"`` for no bound). Raises :class:`InvalidArgument`."""
    if not _RATIO.fullmatch(value):
        shown = value if len(value) <= 64 else value[:64] + "..."
        raise InvalidArgument(
            f"cannot parse slowdown {shown!r}: expected a ratio such as 1.05 (5% slower)",
            reason="INVALID_SLOWDOWN",
        )
    ratio = float(value)
    if ratio != 0 and not 1.0 < ratio <= MAX_SLOWDOWN:
        raise InvalidArgument(
            f"slowdown {value.strip()} is out of range: use a ratio above 1 and at most "
            f"{MAX_SLOWDOWN:g}, e.g. 1.05 for 5%",
            reason="INVALID_SLOWDOWN",
        )
    return ratio


def check_slowdown(max_slowdown: float, workload: str, field: str = "max_slowdown") -> None:
    """Raise :class:`InvalidArgument` unless ``max_slowdown`` is 0 (no bound) or a ratio
    above 1 and at most :data:`MAX_SLOWDOWN`, given with a ``workload`` that parses."""
    if max_slowdown == 0:
        if workload:
            parse_workload(workload)
        return
    if not (math.isfinite(max_slowdown) and 1.0 < max_slowdown <= MAX_SLOWDOWN):
        raise InvalidArgument(
            f"{field} {max_slowdown!r} is out of range: give the slowest acceptable step "
            f"time over the native one, above 1 and at most {MAX_SLOWDOWN:g} (e.g. 1.05 for "
            "5%), or 0 for no bound",
            reason="INVALID_SLOWDOWN",
        )
    if not workload:
        raise InvalidArgument(
            f"{field} needs a workload to predict the slowdown of: give {WORKLOAD_GRAMMAR}; "
            f"known profiles: {known_profiles()}",
            reason="UNKNOWN_WORKLOAD",
        )
    parse_workload(workload)


__all__ = [
    "MAX_SLOWDOWN",
    "PROFILES",
    "WORKLOAD_GRAMMAR",
    "WorkloadProfile",
    "check_slowdown",
    "known_profiles",
    "parse_slowdown",
    "parse_workload",
]
