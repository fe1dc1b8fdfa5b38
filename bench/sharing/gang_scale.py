"""A gang of 1,536 members of 8 GPUs (12,288 GPUs, all or nothing) on a pool of
100,000 GPUs: how long it takes and how many etcd transactions it needs.

The pool is ``bench/scale.py``'s (8 GPUs per box, one host of 8 slots per box, racks of
16, pods of 16 racks; boxes registered through a broker's API, hosts written as their
agents would, alive on one shared lease), in a private etcd (``--unsafe-no-fsync``, as
``bench/scale.py`` runs it). A broker runs in this process, and both measurements call
its own code:

* **baseline**: the same 12,288 GPUs as 1,536 independent ComposeNode calls of 8 GPUs,
  one after another (``Composer.compose``, one transaction each): what composing the
  job costs without all or nothing;
* **gang**: one ComposeGang of 1,536 members through the chunked path
  (``ChunkedGangs.compose``): every member placed and held first, then the gang record,
  the members in chunks of as many as one transaction holds, and the flip to VALID.

Both run on the same pool (the gang on the hosts the baseline left free), and the table
gives the gang's figures against the baseline's. Nothing is asserted.

Usage: python -m bench.sharing.gang_scale [--gpus 100000] [--members 1536]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script, too

from bench.scale import GPUS_PER_BOX, PREFIX, load_pool, progress, rss_mib
from dxpool.api.v1 import nodes_pb2
from dxpool.api.v1 import resources_pb2 as pb
from dxpool.broker.api.server import BrokerConfig, BrokerServer
from dxpool.broker.control.sharing_duties import SharingSettings
from dxpool.broker.nodes import gang_chunks
from dxpool.broker.nodes.gang_chunks import ChunkedGangs
from dxpool.broker.nodes.gang_placement import GangPlacer
from dxpool.store.client import connect
from dxpool.store.embedded import EmbeddedEtcd
from dxpool.store.keys import KeySchema
from dxpool.store.typed import Store, Txn


class Counted:
    """Wraps a store's commit to count transactions and their operations."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.real = store.commit
        self.transactions = 0
        self.largest = 0
        self.seconds = 0.0
        store.commit = self.commit  # type: ignore[method-assign]

    def commit(self, txn: Txn) -> object:
        self.transactions += 1
        self.largest = max(self.largest, len(txn.compares), len(txn.success))
        began = time.perf_counter()
        try:
            return self.real(txn)
        finally:
            self.seconds += time.perf_counter() - began

    def reset(self) -> None:
        self.transactions, self.largest, self.seconds = 0, 0, 0.0


@dataclass(frozen=True)
class Run:
    seconds: float
    transactions: int
    commit_s: float
    largest: int
    placing_s: float


def report(args: argparse.Namespace, load_s: float, baseline: Run, gang: Run) -> None:
    boxes = args.gpus // GPUS_PER_BOX
    print(
        f"pool {args.gpus:,} GPUs ({boxes:,} boxes, {boxes:,} hosts of 8 slots), loaded in "
        f"{load_s:.0f}s; this process's RSS {rss_mib(os.getpid()):.0f} MiB"
    )
    print(
        "| what | seconds | etcd transactions | members per transaction "
        "| largest transaction (ops) | placing | committing |"
    )
    print("|---|---|---|---|---|---|---|")
    print(
        f"| {args.members} ComposeNode x 8 GPUs (baseline) | {baseline.seconds:.1f} "
        f"| {baseline.transactions} | 1 | - | - | {baseline.commit_s:.1f}s |"
    )
    print(
        f"| ComposeGang {args.members} x 8 GPUs, all or nothing | {gang.seconds:.1f} "
        f"| {gang.transactions} | {args.members / max(gang.transactions - 2, 1):.1f} "
        f"| {gang.largest} | {gang.placing_s:.1f}s | {gang.commit_s:.1f}s |"
    )
    print(
        f"gang / baseline: time {gang.seconds / baseline.seconds:.2f}x, "
        f"transactions {gang.transactions / baseline.transactions:.3f}x"
    )


def compose_singly(broker: BrokerServer, counted: Counted, spec: pb.NodeSpec, count: int) -> Run:
    """``count`` ComposeNode calls, one after another, each its own transaction."""
    assert broker.composer is not None
    counted.reset()
    began = time.perf_counter()
    for i in range(count):
        broker.composer.compose(nodes_pb2.ComposeNodeRequest(spec=spec, node_id=f"single-{i}"))
    return Run(time.perf_counter() - began, counted.transactions, counted.seconds, 0, 0.0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpus", type=int, default=100_000)
    parser.add_argument("--members", type=int, default=1536)
    args = parser.parse_args(argv)
    boxes = args.gpus // GPUS_PER_BOX
    if boxes < 2 * args.members:
        print("error: the pool needs at least two hosts per member", file=sys.stderr)
        return 2
    work = Path(tempfile.mkdtemp(prefix="dxpool-gang-"))
    with EmbeddedEtcd(work / "etcd", unsafe_no_fsync=True) as etcd:
        client = connect(etcd.endpoint, timeout_s=60)
        store = Store(client, KeySchema(PREFIX))
        began = time.monotonic()
        progress(f"{args.gpus:,} GPUs: loading the pool")
        load_pool(etcd.endpoint, store, boxes)
        load_s = time.monotonic() - began
        progress(f"loaded in {load_s:.0f}s; starting a broker")
        broker = BrokerServer(
            BrokerConfig(
                etcd_endpoints=etcd.endpoint,
                key_prefix=PREFIX,
                listen="127.0.0.1:0",
                etcd_timeout_s=30.0,
                sharing=SharingSettings(interval_s=3600.0),
            )
        ).start()
        try:
            assert broker.composer is not None and broker.gangs is not None
            counted = Counted(broker.store)
            gangs: ChunkedGangs = broker.gangs
            spec = pb.NodeSpec(gpus=pb.GpuRequest(model="H100", count=GPUS_PER_BOX))

            progress(f"baseline: {args.members} ComposeNode calls of 8 GPUs")
            baseline = compose_singly(broker, counted, spec, args.members)

            progress(f"gang: {args.members} members of 8 GPUs, all or nothing")
            placing = {"s": 0.0}
            real_place_all = GangPlacer.place_all

            def timed_place_all(self: GangPlacer, *a: object, **kw: object) -> object:
                started = time.perf_counter()
                try:
                    return real_place_all(self, *a, **kw)  # type: ignore[arg-type]
                finally:
                    placing["s"] += time.perf_counter() - started

            gang_chunks.GangPlacer.place_all = timed_place_all  # type: ignore[method-assign]
            counted.reset()
            chunks_before = gangs.transactions
            began = time.perf_counter()
            gang = gangs.compose(
                nodes_pb2.ComposeGangRequest(members=[spec] * args.members, gang_id="big")
            )
            gang_s = time.perf_counter() - began
            gang_txns = counted.transactions
            assert gang.state == pb.GANG_STATE_VALID and len(gang.nodes) == args.members
            report(
                args,
                load_s,
                baseline,
                Run(gang_s, gang_txns, counted.seconds, counted.largest, placing["s"]),
            )
            print(f"(the chunked path's own count: {gangs.transactions - chunks_before})")
        finally:
            broker.stop(grace_s=0)
            client.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
