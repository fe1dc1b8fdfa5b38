"""The entry point the broker calls on every compose and plan.

A request for a model set (``H100|A100``) without ``mixed_models`` must get GPUs of one
model, and so, when the pool holds several models, should a request for any model
(``""``): peer-to-peer and data-parallel steps assume alike GPUs. :func:`place` tries
the models one at a time, each as an ordinary single-model request, and returns the
first placement found; the pipeline itself only ever sees single models or, with
``mixed_models`` (or for any model, when no single model fits), every model allowed.

Which model first is a matter of **scarcity**: the model with the most free GPUs goes
first (ties in the order written, or by name for any model). A request that could use
several models then leaves alone the models that are running out, which are the ones
the requests that can use only them still need; a request that can use only one model
is never hurt by a flexible one taking its last GPUs while another model had plenty.
A request for any model that no one model can serve mixes the fewest of the most free
models that hold it before it may take from the rest, for the same reason.
This is measured on the public traces (see ``bench/RESULTS.md``); it never keeps a
request from a model it may use, it only orders the tries. Each try is the ordinary
fast placement, and the choice stays explainable ("G2, the model with the most free
GPUs; no placement of T4").
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
    of the set's models with a placement, the one with the most free GPUs in the pool
    (ties in the order written). The candidates then explain the try that placed (each
    kept host's first reason names the model and the models tried before it); when no
    model fits, ``unsatisfied`` holds every try's lines in the order written, each
    prefixed with its model, and each candidate the reasons of every try. A request for
    any model in a pool of several models is placed the same way, model by model, and
    takes a mix only when no model alone fits (see :func:`_any_model`).
    """
    if request.host is not None and request.host not in snapshot.hosts:
        raise NotFound(
            f"host hosts/{request.host} is not registered: pin a registered host "
            "(dxpool get hosts) or leave the host empty",
            reason="HOST_NOT_FOUND",
        )
    chosen = pipeline or _DEFAULT
    models = request.models
    if len(models) == 1 or request.mixed_models:
        return chosen.run(request, snapshot, latency)
    free = _free_by_folded_model(snapshot)
    if not models:
        return _any_model(chosen, request, snapshot, latency, free)
    ordered = by_scarcity(models, free)
    tries: dict[str, PlacementResult] = {}
    passed: list[str] = []  # the models before this one, which have no placement
    for model in ordered:
        if free.get(model.casefold(), (0, ""))[0] >= request.count:
            result = chosen.run(replace(request, model=model), snapshot, latency)
            if result.placement is not None:
                return _placed_after(model, tuple(passed), result)
            tries[model] = result
        # else too few free GPUs of it in the whole pool: no placement exists
        passed.append(model)
    for model in models:  # nothing fits: the account covers every model, as written
        if model not in tries:
            tries[model] = chosen.run(replace(request, model=model), snapshot, latency)
    return _none_fits(tuple((model, tries[model]) for model in models))


def by_scarcity(models: tuple[str, ...], free: dict[str, tuple[int, str]]) -> list[str]:
    """``models`` with the most free GPUs first (``free`` by casefolded model); ties
    keep the order given."""
    return sorted(models, key=lambda model: -free.get(model.casefold(), (0, ""))[0])


def _free_by_folded_model(snapshot: Snapshot) -> dict[str, tuple[int, str]]:
    """Free healthy GPUs of schedulable boxes by casefolded model (models compare
    case-insensitively), with the spelling most of them carry (the first by name on
    ties)."""
    found: dict[str, tuple[int, str]] = {}
    spelled: dict[str, tuple[int, str]] = {}
    for model, count in snapshot.free_by_model().items():
        folded = model.casefold()
        total, name = found.get(folded, (0, model))
        best = spelled.get(folded)
        if best is None or (-count, model) < (-best[0], best[1]):
            spelled[folded] = (count, model)
            name = model
        found[folded] = (total + count, name)
    return found


def _any_model(
    pipeline: Pipeline,
    request: PlacementRequest,
    snapshot: Snapshot,
    latency: LatencyModel,
    free: dict[str, tuple[int, str]],
) -> PlacementResult:
    """A request for any model: with one model free in the pool it is that model (the
    pipeline runs it as it is); with several, each model with enough free GPUs is tried
    alone, most free first (by name on ties). Only when none places is a mix taken, and
    a mix is scarcity-ordered too: of the most free models, as few as hold the GPUs
    (see :func:`most_free_mixes`), widening one model at a time; the last try takes any
    mix (which also gives the account of why nothing fits). A mix therefore takes the
    scarce models' last GPUs only when the plentiful ones cannot serve the node."""
    if len(free) < 2:
        return pipeline.run(request, snapshot, latency)
    ranked = sorted((-count, name) for count, name in free.values() if count >= request.count)
    tried: list[str] = []
    for _, model in ranked:
        result = pipeline.run(replace(request, model=model), snapshot, latency)
        if result.placement is not None:
            return _placed_after(model, tuple(tried), result)
        tried.append(model)
    for models in most_free_mixes(free, request.count):
        mix = "|".join(models)
        result = pipeline.run(replace(request, model=mix, mixed_models=True), snapshot, latency)
        if result.placement is not None:
            return _placed_after(mix, tuple(tried), result)
        tried.append(mix)
    return pipeline.run(request, snapshot, latency)


def most_free_mixes(free: dict[str, tuple[int, str]], count: int) -> list[tuple[str, ...]]:
    """The model sets a mix of ``count`` GPUs tries before any mix: the 2, 3, ... most
    free models (``free`` as :func:`_free_by_folded_model` gives it; ties by name; models
    with none free left out), each set only when its free GPUs add up to ``count``, and
    never all of them (the run of any model is the last try). Empty when fewer than
    three models have GPUs free."""
    ranked = sorted((-number, name) for number, name in free.values() if number)
    names = [name for _, name in ranked]
    mixes: list[tuple[str, ...]] = []
    held = -ranked[0][0] if ranked else 0
    for size in range(2, len(ranked)):
        held -= ranked[size - 1][0]
        if held >= count:
            mixes.append(tuple(names[:size]))
    return mixes


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
