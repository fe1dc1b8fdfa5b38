"""The entry point the broker calls on every compose and plan.

A request for a model set (``H100|A100``) without ``mixed_models`` must get GPUs of one
model. :func:`place` tries the set's models one at a time, in the order written, each as
an ordinary single-model request, and returns the first placement found; the pipeline
itself only ever sees single models or, with ``mixed_models``, the whole set (its
model filter keeps any model of the set). Trying in order keeps the choice explainable
("A100, because no H100 placement fits") and each try is the ordinary fast placement.
"""

from __future__ import annotations

from dataclasses import replace

from dxpool.broker.placement.model import (
    CandidateReport,
    Candidates,
    LatencyModel,
    PlacementRequest,
    PlacementResult,
    Snapshot,
)
from dxpool.broker.placement.pipeline import Pipeline
from dxpool.broker.placement.registry import default_pipeline
from dxpool.errors import NotFound

_DEFAULT = default_pipeline()


def place(
    request: PlacementRequest,
    snapshot: Snapshot,
    latency: LatencyModel,
    pipeline: Pipeline | None = None,
) -> PlacementResult:
    """Choose a host and GPUs for ``request`` from ``snapshot``, and explain the choice.

    Returns a result whose ``placement`` is None when nothing fits; ``unsatisfied`` then
    names each failing constraint and the closest thing available, and ``candidates``
    says why each host was kept or dropped. Pure: the snapshot is read, never changed,
    and the same inputs give the same result. Raises :class:`~dxpool.errors.NotFound`
    when the request pins a host the snapshot does not hold.

    For a model set without ``mixed_models`` every GPU of the placement is of one model:
    the first of the set, in the order written, for which a placement exists. The
    candidates then explain the try that placed (each kept host's first reason names
    the model and the models tried before it); when no model fits, ``unsatisfied``
    holds every try's lines, each prefixed with its model, and each candidate the
    reasons of every try.
    """
    if request.host is not None and request.host not in snapshot.hosts:
        raise NotFound(
            f"host hosts/{request.host} is not registered: pin a registered host "
            "(dxpool get hosts) or leave the host empty",
            reason="HOST_NOT_FOUND",
        )
    chosen = pipeline or _DEFAULT
    models = request.models
    if len(models) < 2 or request.mixed_models:
        return chosen.run(request, snapshot, latency)
    tries: list[tuple[str, PlacementResult]] = []
    for model in models:
        result = chosen.run(replace(request, model=model), snapshot, latency)
        if result.placement is not None:
            return _placed_after(model, tuple(tried for tried, _ in tries), result)
        tries.append((model, result))
    return _none_fits(tuple(tries))


def _placed_after(model: str, tried: tuple[str, ...], result: PlacementResult) -> PlacementResult:
    """``result`` (a placement of ``model``), its candidates saying which model it is."""
    note = f"model {model}"
    if tried:
        note += f" (no placement of {', '.join(tried)})"

    def candidates() -> Candidates:
        return tuple(
            CandidateReport(c.host, c.feasible, (note, *c.reasons), c.score) if c.feasible else c
            for c in result.candidates
        )

    return PlacementResult(result.placement, candidates, result.unsatisfied)


def _none_fits(tries: tuple[tuple[str, PlacementResult], ...]) -> PlacementResult:
    """No model of the set fits: every try's account, each line naming its model."""
    unsatisfied = tuple(
        _for_model(model, line) for model, result in tries for line in result.unsatisfied
    )

    def candidates() -> Candidates:
        reasons: dict[str, list[str]] = {}
        for model, result in tries:
            for candidate in result.candidates:
                reasons.setdefault(candidate.host, []).extend(
                    _for_model(model, reason) for reason in candidate.reasons
                )
        return tuple(
            CandidateReport(host, False, tuple(lines), 0.0) for host, lines in reasons.items()
        )

    return PlacementResult(None, candidates, unsatisfied)


def _for_model(model: str, line: str) -> str:
    """``line`` of the try of ``model``, saying which model it is about."""
    return line if line.startswith(f"model {model}") else f"model {model}: {line}"
