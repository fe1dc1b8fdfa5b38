"""The host agent: registration, the spec watch, and reconcile workers.

Threads:

* the spec watch (:class:`~dxpool.store.watch.PrefixWatch` on the one key
  ``hostalloc/{host}``, which fails over between etcd members and resumes from its last
  revision) adopts every change of the host's spec and queues the GPUs it touched;
* ``workers`` reconcile threads take GPUs from the work queue (one GPU never in two
  workers at once) and re-queue failures with per-GPU exponential backoff;
* the resync thread queues desired | observed | reported GPUs every
  ``resync_interval_s``, catching drift on the hardware side;
* the registration thread keeps the host's liveness lease alive;
* with a round-trip prober, the probe thread measures the round trip to every box the
  host has GPUs from each ``probe_interval_s`` and reports it in the status record
  (:mod:`~dxpool.hostagent.latency_report`).

Nothing the agent decides depends on its memory of earlier runs: restart it at any moment
and it converges again from etcd and ``driver.observe()``.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Hashable
from typing import Any, TypeVar

import etcd3.events
import tenacity

from dxpool.api.v1 import resources_pb2
from dxpool.errors import FailedPrecondition, Unavailable
from dxpool.hostagent import metrics
from dxpool.hostagent.config import AgentConfig
from dxpool.hostagent.desired import DesiredState
from dxpool.hostagent.driver import FabricDriver
from dxpool.hostagent.errors import DriverError
from dxpool.hostagent.identity import AgentIdentity
from dxpool.hostagent.latency_report import LatencyReporter, RoundTripProber
from dxpool.hostagent.reconcile import Outcome, Reconciler
from dxpool.hostagent.registration import ETCD_ERRORS, HostHeldError, HostRegistration
from dxpool.hostagent.status import StatusStore, StatusWriteRefusedError
from dxpool.hostagent.workqueue import ExponentialBackoff, WorkQueue
from dxpool.names import GpuRef
from dxpool.store.client import addresses_of
from dxpool.store.typed import Store
from dxpool.store.watch import PrefixWatch

log = logging.getLogger(__name__)
# Why a round-trip report may not be written this round (the next round tries again).
_REPORT_ERRORS: tuple[type[BaseException], ...] = (StatusWriteRefusedError, *ETCD_ERRORS)


class Agent:
    """One host's agent. ``client`` is an etcd client the caller owns (and closes).

    Lifecycle: :meth:`start` (registers, reads status and spec, starts threads), then
    :meth:`stop` from any thread. :meth:`request_stop` only signals, for signal handlers.
    """

    def __init__(
        self,
        config: AgentConfig,
        driver: FabricDriver,
        client: Any,
        prober: RoundTripProber | None = None,
    ) -> None:
        self._config = config
        self._driver = driver
        self._client = client
        self._spec_key = config.keys.host_allocation(config.host_id)
        self._desired = DesiredState(config.host_id)
        self._identity = AgentIdentity(config.host_id, config.state_dir)
        # One typed store for every etcd call the agent makes (the spec watch aside).
        self._store = Store(client, config.keys, name="agent-store")
        self._registration = HostRegistration(self._store, config, self._identity.token)
        self._detach_metrics: Callable[[], None] = lambda: None
        self._status = StatusStore(
            self._store, config.keys, config.host_id, lambda: self._registration.lease_id
        )
        self._queue: WorkQueue[GpuRef] = WorkQueue(
            ExponentialBackoff(config.backoff_base_s, config.backoff_max_s)
        )
        self._reconciler = Reconciler(
            driver=driver,
            desired=self._desired,
            status=self._status,
            attach_attempts=config.attach_attempts,
            detach_attempts=config.detach_attempts,
            drain_timeout_s=config.drain_timeout_s,
        )
        self._reporter = (
            LatencyReporter(prober, self._status, self._boxes_in_use)
            if prober is not None
            else None
        )
        self._stopping = threading.Event()
        self._wake_resync = threading.Event()
        self._spec_watch: PrefixWatch | None = None
        self._threads: list[threading.Thread] = []
        self._stopped = False

    # -- lifecycle ------------------------------------------------------------------------

    def start(self) -> None:
        """Register, load status and spec (retrying etcd for ``startup_timeout_s``), then
        start the workers. Raises :class:`~dxpool.errors.Unavailable` if etcd stays
        unreachable."""
        retrying = tenacity.Retrying(
            retry=tenacity.retry_if_exception_type((*ETCD_ERRORS, HostHeldError)),
            wait=tenacity.wait_exponential(multiplier=0.2, max=5.0),
            stop=(
                tenacity.stop_after_delay(self._config.startup_timeout_s)
                | tenacity.stop_when_event_set(self._stopping)
            ),
            sleep=self._sleep_unless_stopping,
            before_sleep=self._log_startup_retry,
            reraise=True,
        )
        self._detach_metrics = metrics.COLLECTOR.attach(self._status)
        try:
            for attempt in retrying:
                with attempt:
                    self._registration.register()
                    self._status.load()
                    self._sync_spec()
        except HostHeldError as error:
            raise FailedPrecondition(str(error), reason="HOST_HELD") from error
        except ETCD_ERRORS as error:
            if self._stopping.is_set():
                log.info("stop requested while waiting for etcd")
                return
            raise Unavailable(
                f"etcd at {self._config.etcd_endpoints} did not answer within "
                f"{self._config.startup_timeout_s:g}s ({error!r}); check --etcd-endpoints",
                reason="ETCD_UNAVAILABLE",
            ) from error
        self._registration.start_keepalive()
        self.enqueue_all()
        for index in range(self._config.workers):
            self._spawn(self._work, f"dxpool-reconcile-{index}")
        self._spawn(self._resync_loop, "dxpool-resync")
        if self._reporter is not None:
            self._spawn(self._probe_loop, "dxpool-probe")
        log.info(
            "agent started",
            extra={"host": self._config.host_id, "workers": self._config.workers},
        )

    @property
    def desired(self) -> DesiredState:
        """The spec as the agent last adopted it (read-only use)."""
        return self._desired

    @property
    def spec_watch_endpoint(self) -> str | None:
        """The etcd member the spec watch uses now (``host:port``), if it runs."""
        watch = self._spec_watch
        address = watch.endpoint if watch is not None else None
        return str(address) if address is not None else None

    def _sleep_unless_stopping(self, seconds: float) -> None:
        self._stopping.wait(seconds)

    @staticmethod
    def _log_startup_retry(state: tenacity.RetryCallState) -> None:
        error = state.outcome.exception() if state.outcome is not None else None
        log.warning(
            "etcd not reachable; retrying",
            extra={"attempt": state.attempt_number, "error": repr(error)},
        )

    def _spawn(self, target: Callable[[], None], name: str) -> None:
        thread = threading.Thread(target=target, name=name, daemon=True)
        thread.start()
        self._threads.append(thread)

    def request_stop(self) -> None:
        """Ask the agent to stop; safe from a signal handler. :meth:`wait` then returns."""
        self._stopping.set()
        self._wake_resync.set()

    def idle(self) -> bool:
        """True when no GPU is queued, backing off or being reconciled."""
        return not self._queue.busy()

    def wait(self, timeout_s: float | None = None) -> bool:
        """Block until a stop is requested; True if it was."""
        return self._stopping.wait(timeout_s)

    def stop(self, *, revoke_lease: bool | None = None) -> None:
        """Stop: stop the watch, let each worker finish the GPU in hand, and join every
        thread. Idempotent. ``revoke_lease`` (default: only when the agent has no state
        directory to resume from) revokes the liveness lease, so the host shows as gone at
        once and its nodes are lost; otherwise the next run adopts the lease, or it
        expires within its TTL."""
        if revoke_lease is None:
            revoke_lease = self._config.state_dir is None
        if self._stopped:
            return
        self._stopped = True
        self.request_stop()
        self._queue.shutdown()
        self._registration.stop(revoke=revoke_lease)
        self._cancel_watch()
        for thread in self._threads:
            thread.join()
        self._store.health.close()
        self._identity.close()
        self._detach_metrics()
        log.info("agent stopped", extra={"host": self._config.host_id})

    # -- spec: list, then watch -----------------------------------------------------------

    def _sync_spec(self) -> None:
        """List the spec, adopt it, and keep watching it (replacing any earlier watch).
        Raises :class:`~dxpool.errors.Unavailable` if no etcd member can list it."""
        self._cancel_watch()
        watch = PrefixWatch(
            addresses_of(self._client),
            self._spec_key,
            on_list=self._on_spec_list,
            on_events=self._on_spec_events,
            name="dxpool-spec-watch",
            # The one key: etcd grants an agent its own host's spec and no other, not
            # even one whose host id extends this one (h1, h10).
            single_key=True,
        )
        watch.start(timeout_s=self._config.startup_timeout_s)
        self._spec_watch = watch

    def _cancel_watch(self) -> None:
        watch, self._spec_watch = self._spec_watch, None
        if watch is not None:
            watch.stop()

    def _on_spec_list(self, kvs: Any, revision: int) -> None:
        """Runs on the watch thread: a full listing at ``revision``."""
        mine = [kv for kv in kvs if kv.key.decode() == self._spec_key]
        if not mine:
            self._adopt(None, revision, 0)
            return
        try:
            allocation = resources_pb2.HostAllocation.FromString(mine[0].value)
        except Exception:
            log.exception("spec record unreadable; keeping the previous spec")
            return
        self._adopt(allocation, revision, int(mine[0].mod_revision))

    def _on_spec_events(self, response: Any) -> None:
        """Runs on the watch thread: adopt the newest event of this host's spec."""
        mine = [e for e in response.events if e.key.decode() == self._spec_key]
        if not mine:
            return
        event = mine[-1]
        try:
            if isinstance(event, etcd3.events.DeleteEvent):
                allocation = None
            else:
                allocation = resources_pb2.HostAllocation.FromString(event.value)
        except Exception:
            log.exception("spec record unreadable; keeping the previous spec")
            return
        self._adopt(allocation, int(event.mod_revision), int(event.mod_revision))

    def _adopt(
        self, allocation: resources_pb2.HostAllocation | None, revision: int, spec_revision: int
    ) -> None:
        changed = self._desired.replace(allocation, revision, spec_revision)
        for gpu in changed:
            self._queue.add(gpu)
        if changed:
            log.info(
                "spec changed",
                extra={"revision": revision, "gpus": ",".join(sorted(g.name for g in changed))},
            )

    # -- resync and workers ---------------------------------------------------------------

    def enqueue_all(self) -> None:
        """Queue every GPU that is desired, on the hardware, or in the status record.

        If the hardware cannot be read now, the desired and reported GPUs are still queued
        (their reconciles read the hardware again) and the error is logged.
        """
        gpus = self._desired.gpus() | self._status.gpus()
        try:
            gpus |= set(self._driver.observe())
        except DriverError as error:
            log.warning("hardware not readable during resync", extra={"error": error.message})
        for gpu in gpus:
            self._queue.add(gpu)

    def _resync_loop(self) -> None:
        while True:
            self._wake_resync.wait(self._config.resync_interval_s)
            self._wake_resync.clear()
            if self._stopping.is_set():
                return
            try:
                self.enqueue_all()
            except Exception:
                log.exception("resync failed; retrying at the next interval")

    def _boxes_in_use(self) -> set[str]:
        return {gpu.box for gpu in self._status.gpus()}

    def _probe_loop(self) -> None:
        assert self._reporter is not None
        while not self._stopping.wait(self._config.probe_interval_s):
            try:
                self._reporter.probe_once()
            except _REPORT_ERRORS as error:
                log.warning("round trips not reported", extra={"error": repr(error)})
            except Exception:
                log.exception("round-trip probing failed; retrying at the next interval")

    def _work(self) -> None:
        reconcile_worker(self._queue, self._reconciler.reconcile, lambda gpu: gpu.name)


