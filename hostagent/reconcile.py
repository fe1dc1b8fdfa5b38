"""Level-based reconcile of one GPU: make the hardware match the spec, report in status.

Every decision comes from the desired state (etcd), the driver's view of the hardware and
the agent's own status record, so reconciling is safe to repeat, and safe after a crash at
any point. For one GPU:

========================  ============================  ========================================
desired                   hardware                      action
========================  ============================  ========================================
yes                       attached as asked             status ATTACHED (no hardware operation)
yes                       not attached, or partially    status ATTACHING, attach; ATTACHED or
                                                        retry; FAILED after ``attach_attempts``
yes                       other host slot or binding    status ATTACHING, detach, then attach
yes, FAILED this          anything                      nothing: FAILED is terminal for a
generation                                              generation; a new generation retries
release                   attached (even partially)     status DETACHING, drain, scrub (reset,
                                                        check healthy), detach; RELEASED, or
                                                        SCRUB_FAILED (mapping kept)
release                   not attached                  RELEASED, unless it was handed out here
                                                        and left unscrubbed: SCRUB_FAILED
release, outcome written  anything                      nothing: wait for the broker
no                        attached (even partially)     status DETACHING, detach, remove entry;
                                                        detach errors retry indefinitely
no                        not attached                  remove any status entry
========================  ============================  ========================================

Status is written before hardware is touched (ATTACHING, DETACHING). A GPU its node let
go of stays in the spec marked ``release`` until the broker has recorded the outcome the
agent reports (RELEASED: free it; SCRUB_FAILED: quarantine it), and the agent keeps that
entry while the spec still lists the GPU: so the broker never has to read meaning into
a missing entry, and cannot free a GPU whose failure it has not seen yet.
Every entry that claims a GPU for the spec is written conditionally on the spec revision
it was decided from (:class:`~dxpool.hostagent.status.StatusStore`): when the spec changed
in between, the write fails, no hardware is touched, and the GPU is reconciled again
from the new spec (:attr:`Outcome.STALE`).

A detach that keeps failing (``detach_attempts`` in a row) is reported FAILED, so the
broker quarantines the GPU; the agent keeps retrying the detach with backoff.

A GPU that still runs compute processes is drained, not yanked: the driver refuses the
detach (:class:`~dxpool.hostagent.errors.GpuBusyError`), the entry stays DETACHING with a
message naming the processes, and the refusals do not count as failures. Once
``drain_timeout_s`` has passed since the first refusal, the detach is forced.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections.abc import Callable

from dxpool.api.v1 import resources_pb2
from dxpool.hostagent import metrics
from dxpool.hostagent.desired import DesiredState
from dxpool.hostagent.driver import AttachedGpu, AttachRequest, FabricDriver
from dxpool.hostagent.errors import DriverError, GpuBusyError, IdentityMismatchError
from dxpool.hostagent.status import StaleSpecError, StatusStore
from dxpool.names import GpuRef

log = logging.getLogger(__name__)

ATTACHING = resources_pb2.ATTACHMENT_PHASE_ATTACHING
ATTACHED = resources_pb2.ATTACHMENT_PHASE_ATTACHED
DETACHING = resources_pb2.ATTACHMENT_PHASE_DETACHING
FAILED = resources_pb2.ATTACHMENT_PHASE_FAILED
RELEASED = resources_pb2.ATTACHMENT_PHASE_RELEASED
SCRUB_FAILED = resources_pb2.ATTACHMENT_PHASE_SCRUB_FAILED
STALE_WAIT_S = 1.0
DEFAULT_DRAIN_TIMEOUT_S = 300.0


class Outcome(enum.Enum):
    """What the worker does with the GPU next."""

    DONE = "done"  # converged (or terminal); forget its backoff
    RETRY = "retry"  # not converged; queue again with backoff
    STALE = "stale"  # the spec changed under the decision; reconcile again at once


def attach_request(gpu: GpuRef, want: resources_pb2.DesiredAttachment) -> AttachRequest:
    return AttachRequest(
        gpu=gpu,
        host_slot=want.host_slot,
        vfio=want.vfio,
        expected_uuid=want.expected_uuid,
        model=want.model,
        generation=want.generation,
        pci_id=want.pci_id,
        expected_serial=want.expected_serial,
    )


class Reconciler:
    """Reconciles one GPU at a time; the caller never runs two calls for one GPU at once.

    ``attach_attempts`` bounds the attach tries per GPU and generation before FAILED;
    errors the driver marks not retryable fail at once.
    """

    def __init__(
        self,
        *,
        driver: FabricDriver,
        desired: DesiredState,
        status: StatusStore,
        attach_attempts: int,
        detach_attempts: int = 5,
        drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if attach_attempts < 1:
            raise ValueError(f"attach_attempts must be >= 1, got {attach_attempts}")
        if detach_attempts < 1:
            raise ValueError(f"detach_attempts must be >= 1, got {detach_attempts}")
        if drain_timeout_s < 0:
            raise ValueError(f"drain_timeout_s must be >= 0, got {drain_timeout_s}")
        self._detach_attempts = detach_attempts
        self._drain_timeout_s = drain_timeout_s
        self._clock = clock
        self._draining: dict[GpuRef, float] = {}  # gpu -> when its detach was first refused
        self._failed_detaches: dict[GpuRef, int] = {}
        self._driver = driver
        self._desired = desired
        self._status = status
        self._attach_attempts = attach_attempts
        self._failed_attempts: dict[GpuRef, tuple[int, int]] = {}  # gpu -> (generation, count)
        self._lock = threading.Lock()

    def reconcile(self, gpu: GpuRef) -> Outcome:
        """Bring ``gpu`` one step closer to its desired state and report it in status.

        Driver errors are handled here; other errors (etcd unreachable, a bug) propagate
        and the caller retries with backoff.
        """
        want, spec_revision = self._desired.read(gpu)
        actual = self._driver.observe()
        try:
            if want is None:
                return self._ensure_detached(gpu, actual.get(gpu))
            if want.release:
                return self._release(gpu, want, actual.get(gpu), spec_revision)
            return self._ensure_attached(gpu, want, actual, spec_revision)
        except StaleSpecError:
            log.info("spec changed under a decision; reconciling again", extra={"gpu": gpu.name})
            # The watch delivers the newer spec shortly; decide again from it.
            self._desired.wait_for_change(spec_revision, STALE_WAIT_S)
            return Outcome.STALE

    # -- desired: attach ------------------------------------------------------------------

    def _ensure_attached(
        self,
        gpu: GpuRef,
        want: resources_pb2.DesiredAttachment,
        actual: dict[GpuRef, AttachedGpu],
        spec_revision: int,
    ) -> Outcome:
        request = attach_request(gpu, want)
        previous = self._status.get(gpu)
        if (
            previous is not None
            and previous.phase == FAILED
            and previous.generation == want.generation
        ):
            return Outcome.DONE  # terminal for this generation
        have = actual.get(gpu)
        if have is not None and have.satisfies(request):
            self._clear_failures(gpu)
            self._status.put(
                self._attached_entry(want, have, previous), spec_revision=spec_revision
            )
            return Outcome.DONE
        occupant = next(
            (
                other
                for other, seen in actual.items()
                if other != gpu and seen.host_slot == request.host_slot
            ),
            None,
        )
        if occupant is not None:
            return self._wait_for_slot(gpu, want, occupant, spec_revision)

        self._status.put(
            self._entry(gpu, want, ATTACHING, message="attaching"), spec_revision=spec_revision
        )
        started = time.monotonic()
        try:
            if have is not None and self._needs_detach(have, request):
                log.info(
                    "re-attaching gpu",
                    extra={"gpu": gpu.name, "from_slot": have.host_slot, "driver": have.driver},
                )
                self._driver.detach(gpu)
            attached = self._driver.attach(request)
        except DriverError as error:
            metrics.ATTACH_FAILURES.labels(reason=metrics.failure_reason(error)).inc()
            return self._attach_failed(gpu, want, error, spec_revision)
        metrics.ATTACH_SECONDS.observe(time.monotonic() - started)
        self._clear_failures(gpu)
        self._status.put(
            self._attached_entry(want, attached, previous), spec_revision=spec_revision
        )
        log.info(
            "gpu attached",
            extra={"gpu": gpu.name, "host_slot": attached.host_slot, "bdf": attached.bdf},
        )
        return Outcome.DONE

    @staticmethod
    def _needs_detach(have: AttachedGpu, request: AttachRequest) -> bool:
        """Attached at another host slot, or bound to the driver of another binding."""
        if have.host_slot != request.host_slot:
            return True
        return (
            have.present and have.driver is not None and have.driver != have.wanted_driver(request)
        )

    def _wait_for_slot(
        self,
        gpu: GpuRef,
        want: resources_pb2.DesiredAttachment,
        occupant: GpuRef,
        spec_revision: int,
    ) -> Outcome:
        """The host slot still holds another GPU: wait for its detach, or fail when the spec
        itself gives the slot to both."""
        other = self._desired.get(occupant)
        if other is not None and not other.release and other.host_slot == want.host_slot:
            message = (
                f"host slot {want.host_slot} is assigned to both {gpu.name} and {occupant.name}"
            )
            self._status.put(
                self._entry(gpu, want, FAILED, message=message), spec_revision=spec_revision
            )
            log.warning("host slot assigned twice", extra={"gpu": gpu.name, "other": occupant.name})
            return Outcome.DONE
        message = f"waiting for host slot {want.host_slot} to be freed by {occupant.name}"
        self._status.put(
            self._entry(gpu, want, ATTACHING, message=message), spec_revision=spec_revision
        )
        return Outcome.RETRY

    def _attach_failed(
        self,
        gpu: GpuRef,
        want: resources_pb2.DesiredAttachment,
        error: DriverError,
        spec_revision: int,
    ) -> Outcome:
        with self._lock:
            generation, count = self._failed_attempts.get(gpu, (want.generation, 0))
            count = count + 1 if generation == want.generation else 1
            self._failed_attempts[gpu] = (want.generation, count)
        if not error.retryable or count >= self._attach_attempts:
            self._clear_failures(gpu)
            message = f"attach failed after {count} attempt(s): {error}"
            entry = self._entry(gpu, want, FAILED, message=message)
            entry.identity_mismatch = isinstance(error, IdentityMismatchError)
            self._status.put(entry, spec_revision=spec_revision)
            log.warning(
                "gpu attach failed",
                extra={"gpu": gpu.name, "generation": want.generation, "error": str(error)},
            )
            return Outcome.DONE
        message = f"attempt {count}/{self._attach_attempts} failed: {error}; retrying"
        self._status.put(
            self._entry(gpu, want, ATTACHING, message=message), spec_revision=spec_revision
        )
        log.info("gpu attach retry", extra={"gpu": gpu.name, "attempt": count, "error": str(error)})
        return Outcome.RETRY

    def _clear_failures(self, gpu: GpuRef) -> None:
        with self._lock:
            self._failed_attempts.pop(gpu, None)

    # -- released: scrub, detach, report ---------------------------------------------------

    def _release(
        self,
        gpu: GpuRef,
        want: resources_pb2.DesiredAttachment,
        have: AttachedGpu | None,
        spec_revision: int,
    ) -> Outcome:
        """Drain, scrub and detach a GPU its node let go of, and report the outcome; the
        entry stays until the broker drops the GPU from the spec."""
        self._clear_failures(gpu)
        previous = self._status.get(gpu)
        ours = previous if previous is not None and previous.generation == want.generation else None
        if ours is not None and ours.phase in (RELEASED, SCRUB_FAILED):
            return Outcome.DONE  # reported; the broker records it and drops the GPU
        entry = resources_pb2.ObservedAttachment(
            gpu=gpu.name,
            generation=want.generation,
            phase=DETACHING,
            host_slot=want.host_slot,
            bdf=have.bdf if have is not None else "",
            uuid=ours.uuid if ours is not None else "",
            serial=ours.serial if ours is not None else "",
            health=ours.health if ours is not None else resources_pb2.GPU_HEALTH_UNSPECIFIED,
            health_reason=ours.health_reason if ours is not None else "",
            scrubbed=ours.scrubbed if ours is not None else False,
            message="releasing",
        )
        handed_out = ours is not None and ours.phase in (ATTACHED, DETACHING)
        if have is not None and not have.present and not handed_out:
            # Mapped, but its device never came up here: nothing ran on it, and nothing
            # on this host can reset it. Unmapping it is the whole release.
            entry.message = "never attached here; unmapping"
            self._status.put(entry, spec_revision=spec_revision)
            try:
                self._driver.detach(gpu, force=True)
            except DriverError as error:
                return self._release_step_failed(gpu, entry, "detach", error, spec_revision)
            return self._released(gpu, entry, "never attached here", spec_revision)
        if have is None:
            if handed_out and not entry.scrubbed:
                return self._release_failed(
                    gpu, entry, "it left this host before it could be scrubbed", spec_revision
                )
            message = "scrubbed and detached" if entry.scrubbed else "never attached here"
            return self._released(gpu, entry, message, spec_revision)
        self._status.put(entry, spec_revision=spec_revision)
        with self._lock:
            refused_at = self._draining.get(gpu)
        force = refused_at is not None and self._clock() - refused_at >= self._drain_timeout_s
        started = time.monotonic()
        try:
            if not entry.scrubbed:
                self._driver.scrub(gpu, force=force)
                entry.scrubbed = True
                entry.message = "scrubbed; detaching"
                self._status.put(entry, spec_revision=spec_revision)
            self._driver.detach(gpu, force=True)  # drained and scrubbed: nothing runs on it
        except GpuBusyError as error:
            metrics.DETACH_FAILURES.labels(reason=metrics.failure_reason(error)).inc()
            now = self._clock()
            with self._lock:
                refused_at = self._draining.setdefault(gpu, now)
            left = max(0.0, self._drain_timeout_s - (now - refused_at))
            entry.message = f"draining: {error}; scrubbing anyway in {left:.0f}s"
            self._status.put(entry, spec_revision=spec_revision)
            log.info("gpu draining", extra={"gpu": gpu.name, "pids": list(error.pids)})
            return Outcome.RETRY
        except DriverError as error:
            what = "detach" if entry.scrubbed else "scrub"
            return self._release_step_failed(gpu, entry, what, error, spec_revision)
        metrics.DETACH_SECONDS.observe(time.monotonic() - started)
        entry.bdf = ""
        return self._released(gpu, entry, "scrubbed and detached", spec_revision)

    def _release_step_failed(
        self,
        gpu: GpuRef,
        entry: resources_pb2.ObservedAttachment,
        what: str,
        error: DriverError,
        spec_revision: int,
    ) -> Outcome:
        """A scrub or detach of a release failed: retry, or report SCRUB_FAILED when the
        error is not retryable or has happened ``detach_attempts`` times in a row."""
        metrics.DETACH_FAILURES.labels(reason=metrics.failure_reason(error)).inc()
        with self._lock:
            count = self._failed_detaches.get(gpu, 0) + 1
            self._failed_detaches[gpu] = count
        if not error.retryable or count >= self._detach_attempts:
            return self._release_failed(
                gpu, entry, f"{what} failed ({count} attempt(s)): {error}", spec_revision
            )
        entry.message = f"{what} failed: {error}; retrying"
        self._status.put(entry, spec_revision=spec_revision)
        log.warning(
            "gpu release step failed",
            extra={"gpu": gpu.name, "step": what, "attempt": count, "error": str(error)},
        )
        return Outcome.RETRY

    def _released(
        self,
        gpu: GpuRef,
        entry: resources_pb2.ObservedAttachment,
        message: str,
        spec_revision: int,
    ) -> Outcome:
        """Report RELEASED: the broker may free the GPU."""
        entry.phase = RELEASED
        entry.message = message
        self._status.put(entry, spec_revision=spec_revision)
        self._forget_release(gpu)
        log.info("gpu released", extra={"gpu": gpu.name, "scrubbed": entry.scrubbed})
        return Outcome.DONE

    def _release_failed(
        self,
        gpu: GpuRef,
        entry: resources_pb2.ObservedAttachment,
        message: str,
        spec_revision: int,
    ) -> Outcome:
        """Report SCRUB_FAILED and leave the GPU as it is (mapped, if it still is): the
        broker quarantines it, drops it from the spec, and only then is it detached."""
        entry.phase = SCRUB_FAILED
        entry.message = message
        self._status.put(entry, spec_revision=spec_revision)
        self._forget_release(gpu)
        log.warning("gpu release failed", extra={"gpu": gpu.name, "reason": message})
        return Outcome.DONE

    def _forget_release(self, gpu: GpuRef) -> None:
        with self._lock:
            self._failed_detaches.pop(gpu, None)
            self._draining.pop(gpu, None)

    # -- not desired: detach --------------------------------------------------------------

    def _ensure_detached(self, gpu: GpuRef, have: AttachedGpu | None) -> Outcome:
        self._clear_failures(gpu)
        if have is None:
            self._status.remove(gpu)
            with self._lock:
                self._failed_detaches.pop(gpu, None)
                self._draining.pop(gpu, None)
            return Outcome.DONE
        previous = self._status.get(gpu)
        entry = resources_pb2.ObservedAttachment(
            gpu=gpu.name,
            generation=previous.generation if previous is not None else 0,
            phase=DETACHING,
            host_slot=have.host_slot,
            bdf=have.bdf,
            uuid=previous.uuid if previous is not None else "",
            serial=previous.serial if previous is not None else "",
            health=previous.health if previous is not None else have.health,
            health_reason=previous.health_reason if previous is not None else have.health_reason,
            message="detaching",
        )
        if (
            previous is not None
            and previous.phase in (FAILED, SCRUB_FAILED)
            and previous.generation == (entry.generation)
        ):
            entry.phase = FAILED  # quarantine stands; say why
            entry.message = previous.message
        self._status.put(entry)
        with self._lock:
            refused_at = self._draining.get(gpu)
        force = refused_at is not None and self._clock() - refused_at >= self._drain_timeout_s
        started = time.monotonic()
        try:
            self._driver.detach(gpu, force=force)
        except GpuBusyError as error:
            metrics.DETACH_FAILURES.labels(reason=metrics.failure_reason(error)).inc()
            now = self._clock()
            with self._lock:
                refused_at = self._draining.setdefault(gpu, now)
            left = max(0.0, self._drain_timeout_s - (now - refused_at))
            entry.message = f"draining: {error}; detaching anyway in {left:.0f}s"
            self._status.put(entry)
            log.info("gpu draining", extra={"gpu": gpu.name, "pids": list(error.pids)})
            return Outcome.RETRY
        except DriverError as error:
            metrics.DETACH_FAILURES.labels(reason=metrics.failure_reason(error)).inc()
            with self._lock:
                count = self._failed_detaches.get(gpu, 0) + 1
                self._failed_detaches[gpu] = count
            if count >= self._detach_attempts:
                entry.phase = FAILED
                entry.message = f"detach failed {count} times in a row: {error}"
            else:
                entry.message = f"detach failed: {error}; retrying"
            self._status.put(entry)
            log.warning(
                "gpu detach failed", extra={"gpu": gpu.name, "attempt": count, "error": str(error)}
            )
            return Outcome.RETRY
        metrics.DETACH_SECONDS.observe(time.monotonic() - started)
        with self._lock:
            self._failed_detaches.pop(gpu, None)
            self._draining.pop(gpu, None)
        self._status.remove(gpu)
        log.info("gpu detached", extra={"gpu": gpu.name, "forced": force})
        return Outcome.DONE

    # -- status entries -------------------------------------------------------------------

    @staticmethod
    def _entry(
        gpu: GpuRef,
        want: resources_pb2.DesiredAttachment,
        phase: resources_pb2.AttachmentPhase.ValueType,
        *,
        message: str,
    ) -> resources_pb2.ObservedAttachment:
        return resources_pb2.ObservedAttachment(
            gpu=gpu.name,
            generation=want.generation,
            phase=phase,
            host_slot=want.host_slot,
            message=message,
        )

    @staticmethod
    def _attached_entry(
        want: resources_pb2.DesiredAttachment,
        have: AttachedGpu,
        previous: resources_pb2.ObservedAttachment | None,
    ) -> resources_pb2.ObservedAttachment:
        """ATTACHED from the hardware; identity and health the hardware cannot show now
        (a device bound to vfio-pci) are kept from the previous report of the device."""
        known = previous if previous is not None and previous.bdf == have.bdf else None
        uuid = have.identity.uuid if have.identity else (known.uuid if known else "")
        serial = have.identity.serial if have.identity else (known.serial if known else "")
        health, health_reason = have.health, have.health_reason
        if health == resources_pb2.GPU_HEALTH_UNSPECIFIED and known is not None:
            health, health_reason = known.health, known.health_reason
        return resources_pb2.ObservedAttachment(
            gpu=have.gpu.name,
            generation=want.generation,
            phase=ATTACHED,
            host_slot=have.host_slot,
            bdf=have.bdf,
            uuid=uuid,
            serial=serial,
            health=health,
            health_reason=health_reason,
            message="",
        )


__all__ = ["Outcome", "Reconciler", "attach_request"]
