"""Client load for chaos runs: threads that compose, wait, hold and release nodes.

Each :class:`Worker` loops: ``compose_node`` (1-3 GPUs, a fresh ``request_id``) ->
``wait_for_node`` (bounded) -> hold for a moment -> ``release_node``. Everything it sees
goes into the shared :class:`OpLog`:

* every acknowledged compose (the client got a node back): the node, the broker that
  answered, and when — :func:`tests.chaos.invariants.check_acknowledged` checks that each
  one is in etcd;
* every released node, so a node the test released may legitimately disappear;
* every result by operation and code. UNAVAILABLE, ABORTED, RESOURCE_EXHAUSTED,
  DEADLINE_EXCEEDED and CANCELLED are expected while faults run; any other code (INTERNAL
  and UNKNOWN above all) is an unexpected error and a violation: the requests are valid.

A compose that ended ambiguously (UNAVAILABLE, DEADLINE_EXCEEDED: it may have committed)
is retried later with the same ``request_id`` and spec, which returns the node if it
exists; the node is then released. A release that failed is retried the same way. A
worker prefers one broker and moves to the other while its own does not answer.
"""

from __future__ import annotations

import random
import threading
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any

import grpc

from dxpool.api.v1 import resources_pb2 as pb
from dxpool.client import Client
from dxpool.errors import DxpoolError

EXPECTED_CODES = frozenset(
    {
        "UNAVAILABLE",
        "ABORTED",
        "RESOURCE_EXHAUSTED",
        "DEADLINE_EXCEEDED",
        "CANCELLED",
    }
)
AMBIGUOUS_CODES = frozenset({"UNAVAILABLE", "DEADLINE_EXCEEDED", "CANCELLED"})
# States wait_for_node stops at: READY, or any state from which READY cannot follow.
WAIT_UNTIL = ("READY", "FAILED", "LOST", "RELEASING", "RELEASED")


@dataclass(frozen=True)
class OpError:
    """An unexpected result: which operation, its code and message, and when."""

    op: str
    code: str
    message: str
    at: float
    subject: str = ""


@dataclass(frozen=True)
class Ack:
    node: str
    endpoint: str
    at: float
    request_id: str


@dataclass
class OpLog:
    """Thread-safe record of everything the clients saw (times: ``time.monotonic()``)."""

    results: dict[str, Counter[str]] = field(default_factory=lambda: defaultdict(Counter))
    acks: dict[str, Ack] = field(default_factory=dict)
    released: set[str] = field(default_factory=set)
    ready: list[tuple[float, str, str]] = field(default_factory=list)  # (at, host, node)
    unexpected: list[OpError] = field(default_factory=list)
    iterations: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def result(self, op: str, code: str) -> None:
        with self._lock:
            self.results[op][code] += 1

    def failure(self, op: str, error: DxpoolError, subject: str = "") -> str:
        """Count the error; keep it if its code is unexpected. Returns the code name."""
        code = error.code.name
        with self._lock:
            self.results[op][code] += 1
            if code not in EXPECTED_CODES:
                self.unexpected.append(OpError(op, code, error.message, time.monotonic(), subject))
        return code

    def ack(self, node: str, endpoint: str, request_id: str) -> None:
        with self._lock:
            if node not in self.acks:
                self.acks[node] = Ack(node, endpoint, time.monotonic(), request_id)

    def release(self, node: str) -> None:
        with self._lock:
            self.released.add(node)

    def became_ready(self, node: pb.VirtualNode) -> None:
        with self._lock:
            self.ready.append((time.monotonic(), node.host, node.name))

    def iteration(self) -> None:
        with self._lock:
            self.iterations += 1

    def acked_at(self) -> dict[str, float]:
        with self._lock:
            return {name: ack.at for name, ack in self.acks.items()}

    def released_nodes(self) -> set[str]:
        with self._lock:
            return set(self.released)

    def first_ack_after(self, since: float, endpoint: str | None = None) -> float | None:
        with self._lock:
            times = [
                a.at
                for a in self.acks.values()
                if a.at > since and (endpoint is None or a.endpoint == endpoint)
            ]
        return min(times, default=None)

    def first_ready_after(self, since: float, host: str | None = None) -> float | None:
        with self._lock:
            times = [at for at, h, _ in self.ready if at > since and (host is None or h == host)]
        return min(times, default=None)

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {
                "iterations": self.iterations,
                "operations": {op: dict(codes) for op, codes in sorted(self.results.items())},
                "acknowledged_composes": len(self.acks),
                "released": len(self.released),
            }


@dataclass
class _Pending:
    request_id: str
    gpus: str
    tries: int = 0
    kwargs: dict[str, Any] = field(default_factory=dict)


