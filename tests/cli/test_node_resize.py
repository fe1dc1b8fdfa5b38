"""``dxpool node resize`` against a real broker, real etcd and a host agent process."""

from __future__ import annotations

import json
import shlex

from tests.cli.test_commands import Run, ok, pool, run  # noqa: F401  (fixtures)
from tests.conftest import SimPool


def test_node_resize_grows_with_wait_then_shrinks_by_count_and_by_name(
    run: Run,  # noqa: F811
    pool: SimPool,  # noqa: F811
) -> None:
    ok(run(*shlex.split("node create --gpus H100:1 --name n1 --wait")))

    grown = run(*shlex.split("node resize n1 --gpus 3 --wait -o json"))
    node = json.loads(ok(grown))
    assert node["state"] == "NODE_STATE_READY" and len(node["gpus"]) == 3
    assert "nodes/n1 resizing to 3 GPUs" in grown.stderr
    assert "waiting up to 120s for nodes/n1 to be READY again" in grown.stderr
    assert ok(run("node", "list")).splitlines()[1].split()[:4] == ["n1", "Ready", "h1", "H100:3"]

    described = ok(run("node", "describe", "n1")).splitlines()
    assert [line.split()[1:] for line in described if line.startswith("GPUs:")] == [
        ["H100:3", "(composed", "as", "H100:1)"]
    ]
    shrinking = run(*shlex.split("node resize n1 --gpus 2 --wait -o json"))
    assert "nodes/n1 resizing to 2 GPUs" in shrinking.stderr  # not the 3 it had
    shrunk = json.loads(ok(shrinking))
    assert [g["gpu"] for g in shrunk["gpus"]] == [g["gpu"] for g in node["gpus"][:2]]
    first = node["gpus"][0]["gpu"].removeprefix("boxes/").replace("/gpus/", "/")
    named = json.loads(ok(run("node", "resize", "n1", "--remove", first, "--wait", "-o", "json")))
    assert [g["gpu"] for g in named["gpus"]] == [node["gpus"][1]["gpu"]]


def test_node_resize_errors(run: Run, pool: SimPool) -> None:  # noqa: F811
    ok(run(*shlex.split("node create --gpus H100:1 --name n1 --wait")))
    assert run("node", "resize", "n1").exit_code == 2  # neither --gpus nor --remove
    assert run(*shlex.split("node resize n1 --gpus 0")).exit_code == 2
    assert run(*shlex.split("node resize n1 --remove nonsense")).exit_code == 2
    too_many = run(*shlex.split("node resize n1 --gpus 9"))  # h1 has 8 slots
    assert too_many.exit_code == 1
    assert too_many.stderr.startswith("error: RESOURCE_EXHAUSTED: ")
    missing = run(*shlex.split("node resize nope --gpus 2"))
    assert missing.exit_code == 1 and missing.stderr.startswith("error: NOT_FOUND: ")
