"""When the garbage collector runs in a process that places: between decisions, not inside.

A broker holds its whole inventory in memory, and placement churns hundreds of tracked
objects per decision. With Python's default thresholds (700, 10, 10) the collector then
runs inside decisions: a young collection every decision or two, a middle one every ten
or so, and now and then a full one that walks every object not frozen. A
:class:`CollectorPolicy` moves that work to the moments between decisions:

* :meth:`~CollectorPolicy.start` (once the inventory is loaded): ``gc.freeze()`` (the
  inventory leaves the generations: no collection walks it again), with no full
  collection first (loading makes little cyclic garbage, and a collection over the whole
  inventory would add about 0.3 s to the start at 100,000 GPUs; the first full reclaim
  frees what was frozen dead), and high thresholds (``young_limit``, 20, 100), a safety
  net that lets a burst of decisions run without a collection while still bounding how
  much can pile up;
* :meth:`~CollectorPolicy.between` (where no decision is running): when the youngest
  generation holds ``young_batch`` objects or more, ``gc.collect(1); gc.freeze()``:
  the young garbage is freed and the survivors join the frozen set, so they are never
  scanned again. Below the batch it costs one ``gc.get_count()`` and one clock read;
* a **bounded-leak guard**, also from :meth:`~CollectorPolicy.between`: objects frozen
  alive that die later are not reclaimed while frozen (a reference cycle among them is
  kept: plain reference counting still frees the rest). So when the frozen set grew by
  more than ``reclaim_growth`` since the last full reclaim, or ``reclaim_interval_s``
  passed, whichever comes first, ``gc.unfreeze(); gc.collect(); gc.freeze()``: one
  full collection over everything, a pause in proportion to the heap (up to about a
  second at 100,000 GPUs with a third held; ``bench/placement_stream.py --gc policy``
  measures it).

With ``enabled=False`` the policy does what a plain process does with its inventory
loaded: :meth:`~CollectorPolicy.start` freezes once and leaves Python's thresholds as
they are; :meth:`~CollectorPolicy.between` does nothing.

The collector is process-wide. Several policies may run in one process (brokers in a
test, say); they share it: the first :meth:`~CollectorPolicy.start` records the
thresholds it found, each sets its own, and the last :meth:`~CollectorPolicy.stop` puts
the recorded ones back. Nothing is unfrozen at stop (that would make the next full
collection walk all of it again); :meth:`~CollectorPolicy.reclaim` frees what died
frozen. Every collection a policy runs is reported to its ``observer`` (``kind``,
seconds it took, objects frozen after it as :attr:`~CollectorPolicy.frozen` counts
them): the broker turns these into Prometheus metrics.

**Counting the frozen set.** ``gc.get_freeze_count()`` walks the whole frozen set, so
its cost grows with the heap (tens of milliseconds and more at a million objects); the
policy calls it after the start and a full reclaim, and as follows. A young batch adds
the survivors it froze (generation 2 holds only them once everything older is frozen:
O(survivors)). That sum also keeps frozen objects that reference counting freed since,
so when it says the set grew by ``reclaim_growth`` the policy counts for real before it
decides, and counts again only once the sum grew by another share: one walk per share of
apparent growth.

Thread-safe: :meth:`between` may be called from any number of threads at once; one of
them collects, the others return at once without waiting.
"""

from __future__ import annotations

import gc
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

START: Final = "start"
"""Kind of the collection :meth:`CollectorPolicy.start` runs."""
YOUNG_BATCH: Final = "young_batch"
"""Kind of ``gc.collect(1); gc.freeze()`` from :meth:`CollectorPolicy.between`."""
FULL_RECLAIM: Final = "full_reclaim"
"""Kind of ``gc.unfreeze(); gc.collect(); gc.freeze()``, the bounded-leak guard."""
KINDS: Final = (START, YOUNG_BATCH, FULL_RECLAIM)

_process_lock = threading.Lock()
_running = 0  # policies started and not stopped, in this process
_found_thresholds: tuple[int, int, int] | None = None  # what the first of them found

CollectionObserver = Callable[[str, float, int], None]
"""Told of each collection the policy ran: its kind (one of :data:`KINDS`), how long it
took in seconds, and how many objects are frozen after it (as
:attr:`CollectorPolicy.frozen` counts them)."""


@dataclass(frozen=True)
class CollectorSettings:
    """How a :class:`CollectorPolicy` collects; see the module docstring.

    Raises :class:`ValueError` naming the field for a value out of range."""

    enabled: bool = True
    young_batch: int = 5_000
    """Objects in the youngest generation at which :meth:`CollectorPolicy.between` runs a
    young collection and freezes the survivors."""
    young_limit: int = 50_000
    """The youngest generation's threshold while the policy runs (the safety net)."""
    middle_limit: int = 20
    old_limit: int = 100
    reclaim_growth: float = 0.25
    """A full reclaim once the frozen set grew by this share since the last one."""
    reclaim_interval_s: float = 3600.0
    """A full reclaim at least this often (seconds; ``0`` turns the interval off and
    leaves the growth rule alone)."""

    def __post_init__(self) -> None:
        if self.young_batch < 1:
            raise ValueError(f"young_batch must be at least 1, not {self.young_batch}")
        if self.young_limit < self.young_batch:
            raise ValueError(
                f"young_limit ({self.young_limit}) must be at least young_batch "
                f"({self.young_batch}): the safety net must not fire before the batch"
            )
        if self.middle_limit < 1 or self.old_limit < 1:
            raise ValueError(
                f"middle_limit and old_limit must be at least 1, not "
                f"{self.middle_limit} and {self.old_limit}"
            )
        if not self.reclaim_growth > 0:
            raise ValueError(f"reclaim_growth must be above 0, not {self.reclaim_growth}")
        if self.reclaim_interval_s < 0:
            raise ValueError(
                f"reclaim_interval_s must be 0 (off) or more, not {self.reclaim_interval_s}"
            )


