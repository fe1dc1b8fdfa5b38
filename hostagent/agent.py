"""The host agent: its session with a broker, the spec it receives, reconcile workers.

Threads:

* the broker link (:class:`~dxpool.hostagent.link.BrokerLink`) holds the host's session
  with one broker at a time (failing over between the brokers given, resuming from the
  spec revision it holds), sends the heartbeats that keep the host alive, and adopts
  every spec the broker pushes, queueing the GPUs it touched;
* ``workers`` reconcile threads take GPUs from the work queue (one GPU never in two
  workers at once) and re-queue failures with per-GPU exponential backoff;
* the resync thread queues desired | observed | reported GPUs every
  ``resync_interval_s``, catching drift on the hardware side;
* with a round-trip prober, the probe thread measures the round trip to every box the
  host has GPUs from each ``probe_interval_s`` and reports it in the status record
  (:mod:`~dxpool.hostagent.latency_report`).

The agent holds no etcd client: registration, liveness, spec and status all go through
its session. Nothing it decides depends on its memory of earlier runs: restart it at any
moment and it converges again from what the broker sends and ``driver.observe()``.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Hashable
from pathlib import Path
from typing import TypeVar

from dxpool.api.v1 import agent_pb2
from dxpool.config import read_token
from dxpool.errors import DxpoolError, Unavailable
from dxpool.hostagent import metrics
from dxpool.hostagent.config import AgentConfig
from dxpool.hostagent.desired import DesiredState
from dxpool.hostagent.driver import FabricDriver
from dxpool.hostagent.errors import DriverError
from dxpool.hostagent.identity import AgentIdentity
from dxpool.hostagent.latency_report import LatencyReporter, RoundTripProber
from dxpool.hostagent.link import BrokerLink
from dxpool.hostagent.reconcile import Outcome, Reconciler
from dxpool.hostagent.registration import host_record
from dxpool.hostagent.status import StatusStore, StatusWriteRefusedError
from dxpool.hostagent.workqueue import ExponentialBackoff, WorkQueue
from dxpool.names import GpuRef

log = logging.getLogger(__name__)
# Why a status write may not happen now (retried with backoff, or next round).
WRITE_ERRORS: tuple[type[BaseException], ...] = (StatusWriteRefusedError, DxpoolError)


class Agent:
    """One host's agent.

    Lifecycle: :meth:`start` (opens the session, adopts status and spec, starts
    threads), then :meth:`stop` from any thread. :meth:`request_stop` only signals, for
    signal handlers.
    """

    def __init__(
        self,
        config: AgentConfig,
        driver: FabricDriver,
        prober: RoundTripProber | None = None,
    ) -> None:
        self._config = config
        self._driver = driver
        self._desired = DesiredState(config.host_id)
        self._identity = AgentIdentity(config.host_id, config.state_dir)
        token = read_token(Path(config.token_file)) if config.token_file is not None else None
        self._link = BrokerLink(
            config.broker_endpoints,
            f"hosts/{config.host_id}",
            self._hello,
            self._on_welcome,
            self._on_spec,
            tls=config.broker_tls,
            token=token,
            backoff_max_s=config.backoff_max_s,
        )
        self._status_adopted = False
        self._detach_metrics: Callable[[], None] = lambda: None
        self._status = StatusStore(self._link, config.host_id)
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
        self._threads: list[threading.Thread] = []
        self._stopped = False

    # -- lifecycle ------------------------------------------------------------------------

    def start(self) -> None:
        """Open the session (waiting up to ``startup_timeout_s`` for a broker), adopt the
        host's status and spec, then start the workers. Raises
        :class:`~dxpool.errors.FailedPrecondition` (``HOST_HELD``) when another agent
        holds the host, :class:`~dxpool.errors.PermissionDenied` or
        :class:`~dxpool.errors.Unauthenticated` when the brokers refuse this agent's
        credentials, and :class:`~dxpool.errors.Unavailable` when no broker answers."""
        self._detach_metrics = metrics.COLLECTOR.attach(self._status)
        self._link.start()
        if not self._link.wait_connected(self._config.startup_timeout_s):
            if self._stopping.is_set():
                log.info("stop requested while waiting for a broker")
                return
            error = self._link.last_error
            if error is not None and not isinstance(error, Unavailable):
                raise error
            raise Unavailable(
                f"no broker at {self._config.brokers} opened a session within "
                f"{self._config.startup_timeout_s:g}s"
                + (f" ({error.message})" if error is not None else "")
                + "; check --broker and the TLS settings",
                reason="BROKER_UNAVAILABLE",
            )
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
    def link(self) -> BrokerLink:
        """The agent's link to the brokers (read-only use)."""
        return self._link

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

    def stop(self, *, release: bool | None = None) -> None:
        """Stop: say goodbye to the broker, let each worker finish the GPU in hand, and
        join every thread. Idempotent. ``release`` (default: only when the agent has no
        state directory to resume from) makes the host gone at once, so its nodes are
        lost; otherwise the next run with the same identity takes the session over, or
        the host goes when its liveness TTL has passed."""
        if release is None:
            release = self._config.state_dir is None
        if self._stopped:
            return
        self._stopped = True
        self.request_stop()
        self._queue.shutdown()
        for thread in self._threads:
            thread.join()
        self._link.stop(release=release)
        self._identity.close()
        self._detach_metrics()
        log.info("agent stopped", extra={"host": self._config.host_id})

    # -- the session: hello, welcome, spec ------------------------------------------------

    def _hello(self) -> agent_pb2.AgentHello:
        return agent_pb2.AgentHello(
            host=host_record(self._config),
            token=self._identity.token,
            liveness_ttl_ms=round(self._config.lease_ttl_s * 1000),
            spec_revision=self._desired.spec_revision,
            revision=self._desired.revision,
            status_known=self._status_adopted,
        )

    def _on_welcome(self, welcome: agent_pb2.AgentWelcome) -> None:
        """Runs on the link's thread. The stored status is adopted once, at the first
        session: afterwards this process's copy is the newer one (it wrote it). A later
        session (after a broker went) wakes the resync, so status writes that failed
        meanwhile are tried again now rather than after their backoff."""
        if not self._status_adopted:
            self._status.adopt(welcome.status if welcome.HasField("status") else None)
            self._status_adopted = True
        else:
            self._wake_resync.set()
        if welcome.HasField("spec"):
            self._on_spec(welcome.spec)

    def _on_spec(self, spec: agent_pb2.HostSpec) -> None:
        """Runs on the link's thread: adopt a spec unless it is older than the one held."""
        allocation = spec.allocation if spec.HasField("allocation") else None
        changed = self._desired.replace(allocation, spec.revision, spec.spec_revision)
        for gpu in changed:
            self._queue.add(gpu)
        if changed:
            log.info(
                "spec changed",
                extra={
                    "revision": spec.revision,
                    "gpus": ",".join(sorted(g.name for g in changed)),
                },
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
            except WRITE_ERRORS as error:
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
        except DxpoolError as error:  # the broker could not be reached, or refused
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


__all__ = ["WRITE_ERRORS", "Agent", "reconcile_worker"]
