"""Is a requested GPU model in the pool at all?

Placement answers "nothing fits" (RESOURCE_EXHAUSTED, reason ``NO_CAPACITY``) both when
every GPU of a model is taken, which may change, and when the pool has no GPU of that model,
which retrying will not fix. :func:`check_model_known` tells them apart: it raises
FAILED_PRECONDITION, reason ``UNKNOWN_MODEL``, naming the models the pool has.

It runs only after placement has failed, so a compose that fits pays nothing for it.
The cache may lag etcd (a box another broker has just registered), so a model the cache
lacks is confirmed with etcd before it is called unknown: the cache is waited for up to
the revision of the latest GPU record written (not etcd's current revision: writes outside
the pool's prefix, such as the audit log, never reach the cache's watch) and asked again.
When that cannot be done in time the check says nothing and the caller reports the
retryable NO_CAPACITY.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator

from dxpool.broker.state.cache import Cache
from dxpool.errors import FailedPrecondition, Unavailable
from dxpool.request import model_set
from dxpool.store import keys as k
from dxpool.store.typed import Store

log = logging.getLogger(__name__)

CATCH_UP_TIMEOUT_S = 2.0
"""How long the cache may take to reach etcd's revision before the check gives up."""


def _gpu_models(cache: Cache) -> Iterator[str]:
    """The model of every cached GPU (a page of records per hold of the cache's lock)."""
    return (record.value.model for _, record in cache.gpus.walk())


def _has_model(cache: Cache, model: str) -> bool:
    """Whether a cached GPU is of ``model``, or of any model of a set ``"H100|A100"``."""
    wanted = {part.casefold() for part in model_set(model)}
    return any(found.casefold() in wanted for found in _gpu_models(cache))


def models_in_pool(cache: Cache) -> list[str]:
    """The GPU models of the cached GPUs, sorted, each once (first spelling seen)."""
    models: dict[str, str] = {}
    for model in _gpu_models(cache):
        models.setdefault(model.casefold(), model)
    return sorted(models.values(), key=str.casefold)


def check_model_known(store: Store, cache: Cache, model: str) -> None:
    """Raise :class:`FailedPrecondition` (``UNKNOWN_MODEL``) if no GPU in the pool is of
    ``model`` (compared case-insensitively), or, for a set ``"H100|A100"``, of any model
    of the set; return otherwise, and also when ``model`` is empty (any model) or the
    absence cannot be confirmed with etcd in time."""
    if not model or _has_model(cache, model):
        return
    try:
        revision = store.last_write_revision(k.GPUS)
    except Unavailable:
        return
    if not cache.wait_for_revision(revision, CATCH_UP_TIMEOUT_S):
        log.warning(
            "cache behind etcd; model not confirmed unknown",
            extra={"model": model, "revision": revision},
        )
        return
    if _has_model(cache, model):
        return
    known = models_in_pool(cache)
    if known:
        have = f"the pool has {', '.join(known)}: ask for one of those"
    else:
        have = "the pool has no GPUs yet"
    several = len(model_set(model)) > 1
    what = f"of any model of {model!r}" if several else f"of model {model!r}"
    register = f"one of {model.replace('|', ', ')}" if several else model
    meant = _count_written_as_part_of_the_model(model, known)
    raise FailedPrecondition(
        f"no GPU {what} is in the pool; {meant}{have}, or register boxes of {register} "
        "with `dxpool box add`",
        reason="UNKNOWN_MODEL",
        metadata={"model": model, "models": ",".join(known)},
    )


_MODEL_DASH_COUNT = re.compile(r"(?P<model>.+)-(?P<count>[0-9]{1,3})")


def _count_written_as_part_of_the_model(model: str, known: list[str]) -> str:
    """``"did you mean H100:4 (MODEL:COUNT)? "`` for ``H100-4`` when the pool has H100s
    (a dash is part of many model names, so the grammar reads it as one); else ""."""
    match = _MODEL_DASH_COUNT.fullmatch(model)
    if match is None:
        return ""
    spelled = {found.casefold(): found for found in known}
    base = spelled.get(match.group("model").casefold())
    if base is None:
        return ""
    return f"did you mean {base}:{int(match.group('count'))} (MODEL:COUNT)? "


__all__ = ["check_model_known", "models_in_pool"]
