"""Which latency model a deployment uses, from the topology YAML and broker flags.

Three models answer the same :class:`~dxpool.fabric.latency.TieredLatencyModel` contract,
all with one class per rack (so placement ranks boxes per rack of hosts at any scale):

``topology`` (default)
    the tree model: proxies plus every switch on the path (:mod:`.latency`).
``matrix``
    an operator's round trips per rack, pod or site pair, the tree model (or a fixed
    round trip) for pairs not listed (:mod:`.matrix`).
``measured``
    round trips host agents report, smoothed, per rack pair; the tree model for pairs
    without a fresh report (:mod:`.measured`).

The topology YAML may choose one in a ``latency`` section (broker flags win over it)::

    latency:
      model: matrix          # topology | matrix | measured
      matrix: rtt.csv        # for matrix: YAML or CSV, relative to this file
      staleness: 5m          # for measured: reports older than this fall back
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import yaml

from dxpool.errors import InvalidArgument
from dxpool.fabric.latency import LatencySource, Place, StaticLatency, TopologyLatencyModel
from dxpool.fabric.matrix import LatencyMatrix, MatrixLatencyModel
from dxpool.fabric.measured import DEFAULT_STALENESS_S, MeasuredLatency
from dxpool.fabric.topology import Topology, TopologyError
from dxpool.request import parse_duration_ns

MODELS = ("topology", "matrix", "measured")


@dataclass(frozen=True)
class LatencySettings:
    """The model to build and what it needs. ``matrix_path`` is required for ``matrix``."""

    model: str = "topology"
    matrix_path: Path | None = None
    staleness_s: float = DEFAULT_STALENESS_S

    def __post_init__(self) -> None:
        if self.model not in MODELS:
            raise InvalidArgument(
                f"unknown latency model {self.model!r}: use one of {', '.join(MODELS)}",
                reason="INVALID_LATENCY_MODEL",
            )
        if self.model == "matrix" and self.matrix_path is None:
            raise InvalidArgument(
                "the matrix latency model needs a matrix file: give --latency-matrix PATH or "
                "latency.matrix in the topology YAML",
                reason="INVALID_LATENCY_MODEL",
            )
        if not (math.isfinite(self.staleness_s) and self.staleness_s > 0):
            raise InvalidArgument(
                f"staleness {self.staleness_s!r}s must be a positive duration",
                reason="INVALID_LATENCY_MODEL",
            )

    @classmethod
    def from_topology_file(cls, path: Path) -> LatencySettings:
        """The ``latency`` section of a topology YAML file (defaults when it has none);
        a relative ``matrix`` path is taken relative to the file."""
        source = str(path)
        try:
            data = yaml.safe_load(path.read_text(encoding="utf-8"))
        except (OSError, yaml.YAMLError):
            return cls()  # Topology.load reports what is wrong with the file
        section = data.get("latency") if isinstance(data, Mapping) else None
        if section is None:
            return cls()
        return cls.from_mapping(section, base=path.parent, source=source)

    @classmethod
    def from_mapping(cls, section: Any, *, base: Path, source: str = "") -> LatencySettings:
        if not isinstance(section, Mapping):
            raise TopologyError("latency", "expected a mapping", source=source)
        unknown = sorted(str(key) for key in section if key not in ("model", "matrix", "staleness"))
        if unknown:
            raise TopologyError(
                f"latency.{unknown[0]}",
                "unknown key; expected one of: model, matrix, staleness",
                source=source,
            )
        model = section.get("model", "topology")
        if not isinstance(model, str):
            raise TopologyError(
                "latency.model", f"expected one of {', '.join(MODELS)}", source=source
            )
        matrix = section.get("matrix")
        if matrix is not None and not isinstance(matrix, str):
            raise TopologyError("latency.matrix", "expected a file path", source=source)
        staleness = section.get("staleness")
        staleness_s = DEFAULT_STALENESS_S
        if staleness is not None:
            if not isinstance(staleness, str):
                raise TopologyError(
                    "latency.staleness", "expected a duration such as 5m or 300s", source=source
                )
            try:
                staleness_s = parse_duration_ns(staleness) / 1e9
            except InvalidArgument as error:
                raise TopologyError("latency.staleness", error.message, source=source) from None
        try:
            return cls(
                model=model,
                matrix_path=(base / matrix) if matrix else None,
                staleness_s=staleness_s,
            )
        except InvalidArgument as error:
            raise TopologyError("latency", error.message, source=source) from None

    def overridden(
        self,
        *,
        model: str | None = None,
        matrix_path: Path | None = None,
        staleness_s: float | None = None,
    ) -> LatencySettings:
        """These settings with what the broker's flags give (None: keep)."""
        changes: dict[str, Any] = {}
        if model is not None:
            changes["model"] = model
        if matrix_path is not None:
            changes["matrix_path"] = matrix_path
            changes.setdefault("model", "matrix" if model is None else model)
        if staleness_s is not None:
            changes["staleness_s"] = staleness_s
        return replace(self, **changes)


def build_latency_source(
    topology: Topology,
    settings: LatencySettings,
    *,
    host_place: Callable[[str], Place | None] | None = None,
    box_place: Callable[[str], Place | None] | None = None,
    clock: Callable[[], float] | None = None,
) -> LatencySource:
    """The source for ``settings``. ``host_place``/``box_place`` (id -> current place)
    are needed for ``measured``. Raises :class:`InvalidArgument` (a
    :class:`~dxpool.fabric.matrix.MatrixError` for a bad matrix)."""
    if settings.model == "matrix":
        assert settings.matrix_path is not None  # __post_init__
        matrix = LatencyMatrix.load(settings.matrix_path)
        matrix.check_against(topology, source=str(settings.matrix_path))
        return StaticLatency(MatrixLatencyModel(topology, matrix), "matrix")
    if settings.model == "measured":
        if host_place is None or box_place is None:
            raise InvalidArgument("the measured latency model needs host and box lookups")
        extra: dict[str, Any] = {} if clock is None else {"clock": clock}
        return MeasuredLatency(
            topology,
            host_place=host_place,
            box_place=box_place,
            staleness_s=settings.staleness_s,
            **extra,
        )
    return StaticLatency(TopologyLatencyModel(topology), "topology")


__all__ = ["MODELS", "LatencySettings", "build_latency_source"]