class Worker(threading.Thread):
    """One client thread; see the module docstring. ``stop`` ends it after its current
    step, releasing what it holds first."""

    def __init__(
        self,
        index: int,
        endpoints: list[str],
        log: OpLog,
        stop: threading.Event,
        seed: int,
        *,
        wait_bound_s: float = 12.0,
        max_gpus: int = 3,
    ) -> None:
        super().__init__(name=f"chaos-worker-{index}", daemon=True)
        self.index = index
        self.endpoints = endpoints
        self.log = log
        self.stop_event = stop
        self.rng = random.Random(seed)
        self.wait_bound_s = wait_bound_s
        self.max_gpus = max_gpus
        self.clients = [Client(e, timeout_s=5.0, max_attempts=4) for e in endpoints]
        self.preferred = index % len(endpoints)
        self.unresolved: list[_Pending] = []
        self.unreleased: dict[str, int] = {}
        self.crashed: BaseException | None = None

    def run(self) -> None:
        try:
            while not self.stop_event.is_set():
                self._iteration()
            self._finish()
        except BaseException as error:  # a bug in the test itself: surface it
            self.crashed = error
            raise
        finally:
            for client in self.clients:
                client.close()

    def hold_s(self) -> tuple[float, float]:
        """How long (from, to) this worker holds a node before releasing it."""
        return (0.2, 1.5)

    def compose_kwargs(self, gpus: str) -> dict[str, Any]:
        """Extra arguments of this worker's composes (the same for a retry of one)."""
        return {}

    def _order(self) -> list[int]:
        others = [i for i in range(len(self.clients)) if i != self.preferred]
        return [self.preferred, *others]

    def _call(self, op: str, call: Any, subject: str = "") -> tuple[Any, str, str]:
        """Run ``call(client)`` on the preferred broker, then the others while the code is
        UNAVAILABLE. Returns (result or None, code, endpoint)."""
        code = "UNAVAILABLE"
        endpoint = ""
        for index in self._order():
            client = self.clients[index]
            endpoint = client.endpoint
            try:
                return call(client), "OK", endpoint
            except DxpoolError as error:
                code = self.log.failure(op, error, subject)
                if code != "UNAVAILABLE":
                    return None, code, endpoint
        return None, code, endpoint

    def _iteration(self) -> None:
        self.log.iteration()
        self._retry_pending()
        gpus = f"H100:{self.rng.randint(1, self.max_gpus)}"
        request_id = f"chaos-w{self.index}-{self.rng.getrandbits(48):012x}"
        kwargs = self.compose_kwargs(gpus)
        node, code, endpoint = self._call(
            "compose", lambda c: c.compose_node(gpus, request_id=request_id, **kwargs)
        )
        if node is None:
            if code in AMBIGUOUS_CODES:
                self.unresolved.append(_Pending(request_id, gpus, kwargs=kwargs))
            self._pause(0.2, 0.6)
            return
        self.log.result("compose", "OK")
        self.log.ack(node.name, endpoint, request_id)
        self._wait(node.name)
        self._pause(*self.hold_s())
        self._release(node.name)
        self._pause(0.05, 0.2)

    def _wait(self, name: str) -> None:
        try:
            node = self.clients[self.preferred].wait_for_node(
                name, until=WAIT_UNTIL, timeout_s=self.wait_bound_s
            )
        except TimeoutError:
            self.log.result("wait", "TIMEOUT")
            return
        except DxpoolError as error:
            self.log.failure("wait", error, name)
            return
        state = pb.NodeState.Name(node.state).removeprefix("NODE_STATE_")
        self.log.result("wait", state)
        if node.state == pb.NODE_STATE_READY:
            self.log.became_ready(node)

    def _release(self, name: str) -> bool:
        _, code, _ = self._call("release", lambda c: c.release_node(name), name)
        if code == "OK":
            self.log.result("release", "OK")
            self.log.release(name)
            self.unreleased.pop(name, None)
            return True
        self.unreleased[name] = self.unreleased.get(name, 0) + 1
        return False

    def _retry_pending(self, limit: int = 20) -> None:
        for name, tries in list(self.unreleased.items()):
            if tries < limit:
                self._release(name)
        still: list[_Pending] = []
        for pending in self.unresolved:
            pending.tries += 1
            node, code, endpoint = self._call(
                "adopt",
                lambda c, p=pending: c.compose_node(p.gpus, request_id=p.request_id, **p.kwargs),
            )
            if node is not None:
                self.log.result("adopt", "OK")
                self.log.ack(node.name, endpoint, pending.request_id)
                self._release(node.name)
            elif code in AMBIGUOUS_CODES and pending.tries < limit:
                still.append(pending)
        self.unresolved = still

    def _finish(self) -> None:
        """After stop: give back what this worker holds, retrying for a while."""
        deadline = time.monotonic() + 20
        while (self.unreleased or self.unresolved) and time.monotonic() < deadline:
            self._retry_pending(limit=1000)
            if self.unreleased or self.unresolved:
                time.sleep(0.5)

    def _pause(self, low: float, high: float) -> None:
        self.stop_event.wait(self.rng.uniform(low, high))


def code_name(error: grpc.RpcError) -> str:
    """The status code name of a raw gRPC error."""
    code = error.code()
    return str(code.name) if code is not None else "UNKNOWN"


__all__ = ["EXPECTED_CODES", "Ack", "OpError", "OpLog", "Worker", "code_name"]