class CollectorPolicy:
    """The collector policy of one process; see the module docstring for the contract."""

    def __init__(
        self,
        settings: CollectorSettings | None = None,
        observer: CollectionObserver | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._settings = settings if settings is not None else CollectorSettings()
        self._observer = observer
        self._clock = clock
        self._lock = threading.Lock()
        self._started = False
        self._frozen_after_reclaim = 0
        self._frozen = 0
        self._counted = 0  # the frozen set's real size when last counted
        self._reclaimed_at = 0.0

    @property
    def settings(self) -> CollectorSettings:
        return self._settings

    @property
    def frozen(self) -> int:
        """Objects frozen, as the policy counts them (0 before :meth:`start`): exact after
        the start and a full reclaim; a young batch adds the survivors it froze, so
        frozen objects freed since by reference counting are still in, until the policy
        counts the frozen set again (when this count says it grew by its share)."""
        return self._frozen

    def start(self) -> None:
        """Freeze what is loaded and (when enabled) set the thresholds.

        Call once the long-lived state is loaded. A second call while started is
        refused with :class:`RuntimeError`."""
        with self._lock:
            if self._started:
                raise RuntimeError("the collector policy is already started")
            _enter()
            self._run(START, self._freeze_loaded)
            self._mark_reclaimed()
            if self._settings.enabled:
                settings = self._settings
                gc.set_threshold(settings.young_limit, settings.middle_limit, settings.old_limit)
            self._started = True

    def between(self) -> str | None:
        """Call where no decision runs. Returns the kind of collection it ran, if any.

        A full reclaim when due (the frozen set grew by ``reclaim_growth``, or
        ``reclaim_interval_s`` passed), else a young batch when the youngest generation
        holds ``young_batch`` objects or more, else nothing. Nothing, too, before
        :meth:`start`, after :meth:`stop`, when disabled, or while another thread is
        collecting."""
        settings = self._settings
        if not self._active():
            return None
        young = gc.get_count()[0] >= settings.young_batch
        if not young and not self._interval_passed():
            return None
        if not self._lock.acquire(blocking=False):
            return None
        try:
            if not self._active():  # stopped meanwhile
                return None
            if self._reclaim_due():
                self._run(FULL_RECLAIM, self._reclaim)
                self._mark_reclaimed()
                return FULL_RECLAIM
            if gc.get_count()[0] >= settings.young_batch:
                self._run(YOUNG_BATCH, self._collect_young)
                return YOUNG_BATCH
            return None
        finally:
            self._lock.release()

    def reclaim(self) -> None:
        """A full reclaim now (waits for a collection in progress): what was frozen alive
        and died since is freed. Does nothing before :meth:`start` or after :meth:`stop`."""
        with self._lock:
            if not self._started:
                return
            self._run(FULL_RECLAIM, self._reclaim)
            self._mark_reclaimed()

    def stop(self) -> None:
        """No more collections from this policy; the last policy of the process to stop
        puts back the thresholds the first found. What is frozen stays frozen.
        Idempotent."""
        with self._lock:
            if not self._started:
                return
            self._started = False
            _leave()

    def _mark_reclaimed(self) -> None:
        """After a full collection: its exact count is where growth is measured from."""
        self._frozen_after_reclaim = self._counted = self._frozen
        self._reclaimed_at = self._clock()

    def _active(self) -> bool:
        return self._started and self._settings.enabled

    def _interval_passed(self) -> bool:
        interval = self._settings.reclaim_interval_s
        return interval > 0 and self._clock() - self._reclaimed_at >= interval

    def _reclaim_due(self) -> bool:
        if self._interval_passed():
            return True
        allowed = self._settings.reclaim_growth * max(self._frozen_after_reclaim, 1)
        if self._frozen - max(self._frozen_after_reclaim, self._counted) <= allowed:
            return False
        # The count kept from young batches includes what reference counting freed since
        # it froze (most of it, in a steady state): count for real before deciding, and
        # again only once the kept count grew by another share since.
        self._frozen = self._counted = gc.get_freeze_count()
        return self._frozen - self._frozen_after_reclaim > allowed

    def _run(self, kind: str, collect: Callable[[], int | None]) -> None:
        began = time.perf_counter()
        froze = collect()
        seconds = time.perf_counter() - began
        # Counting the frozen set walks all of it (gc.get_freeze_count is O(frozen): tens
        # of milliseconds at a million objects), so a young batch adds what it froze.
        self._frozen = gc.get_freeze_count() if froze is None else self._frozen + froze
        if self._observer is not None:
            self._observer(kind, seconds, self._frozen)

    @staticmethod
    def _freeze_loaded() -> None:
        gc.freeze()

    @staticmethod
    def _collect_young() -> int:
        gc.collect(1)
        # Everything older was frozen before: generation 2 holds just the survivors.
        survivors = len(gc.get_objects(generation=2))
        gc.freeze()
        return survivors

    @staticmethod
    def _reclaim() -> None:
        gc.unfreeze()
        gc.collect()
        gc.freeze()


def _enter() -> None:
    global _running, _found_thresholds  # noqa: PLW0603 - the collector is process-wide
    with _process_lock:
        if _running == 0:
            _found_thresholds = gc.get_threshold()
        _running += 1


def _leave() -> None:
    global _running  # noqa: PLW0603 - the collector is process-wide
    with _process_lock:
        _running -= 1
        if _running == 0 and _found_thresholds is not None:
            gc.set_threshold(*_found_thresholds)
