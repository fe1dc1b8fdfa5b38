"""Keep one key prefix listed and watched across etcd member failures and outages.

python3-etcd3's watch does not survive the loss of a member: it runs on whichever
endpoint its client holds, its failure never marks that endpoint failed (so a re-list
picks the dead member again), it cannot ask for progress, and a watch on a member that
is paused or cut off from its peers just goes quiet. :class:`PrefixWatch` runs etcd's
Watch API itself, through the stubs python3-etcd3 generates:

* The first session lists the prefix (in pages, all at one revision) and watches from
  the next revision. Later sessions resume from the revision after the last event
  delivered; they list again only when that revision has been compacted away.
* A failed session moves to the next member at once. Once every member has failed in a
  row, sessions back off (jittered exponential, at most ``max_backoff_s``), so a watch
  resumes within about that long after etcd is back.
* Every stream carries etcd's require-leader metadata, so a member that loses its leader
  ends the stream, and sends a progress request every ``progress_interval_s``; a stream
  that answers nothing for ``progress_interval_s + progress_timeout_s`` is abandoned
  (a paused member, a dead connection).
* ``on_list(kvs, revision)`` and ``on_events(response)`` run on the watch thread, in
  revision order; ``on_state(connected)`` runs there on every change, which is also
  logged once (a warning when the watch is lost, an info line when it resumes).

Progress responses are used only as a sign of life: etcd 3.5 before 3.5.8 may answer a
progress request with a revision its watchers have not delivered yet, so the resume
revision follows delivered events only.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import queue
import random
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import etcd3.events
import etcd3.watch
import grpc
import tenacity
from etcd3 import etcdrpc

from dxpool.errors import Unavailable
from dxpool.store.client import REQUIRE_LEADER, EtcdAddress, channel
from dxpool.store.errors import classify

log = logging.getLogger(__name__)

ListHandler = Callable[[Sequence[Any], int], None]
EventHandler = Callable[[etcd3.watch.WatchResponse], None]
StateHandler = Callable[[bool], None]

_PROGRESS_WATCH_ID = -1  # etcd answers a progress request outside any watch
# A session that ran at least this long and then broke fails over at once; one that broke
# sooner counts as a failed attempt, so a member that keeps dropping watches is backed off.
_SETTLED_S = 1.0
WAIT_WARNING_INTERVAL_S = 5.0


class WatchLostError(Exception):
    """A watch session ended; the message says why."""


class PrefixWatch:
    """An informer's connection to etcd: list once, then watch, failing over for ever.

    ``start`` blocks until the first list has been delivered and the watch is running;
    ``stop`` ends it. Thread-safe accessors tell whether the watch is connected and how
    stale the data it delivered may be.
    """

    def __init__(
        self,
        addresses: Sequence[EtcdAddress],
        prefix: str,
        *,
        on_list: ListHandler,
        on_events: EventHandler,
        on_state: StateHandler | None = None,
        name: str = "watch",
        page_size: int = 5000,
        list_timeout_s: float = 30.0,
        progress_interval_s: float = 0.5,
        progress_timeout_s: float = 1.5,
        max_backoff_s: float = 0.5,
        single_key: bool = False,
    ) -> None:
        """``single_key`` lists and watches ``prefix`` as one key and nothing that
        extends it: the range etcd's permission on that one key covers."""
        if not addresses:
            raise ValueError("PrefixWatch needs at least one etcd endpoint")
        self._addresses = list(addresses)
        self._prefix = prefix.encode()
        self._range_end = (
            self._prefix + b"\0" if single_key else etcd3.utils.prefix_range_end(self._prefix)
        )
        self._on_list = on_list
        self._on_events = on_events
        self._on_state = on_state
        self._name = name
        self._page_size = page_size
        self._list_timeout_s = list_timeout_s
        self._progress_interval_s = progress_interval_s
        self._progress_timeout_s = progress_timeout_s
        self._max_backoff_s = max_backoff_s
        self._next_index = random.randrange(len(self._addresses))
        self._channels: dict[EtcdAddress, grpc.Channel] = {}
        self._lock = threading.Lock()
        self._next_revision: int | None = None
        self._connected = False
        self._last_current = time.monotonic()
        self._address: EtcdAddress | None = None
        self._last_error = ""
        self._stream: _Stream | None = None
        self._stopped = threading.Event()
        self._first = threading.Event()
        self._thread: threading.Thread | None = None
        self._wait_for_etcd = False
        self._waiting_since = 0.0
        self._warned_at = 0.0

    # -- lifecycle -------------------------------------------------------------------

    def start(self, timeout_s: float = 30.0, *, wait_for_etcd: bool = False) -> None:
        """List and start watching. Raises :class:`Unavailable` when no member could
        list and watch (each is tried once) or the first list took over ``timeout_s``.

        ``wait_for_etcd`` keeps trying (with the watch's backoff) until ``timeout_s``
        instead of giving up after one round of the members: for a process that starts
        beside an etcd that may not answer yet, or whose first connection fails once (a
        TLS handshake cut short). It logs a warning when it starts waiting and every
        ``WAIT_WARNING_INTERVAL_S`` after."""
        self._wait_for_etcd = wait_for_etcd
        self._waiting_since = time.monotonic()
        self._thread = threading.Thread(target=self._run, name=f"{self._name}", daemon=True)
        self._thread.start()
        self._first.wait(timeout_s)
        if not self.connected:
            error = self._last_error or f"no answer within {timeout_s:g}s"
            self.stop()
            endpoints = ",".join(str(a) for a in self._addresses)
            raise Unavailable(
                f"cannot list and watch etcd at {endpoints} ({error}); "
                "check that etcd runs and the endpoints are right",
                reason="ETCD_UNAVAILABLE",
            )

    def stop(self) -> None:
        """End the watch and close its channels. Idempotent."""
        self._stopped.set()
        with self._lock:
            stream = self._stream
            channels = list(self._channels.values())
            self._channels.clear()
        if stream is not None:
            stream.close()
        for ch in channels:  # also ends a listing in flight
            ch.close()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=10)

    # -- state -----------------------------------------------------------------------

    @property
    def connected(self) -> bool:
        with self._lock:
            return self._connected

    @property
    def endpoint(self) -> EtcdAddress | None:
        """The member the watch uses now (or last tried)."""
        with self._lock:
            return self._address

    @property
    def last_error(self) -> str:
        with self._lock:
            return self._last_error

    def lag_s(self) -> float:
        """0 while connected; otherwise seconds since the watch was last known current
        (its last answer on a live stream), i.e. how stale delivered data may be."""
        with self._lock:
            return 0.0 if self._connected else time.monotonic() - self._last_current

    def _heard(self) -> None:
        with self._lock:
            if self._connected:
                self._last_current = time.monotonic()

    def _set_connected(self, address: EtcdAddress) -> None:
        with self._lock:
            was = self._connected
            down_s = time.monotonic() - self._last_current
            self._connected = True
            self._last_current = time.monotonic()
        self._first.set()
        if was:
            return
        log.info(
            "etcd watch running",
            extra={"watch": self._name, "endpoint": str(address), "down_s": round(down_s, 3)},
        )
        self._notify(True)

    def _set_lost(self, address: EtcdAddress, error: str) -> None:
        with self._lock:
            was = self._connected
            self._connected = False
            self._last_error = f"{address}: {error}"
        if not was:
            log.debug("etcd watch attempt failed", extra={"endpoint": str(address), "error": error})
            return
        log.warning(
            "etcd watch lost; failing over",
            extra={"watch": self._name, "endpoint": str(address), "error": error},
        )
        self._notify(False)

    def _notify(self, connected: bool) -> None:
        if self._on_state is None:
            return
        try:
            self._on_state(connected)
        except Exception:
            log.exception("watch state handler failed", extra={"watch": self._name})

    # -- the loop --------------------------------------------------------------------

    def _run(self) -> None:
        members = len(self._addresses)
        while not self._stopped.is_set():
            retrying = tenacity.Retrying(
                retry=tenacity.retry_if_exception_type(WatchLostError),
                wait=_WaitPerRound(
                    members,
                    tenacity.wait_exponential(multiplier=0.05, max=self._max_backoff_s)
                    + tenacity.wait_random(0, 0.05),
                ),
                stop=tenacity.stop_when_event_set(self._stopped),
                sleep=self._sleep,
                after=self._after_failed_attempt,
                retry_error_callback=lambda state: None,
            )
            retrying(self._one_session)

    def _sleep(self, seconds: float) -> None:
        self._stopped.wait(seconds)

    def _after_failed_attempt(self, state: tenacity.RetryCallState) -> None:
        if self._first.is_set():
            return
        if self._wait_for_etcd:
            self._warn_waiting()
        elif state.attempt_number >= len(self._addresses):
            self._first.set()  # a whole round failed before the watch ever ran: give up

    def _warn_waiting(self) -> None:
        """While ``start`` waits for etcd: one warning now and then, naming the error."""
        now = time.monotonic()
        if self._warned_at and now - self._warned_at < WAIT_WARNING_INTERVAL_S:
            return
        self._warned_at = now
        log.warning(
            "etcd not reachable yet; retrying",
            extra={
                "watch": self._name,
                "waited_s": round(now - self._waiting_since, 1),
                "error": self.last_error,
            },
        )

    def _one_session(self) -> None:
        """One session on the next member. Returns when stopped, or when a session that
        had been running for a while broke (the caller then starts over without waiting);
        raises :class:`WatchLostError` otherwise."""
        address = self._addresses[self._next_index]
        self._next_index = (self._next_index + 1) % len(self._addresses)
        with self._lock:
            self._address = address
        running = threading.Event()
        started = time.monotonic()
        try:
            self._session(address, running)
        except Exception as error:
            if self._stopped.is_set():
                return
            self._set_lost(address, _describe(error))
            if running.is_set() and time.monotonic() - started >= _SETTLED_S:
                return
            raise WatchLostError(_describe(error)) from error

    def _session(self, address: EtcdAddress, running: threading.Event) -> None:
        ch = self._channel(address)
        if self._next_revision is None:
            self._next_revision = self._list(ch) + 1
        stream = _Stream(
            ch,
            etcdrpc.WatchRequest(
                create_request=etcdrpc.WatchCreateRequest(
                    key=self._prefix,
                    range_end=self._range_end,
                    start_revision=self._next_revision,
                )
            ),
            self._progress_interval_s,
            self._progress_interval_s + self._progress_timeout_s,
        )
        with self._lock:
            self._stream = stream
        if self._stopped.is_set():
            stream.close()
            return
        try:
            for response in stream.responses():
                self._heard()
                self._handle(address, response, running)
        except grpc.RpcError as error:
            if stream.end_reason():
                raise WatchLostError(stream.end_reason()) from error
            raise
        finally:
            stream.close()
        if not self._stopped.is_set():
            raise WatchLostError(stream.end_reason() or "etcd closed the watch stream")

    def _handle(self, address: EtcdAddress, response: Any, running: threading.Event) -> None:
        if response.compact_revision:
            self._next_revision = None  # history is gone: list again
            raise WatchLostError(f"revision compacted (oldest kept: {response.compact_revision})")
        if response.canceled:
            reason = response.cancel_reason or "no reason given"
            raise WatchLostError(f"etcd canceled the watch: {reason}")
        if response.created:
            running.set()
            self._set_connected(address)
            return
        if response.watch_id == _PROGRESS_WATCH_ID or not response.events:
            return
        events = [etcd3.events.new_event(event) for event in response.events]
        try:
            self._on_events(etcd3.watch.WatchResponse(response.header, events))
        except Exception:
            log.exception("watch event handler failed", extra={"watch": self._name})
        self._next_revision = max(event.kv.mod_revision for event in response.events) + 1

    def _list(self, ch: grpc.Channel) -> int:
        """Read the prefix in pages at one revision, hand it to ``on_list``; the revision."""
        stub = etcdrpc.KVStub(ch)
        kvs: list[Any] = []
        revision = 0
        key = self._prefix
        while True:
            response = stub.Range(
                etcdrpc.RangeRequest(
                    key=key, range_end=self._range_end, limit=self._page_size, revision=revision
                ),
                timeout=self._list_timeout_s,
                metadata=REQUIRE_LEADER,
            )
            revision = revision or int(response.header.revision)
            kvs.extend(response.kvs)
            if not response.more or not response.kvs:
                break
            key = response.kvs[-1].key + b"\0"
        self._on_list(kvs, revision)
        return revision

    def _channel(self, address: EtcdAddress) -> grpc.Channel:
        with self._lock:
            if self._stopped.is_set():
                raise WatchLostError("the watch is stopped")
            ch = self._channels.get(address)
            if ch is None:
                ch = self._channels[address] = channel(address)
            return ch