K = TypeVar("K", bound=Hashable)


def reconcile_worker(
    queue: WorkQueue[K], reconcile: Callable[[K], Outcome], describe: Callable[[K], str]
) -> None:
    """A reconcile worker: take a key from ``queue``, ``reconcile`` it, and queue it
    again as the outcome says (at once when the spec went stale, with backoff on RETRY
    or on an error, which is logged naming ``describe(key)``), until the queue shuts
    down."""
    while True:
        key = queue.get()
        if key is None:
            return
        try:
            outcome = reconcile(key)
        except ETCD_ERRORS as error:
            log.warning("status write failed", extra={"gpu": describe(key), "error": repr(error)})
            outcome = Outcome.RETRY
        except StatusWriteRefusedError as error:
            log.warning("status write refused", extra={"gpu": describe(key), "error": str(error)})
            outcome = Outcome.RETRY
        except Exception:
            log.exception("reconcile failed", extra={"gpu": describe(key)})
            outcome = Outcome.RETRY
        try:
            if outcome is Outcome.STALE:
                queue.add(key)  # the watch has, or soon has, the newer spec
            elif outcome is Outcome.RETRY:
                queue.add_rate_limited(key)
            else:
                queue.forget(key)
        finally:
            queue.done(key)


__all__ = ["Agent", "reconcile_worker"]
