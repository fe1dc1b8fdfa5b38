"""Agent sessions against a real etcd: the liveness record a broker keeps for an agent,
takeovers between brokers, the status write's guards, and silent agents."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from dxpool.api.v1 import resources_pb2 as pb
from dxpool.broker.control.agent_sessions import (
    AgentSessions,
    HostHeldError,
    SessionNotLiveError,
    SessionSettings,
    StaleSpecError,
    parse_liveness,
    token_digest,
)
from dxpool.broker.state.cache import Cache
from dxpool.broker.state.stm import SESSION_ATTEMPTS
from dxpool.errors import DxpoolError, InvalidArgument, Unavailable
from dxpool.store import keys as k
from dxpool.store.keys import KeySchema
from dxpool.store.typed import Store
from tests.broker.commit_races import meddle_before_commits, writing

ATTACHED = pb.ATTACHMENT_PHASE_ATTACHED


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Ends:
    """Collects why the broker ended sessions."""

    def __init__(self) -> None:
        self.errors: list[DxpoolError] = []

    def __call__(self, error: DxpoolError) -> None:
        self.errors.append(error)


@pytest.fixture
def parts(etcd_client: Any, key_prefix: str) -> Iterator[tuple[Store, Cache]]:
    schema = KeySchema(key_prefix)
    store = Store(etcd_client, schema)
    cache = Cache(etcd_client, schema)
    cache.start()
    yield store, cache
    cache.stop()
    store.health.close()


@pytest.fixture
def brokers(parts: tuple[Store, Cache]) -> Iterator[Callable[..., AgentSessions]]:
    """Session registries as separate brokers would hold them (one lease each)."""
    store, cache = parts
    made: list[AgentSessions] = []

    def make(name: str = "b1", clock: Clock | None = None, **settings: Any) -> AgentSessions:
        sessions = AgentSessions(
            store,
            cache,
            name,
            SessionSettings(**settings),
            clock=clock or time.monotonic,
        )
        made.append(sessions)
        return sessions

    yield make
    for sessions in made:
        sessions.stop()


def registration(host: str = "h1", slots: int = 8) -> pb.Host:
    return pb.Host(
        name=f"hosts/{host}",
        slot_capacity=slots,
        location=pb.Location(site="s1", pod="p1", rack="r1"),
        labels={"gpu-class": "training"},
        alive=True,  # output only: never stored
    )


def status(*gpus: str) -> pb.HostStatus:
    return pb.HostStatus(
        attachments=[pb.ObservedAttachment(gpu=g, generation=1, phase=ATTACHED) for g in gpus]
    )


def liveness(store: Store, host: str = "h1") -> tuple[pb.HostLiveness, Any] | None:
    value, meta = store.client.get(store.keys.host_lease(host))
    return None if value is None else (parse_liveness(value), meta)


def records(store: Store) -> dict[bytes, tuple[bytes, int]]:
    return {m.key: (v, m.mod_revision) for v, m in store.client.get_prefix(store.keys.prefix)}


def test_open_registers_the_host_and_keeps_its_liveness_on_the_broker_lease(
    parts: tuple[Store, Cache], brokers: Callable[..., AgentSessions]
) -> None:
    store, cache = parts
    sessions = brokers("broker-a")

    session = sessions.open("h1", registration(), "token-1", 4000, Ends())

    host = store.get(store.keys.host("h1"))
    assert host is not None
    assert host.value.slot_capacity == 8 and dict(host.value.labels) == {"gpu-class": "training"}
    assert host.value.alive is False and host.value.HasField("register_time")
    found = liveness(store)
    assert found is not None
    record, meta = found
    assert record.agent_digest == token_digest("token-1") != b"token-1"
    assert (record.broker, record.session, record.liveness_ttl_ms) == ("broker-a", session.id, 4000)
    assert meta.lease_id == sessions.lease.lease_id
    assert meta.mod_revision == session.key_revision
    assert cache.get("hostleases", "h1") is not None  # the broker reads its own write
    # The broker's registration is on the same lease: it goes with the records.
    _, registration_meta = store.client.get(store.keys.broker("broker-a"))
    assert registration_meta.lease_id == sessions.lease.lease_id


def test_another_identity_is_refused_while_the_host_is_held(
    parts: tuple[Store, Cache], brokers: Callable[..., AgentSessions]
) -> None:
    store, _ = parts
    first, other = brokers("b1"), brokers("b2")
    first.open("h1", registration(slots=8), "token-1", 4000, Ends())
    before_records = records(store)

    with pytest.raises(HostHeldError, match="held by another live agent"):
        other.open("h1", registration(slots=2), "token-2", 4000, Ends())

    assert records(store) == before_records  # nothing written, the registration included
    assert other.get("h1") is None


def test_the_same_identity_takes_its_session_over_on_another_broker(
    parts: tuple[Store, Cache], brokers: Callable[..., AgentSessions]
) -> None:
    store, _ = parts
    first, second = brokers("b1"), brokers("b2")
    ended = Ends()
    old = first.open("h1", registration(), "token-1", 4000, ended)
    first.write_status("h1", old.id, status("boxes/b1/gpus/0"), 0)

    new = second.open("h1", registration(), "token-1", 4000, Ends())

    found = liveness(store)
    assert found is not None
    assert (found[0].broker, found[0].session) == ("b2", new.id)
    assert found[1].lease_id == second.lease.lease_id  # moved onto the new broker's lease
    # The old session cannot write any more, and its end does not touch the new record.
    with pytest.raises(SessionNotLiveError):
        first.write_status("h1", old.id, status(), 0)
    assert [type(e) for e in ended.errors] == [SessionNotLiveError]
    record = store.get(store.keys.host_status("h1"))
    assert record is not None and [a.gpu for a in record.value.attachments] == ["boxes/b1/gpus/0"]
    first.leave(old, release=True)
    assert liveness(store) is not None
    second.write_status("h1", new.id, status(), 0)


def test_two_identities_racing_for_a_free_host_one_wins(
    parts: tuple[Store, Cache], brokers: Callable[..., AgentSessions], monkeypatch: Any
) -> None:
    """Both brokers read the record absent; the second commits while the first is held
    between its read and its transaction. The first's compare fails, it reads again and
    is refused: exactly one agent holds the host."""
    store, _ = parts
    first, second = brokers("b1"), brokers("b2")
    commit = store.commit
    held = threading.Event()
    go = threading.Event()

    def held_commit(txn: Any) -> Any:
        if threading.current_thread().name == "first" and not held.is_set():
            held.set()  # it has read the record absent and built its transaction
            assert go.wait(10)
        return commit(txn)

    monkeypatch.setattr(store, "commit", held_commit)
    outcome: list[object] = []

    def open_first() -> None:
        try:
            outcome.append(first.open("h1", registration(), "token-1", 4000, Ends()))
        except DxpoolError as error:
            outcome.append(error)

    thread = threading.Thread(target=open_first, name="first")
    thread.start()
    assert held.wait(10)
    winner = second.open("h1", registration(), "token-2", 4000, Ends())
    go.set()
    thread.join(10)

    assert len(outcome) == 1 and isinstance(outcome[0], HostHeldError)
    found = liveness(store)
    assert found is not None and found[0].session == winner.id


def test_a_stale_cache_never_refuses_an_agent(
    parts: tuple[Store, Cache], brokers: Callable[..., AgentSessions]
) -> None:
    """The cache still shows another identity's record, which etcd no longer holds (its
    deletion not seen yet): the hello reads etcd before it refuses, and succeeds."""
    from dxpool.store.typed import Versioned

    store, cache = parts
    foreign = pb.HostLiveness(agent_digest=token_digest("gone"), broker="b0").SerializeToString()
    revision = store.current_revision()
    cache.apply_read(store.keys.host_lease("h1"), Versioned(foreign, revision, revision), revision)

    session = brokers().open("h1", registration(), "token-1", 4000, Ends())

    found = liveness(store)
    assert found is not None and found[0].session == session.id


def test_silent_sessions_are_reaped_together_and_a_taken_over_one_is_kept(
    parts: tuple[Store, Cache], brokers: Callable[..., AgentSessions]
) -> None:
    store, _ = parts
    clock = Clock()
    first, other = brokers("b1", clock=clock), brokers("b2")
    for index in range(5):
        first.open(f"h{index}", registration(f"h{index}"), f"token-{index}", 2000, Ends())
    taken = other.open("h4", registration("h4"), "token-4", 60_000, Ends())  # h4 moved

    clock.now += 3
    assert first.reap() == 5

    assert [liveness(store, f"h{i}") for i in range(4)] == [None] * 4
    kept = liveness(store, "h4")
    assert kept is not None and kept[0].session == taken.id
    assert first.count() == 0


def test_a_status_write_on_a_stale_spec_writes_nothing(
    parts: tuple[Store, Cache], brokers: Callable[..., AgentSessions]
) -> None:
    store, _ = parts
    sessions = brokers()
    session = sessions.open("h1", registration(), "token-1", 4000, Ends())
    spec_key = store.keys.host_allocation("h1")
    spec = pb.HostAllocation(host="hosts/h1").SerializeToString()
    read_at = int(store.client.put(spec_key, spec).header.revision)
    sessions.write_status("h1", session.id, status("boxes/b1/gpus/0"), read_at)
    store.client.put(spec_key, spec)  # the broker changed the spec

    with pytest.raises(StaleSpecError, match=f"since revision {read_at}"):
        sessions.write_status("h1", session.id, status("boxes/b1/gpus/1"), read_at)

    record = store.get(store.keys.host_status("h1"))
    assert record is not None
    assert [a.gpu for a in record.value.attachments] == ["boxes/b1/gpus/0"]
    assert record.value.host == "hosts/h1"


def test_a_silent_agent_loses_its_host_and_a_heartbeat_keeps_it(
    parts: tuple[Store, Cache], brokers: Callable[..., AgentSessions]
) -> None:
    store, _ = parts
    clock = Clock()
    sessions = brokers(clock=clock)
    ended = Ends()
    session = sessions.open("h1", registration(), "token-1", 2000, ended)
    sessions.detach(session)  # the stream broke: the host lives on until the TTL

    clock.now += 1.5
    assert sessions.heartbeat(session)  # e.g. through a new stream to this broker
    clock.now += 1.9
    assert sessions.reap() == 0
    assert liveness(store) is not None
    clock.now += 0.2
    assert sessions.reap() == 1

    assert liveness(store) is None
    assert [e.reason for e in ended.errors] == ["SESSION_NOT_LIVE"]
    assert not sessions.heartbeat(session)
    with pytest.raises(SessionNotLiveError):
        sessions.write_status("h1", session.id, status(), 0)


def test_a_goodbye_with_release_removes_the_host_at_once(
    parts: tuple[Store, Cache], brokers: Callable[..., AgentSessions]
) -> None:
    store, _ = parts
    sessions = brokers()
    kept = sessions.open("h1", registration(), "token-1", 60_000, Ends())
    sessions.leave(kept, release=False)
    assert liveness(store) is not None  # for the same identity to come back to

    again = sessions.open("h1", registration(), "token-1", 60_000, Ends())
    sessions.leave(again, release=True)
    assert liveness(store) is None
    assert sessions.get("h1") is None


def test_losing_the_broker_lease_ends_every_session(
    parts: tuple[Store, Cache], brokers: Callable[..., AgentSessions]
) -> None:
    store, _ = parts
    clock = Clock()
    sessions = brokers(clock=clock, lease_ttl_s=6)
    ends = Ends(), Ends()
    sessions.open("h1", registration("h1"), "token-1", 4000, ends[0])
    sessions.open("h2", registration("h2"), "token-2", 4000, ends[1])
    lease_id = sessions.lease.lease_id
    assert lease_id is not None
    store.client.revoke_lease(lease_id)  # as if etcd had expired it

    clock.now += 3  # a refresh is due
    sessions.lease.tick()

    assert [e.reason for end in ends for e in end.errors] == ["BROKER_LEASE_LOST"] * 2
    assert sessions.count() == 0 and sessions.lease.lease_id is None
    assert liveness(store, "h1") is None and liveness(store, "h2") is None
    sessions.open("h1", registration("h1"), "token-1", 4000, Ends())  # a new lease
    assert sessions.lease.lease_id not in (None, lease_id)


def test_a_slow_etcd_costs_sessions_nothing_until_the_lease_must_have_expired(
    parts: tuple[Store, Cache], brokers: Callable[..., AgentSessions], monkeypatch: Any
) -> None:
    from dxpool.errors import Unavailable

    store, _ = parts
    clock = Clock()
    sessions = brokers(clock=clock, lease_ttl_s=6)
    ended = Ends()
    sessions.open("h1", registration("h1"), "token-1", 60_000, ended)
    call = store.call

    def failing(operation: Any, *, write: bool) -> Any:
        if getattr(operation, "__name__", "") == "refresh":
            raise Unavailable("etcd answers too slowly", reason="ETCD_UNAVAILABLE")
        return call(operation, write=write)

    monkeypatch.setattr(store, "call", failing)
    for _ in range(5):  # refreshes fail for most of the TTL
        clock.now += 1.1
        sessions.lease.tick()
    assert ended.errors == [] and sessions.count() == 1
    clock.now += 1.0  # a whole TTL without a refresh: by etcd's clock it is gone
    sessions.lease.tick()
    assert [e.reason for e in ended.errors] == ["BROKER_LEASE_LOST"]


@pytest.mark.parametrize(
    ("host", "token", "match"),
    [
        (pb.Host(name="hosts/h2", slot_capacity=8), "t", "set host.name to hosts/h1"),
        (pb.Host(name="hosts/h1", slot_capacity=0), "t", "slot_capacity 0"),
        (pb.Host(name="hosts/h1", slot_capacity=8, labels={"a": "x\ny"}), "t", "non-printable"),
        (pb.Host(name="hosts/h1", slot_capacity=8), "", "identity token"),
    ],
)
def test_a_bad_registration_is_refused_and_writes_nothing(
    parts: tuple[Store, Cache],
    brokers: Callable[..., AgentSessions],
    host: pb.Host,
    token: str,
    match: str,
) -> None:
    store, _ = parts
    with pytest.raises(InvalidArgument, match=match):
        brokers().open("h1", host, token, 4000, Ends())
    assert list(store.client.get_prefix(store.keys.prefix)) == []


def test_a_status_record_is_checked_before_it_is_written(
    parts: tuple[Store, Cache], brokers: Callable[..., AgentSessions]
) -> None:
    store, _ = parts
    sessions = brokers()
    session = sessions.open("h1", registration(), "token-1", 4000, Ends())
    too_many = status(*(f"boxes/b{i}/gpus/0" for i in range(513)))
    for bad, match in (
        (pb.HostStatus(host="hosts/h2"), "its own host"),
        (too_many, "send at most 512"),
        (status("gpus/b1/0"), "gpu"),
        (status("boxes/b1/gpus/0", "boxes/b1/gpus/0"), "reported twice"),
    ):
        with pytest.raises(InvalidArgument, match=match):
            sessions.write_status("h1", session.id, bad, 0)
    assert store.get(store.keys.host_status("h1")) is None


def test_a_liveness_record_that_keeps_changing_is_unavailable_after_the_last_attempt(
    parts: tuple[Store, Cache], brokers: Callable[..., AgentSessions], monkeypatch: Any
) -> None:
    """Another session of the same agent rewrites the host's liveness record after each
    try read it and before its commit: every try loses its compare and reads the record
    again (the cache takes it too); after the last the hello is UNAVAILABLE
    (SESSION_CONTENDED) and nothing of it is written."""
    store, cache = parts
    key = store.keys.host_lease("h1")
    mine = pb.HostLiveness(agent_digest=token_digest("token-1"), broker="b9")

    def take_over() -> None:
        mine.session = f"other-{len(tries)}"
        store.client.put(key, mine.SerializeToString())

    tries = meddle_before_commits(store, monkeypatch, writing(key), take_over, times=1000)
    with pytest.raises(Unavailable) as contended:
        brokers().open("h1", registration(), "token-1", 4000, Ends())
    assert contended.value.reason == "SESSION_CONTENDED"
    assert len(tries) == SESSION_ATTEMPTS
    found = liveness(store)
    assert found is not None and found[0].session == f"other-{SESSION_ATTEMPTS}"
    assert store.client.get(store.keys.host("h1"))[0] is None
    cached = cache.get(k.HOST_LEASES, "h1")
    assert cached is not None and cached.mod_revision == found[1].mod_revision