class _Stream:
    """One Watch call: the create request, then a progress request every interval; gives
    up (cancels the call) when nothing has been heard for ``silence_s``."""

    def __init__(self, ch: grpc.Channel, create: Any, interval_s: float, silence_s: float) -> None:
        self._create = create
        self._interval_s = interval_s
        self._silence_s = silence_s
        self._closed = threading.Event()
        self._wake: queue.SimpleQueue[None] = queue.SimpleQueue()
        self._last_heard = time.monotonic()
        self._silent = False
        self._call: Any = None
        self._call = etcdrpc.WatchStub(ch).Watch(self._requests(), metadata=REQUIRE_LEADER)

    def responses(self) -> Iterator[Any]:
        for response in self._call:
            self._last_heard = time.monotonic()
            yield response

    def _requests(self) -> Iterator[Any]:
        yield self._create
        while not self._closed.is_set():
            with contextlib.suppress(queue.Empty):
                self._wake.get(timeout=self._interval_s)
            if self._closed.is_set():
                return
            if time.monotonic() - self._last_heard > self._silence_s:
                self._silent = True
                if self._call is not None:
                    self._call.cancel()
                return
            yield etcdrpc.WatchRequest(progress_request=etcdrpc.WatchProgressRequest())

    def end_reason(self) -> str:
        if self._silent:
            return f"the member answered nothing for {self._silence_s:g}s"
        return ""

    def close(self) -> None:
        self._closed.set()
        self._wake.put(None)
        if self._call is not None:
            self._call.cancel()


class _WaitPerRound(tenacity.wait.wait_base):
    """No wait while members of the current round are untried; ``inner`` between rounds,
    counting rounds rather than attempts."""

    def __init__(self, members: int, inner: tenacity.wait.wait_base) -> None:
        self._members = members
        self._inner = inner

    def __call__(self, retry_state: tenacity.RetryCallState) -> float:
        if retry_state.attempt_number % self._members:
            return 0.0
        rounds = copy.copy(retry_state)
        rounds.attempt_number = retry_state.attempt_number // self._members
        return float(self._inner(rounds))


def _describe(error: BaseException) -> str:
    if isinstance(error, WatchLostError):
        return str(error)
    failure = classify(error)
    return str(failure) if failure is not None else repr(error)


__all__ = ["EventHandler", "ListHandler", "PrefixWatch", "StateHandler", "WatchLostError"]
