"""Where a compose spends its time at a given pool size: cProfile around the broker's
``Composer.compose``.

Loads a pool the way ``bench/scale.py`` does (``--boxes`` boxes of 8 GPUs and as many
live hosts, private etcd), starts a broker in this process, wraps ``Composer.compose`` in
a profiler (each call is profiled in the thread that serves it), makes ``--composes``
1-GPU composes one after the other, and prints composes/s and the functions by
cumulative time. The profiler slows everything down; read shares, not absolute times.

Usage: python bench/profile_compose.py [--boxes 1250] [--composes 200]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.scale import PREFIX, load_pool
from dxpool.broker.api.server import BrokerConfig, BrokerServer
from dxpool.client import Client
from dxpool.store.client import connect
from dxpool.store.embedded import EmbeddedEtcd
from dxpool.store.keys import KeySchema
from dxpool.store.typed import Store


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--boxes", type=int, default=1250, help="boxes (and hosts) to load")
    parser.add_argument("--composes", type=int, default=200, help="composes to profile")
    parser.add_argument("--lines", type=int, default=30, help="functions to print")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="dxpool-profile-"))
    with EmbeddedEtcd(work / "etcd", unsafe_no_fsync=True) as etcd:
        client = connect(etcd.endpoint, timeout_s=30)
        load_pool(etcd.endpoint, Store(client, KeySchema(PREFIX)), args.boxes)
        config = BrokerConfig(
            etcd_endpoints=etcd.endpoint,
            key_prefix=PREFIX,
            listen="127.0.0.1:0",
            agent_listen="127.0.0.1:0",
            attach_timeout_s=3600,
        )
        broker = BrokerServer(config).start()
        try:
            profile = cProfile.Profile()
            assert broker.nodes is not None
            composer: Any = broker.nodes._composer
            compose = composer.compose

            def profiled(*args: Any, **kwargs: Any) -> Any:
                profile.enable()
                try:
                    return compose(*args, **kwargs)
                finally:
                    profile.disable()

            composer.compose = profiled
            with Client(broker.endpoint) as api:
                began = time.perf_counter()
                for _ in range(args.composes):
                    api.compose_node("H100:1")
                elapsed = time.perf_counter() - began
            print(f"{args.composes / elapsed:.1f} serial composes/s (profiled)")
            out = io.StringIO()
            pstats.Stats(profile, stream=out).sort_stats("cumulative").print_stats(args.lines)
            print(out.getvalue())
        finally:
            broker.stop(grace_s=0)
            client.close()


if __name__ == "__main__":
    main()
