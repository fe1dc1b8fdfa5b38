"""Whether the broker can vouch for its answers: gRPC health and the staleness gate.

Two facts decide it: whether etcd answers the store's calls (:class:`EtcdHealth`, so
whether a write can succeed) and how stale the cache may be (:meth:`Cache.lag_s`: 0
while its watch runs, else the seconds since it was last known current).

* gRPC health (the overall ``""`` service and each dxpool service) is SERVING while etcd
  is reachable and the cache lag is within ``max_staleness_s``, NOT_SERVING otherwise,
  and SERVING again as soon as both hold. A load balancer thus stops sending work to a
  broker that lost etcd, and a client can ask why it fails.
* Every call to a dxpool service is refused with UNAVAILABLE (reason ``CACHE_STALE``)
  while the cache lag exceeds ``max_staleness_s``: answers computed from a view that old
  (a GPU shown FREE that another broker gave away, "nothing fits" because releases went
  unseen) would be wrong with no sign of it. Within the limit calls are answered, and
  when the lag is above zero the response carries the trailing metadata
  ``dxpool-cache-lag-ms`` so a client can see how old the view may be. A broker reads its
  own writes at once (they are applied to the cache when committed), so a read right
  after a write sees it, or is refused; it is never answered without it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

import grpc
from grpc_health.v1 import health, health_pb2

from dxpool.broker.api.rpc import to_status
from dxpool.errors import Unavailable
from dxpool.store.health import EtcdHealth

log = logging.getLogger(__name__)

LAG_METADATA_KEY = "dxpool-cache-lag-ms"
DEFAULT_MAX_STALENESS_S = 5.0


class ServingState:
    """Drives the health servicer from etcd reachability and cache lag. Thread-safe.

    Call :meth:`notify` when either input may have changed; the state is re-evaluated at
    once, and also when a growing lag crosses ``max_staleness_s``.
    """

    def __init__(
        self,
        etcd: EtcdHealth,
        lag_s: Callable[[], float],
        servicer: health.HealthServicer,
        services: Iterable[str],
        *,
        max_staleness_s: float = DEFAULT_MAX_STALENESS_S,
        watch_error: Callable[[], str] = lambda: "",
    ) -> None:
        self._etcd = etcd
        self._lag_s = lag_s
        self._servicer = servicer
        self._services = ("", *services)
        self.max_staleness_s = max_staleness_s
        self._watch_error = watch_error
        self._wake = threading.Event()
        self._stopped = threading.Event()
        self._serving: bool | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def start(self) -> None:
        """Publish the current state and keep it current until :meth:`stop`."""
        self._evaluate()
        self._thread = threading.Thread(target=self._run, name="serving-state", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stopped.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def notify(self, *_: object) -> None:
        """An input may have changed; re-evaluate now."""
        self._wake.set()

    def lag_s(self) -> float:
        """How stale the cache may be now (0 while its watch runs)."""
        return self._lag_s()

    @property
    def serving(self) -> bool:
        with self._lock:
            return bool(self._serving)

    def stale_error(self) -> Unavailable | None:
        """The error calls get while the cache is too stale; None while it is fresh.

        A call refused here finds health NOT_SERVING when it returns: a lag that crossed
        the limit before the state thread woke is published here first.
        """
        lag = self._lag_s()
        if lag <= self.max_staleness_s:
            return None
        if self.serving:
            self._evaluate()
        return Unavailable(
            f"the broker's view of etcd may be {lag:.1f}s stale (its watch broke: "
            f"{self._watch_error() or 'unknown'}); retry shortly or use another broker",
            reason="CACHE_STALE",
            metadata={"lag_ms": str(int(lag * 1000))},
        )

    def _run(self) -> None:
        while not self._stopped.is_set():
            lag = self._lag_s()
            # Wake when a growing lag will cross the limit, or on the next notify.
            timeout = self.max_staleness_s - lag + 0.01 if 0 < lag <= self.max_staleness_s else None
            self._wake.wait(timeout)
            self._wake.clear()
            if not self._stopped.is_set():
                self._evaluate()

    def _evaluate(self) -> None:
        reachable = self._etcd.reachable
        lag = self._lag_s()
        serving = reachable and lag <= self.max_staleness_s
        with self._lock:
            if serving == self._serving:
                return
            self._serving = serving
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if serving
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for name in self._services:
            self._servicer.set(name, status)
        if serving:
            log.info("broker health SERVING")
        else:
            log.warning(
                "broker health NOT_SERVING",
                extra={"etcd_reachable": reachable, "cache_lag_s": round(lag, 3)},
            )


if TYPE_CHECKING:
    _Interceptor = grpc.ServerInterceptor[Any, Any]
    _Handler = grpc.RpcMethodHandler[Any, Any]
else:
    _Interceptor = grpc.ServerInterceptor


class StalenessGate(_Interceptor):
    """Refuses calls to the methods under ``prefixes`` while the cache is too stale, and
    marks answers given from a lagging cache (see the module docstring)."""

    def __init__(self, state: ServingState, prefixes: Iterable[str]) -> None:
        self._state = state
        self._prefixes = tuple(prefixes)

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], _Handler | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> _Handler | None:
        handler = continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or not method.startswith(self._prefixes):
            return handler
        if handler.unary_unary is not None:
            return handler._replace(unary_unary=self._unary(handler.unary_unary))  # type: ignore[attr-defined, no-any-return]
        if handler.unary_stream is not None:
            return handler._replace(unary_stream=self._stream(handler.unary_stream))  # type: ignore[attr-defined, no-any-return]
        return handler

    def _admit(self, context: grpc.ServicerContext) -> None:
        error = self._state.stale_error()
        if error is not None:
            context.abort_with_status(to_status(error))
        lag = self._state.lag_s()
        if lag > 0:
            context.set_trailing_metadata(((LAG_METADATA_KEY, str(int(lag * 1000))),))

    def _unary(self, behavior: Callable[[Any, grpc.ServicerContext], Any]) -> Any:
        def gated(request: Any, context: grpc.ServicerContext) -> Any:
            self._admit(context)
            return behavior(request, context)

        return gated

    def _stream(self, behavior: Callable[[Any, grpc.ServicerContext], Iterator[Any]]) -> Any:
        def gated(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
            self._admit(context)
            yield from behavior(request, context)

        return gated


__all__ = ["DEFAULT_MAX_STALENESS_S", "LAG_METADATA_KEY", "ServingState", "StalenessGate"]
