"""``dxpool gang`` against a real broker, real etcd and host agents as processes."""

from __future__ import annotations

import json
import shlex

from tests.cli.test_commands import Run, ok, pool, run  # noqa: F401  (fixtures)
from tests.conftest import SimPool


def test_gang_create_wait_ready_get_then_delete_wait_released(
    run: Run,  # noqa: F811
    pool: SimPool,  # noqa: F811
) -> None:
    created = run(*shlex.split("gang create --count 2 --gpus H100:2 --name job --wait -o json"))
    gang = json.loads(ok(created))
    assert gang["name"] == "gangs/job"
    assert [n["name"] for n in gang["nodes"]] == ["nodes/job-0", "nodes/job-1"]
    assert {n["state"] for n in gang["nodes"]} == {"NODE_STATE_READY"}
    assert "gangs/job created: 2 nodes on h1" in created.stderr
    assert "waiting up to 120s for every member of gangs/job" in created.stderr

    table = ok(run("gang", "get", "job")).splitlines()
    assert [line.split()[:2] for line in table[1:]] == [["job-0", "Ready"], ["job-1", "Ready"]]
    assert ok(run("gang", "get", "gangs/job", "-o", "name")) == "nodes/job-0\nnodes/job-1\n"

    assert ok(run("gang", "delete", "job", "--wait")) == (
        "nodes/job-0 released\nnodes/job-1 released\n"
    )
    assert ok(run("gang", "delete", "job")) == (
        "nodes/job-0 released\nnodes/job-1 released\n"
    )  # idempotent


def test_gang_create_that_cannot_fit_exits_1_and_leaves_nothing(
    run: Run,  # noqa: F811
    pool: SimPool,  # noqa: F811
) -> None:
    result = run(*shlex.split("gang create --count 3 --gpus H100:3"))  # 9 of 8 GPUs
    assert result.exit_code == 1
    assert result.stderr.startswith("error: RESOURCE_EXHAUSTED: ")
    assert "gang member 2 of 3" in result.stderr
    assert ok(run("node", "list", "-o", "name")) == ""


def test_gang_usage_and_api_errors(run: Run) -> None:  # noqa: F811
    too_large = run(*shlex.split("gang create --count 4097 --gpus H100:1"))
    assert too_large.exit_code == 1
    assert too_large.stderr.startswith("error: INVALID_ARGUMENT: ")
    assert "at most 4096 members" in too_large.stderr
    assert run(*shlex.split("gang create --count 0 --gpus H100:1")).exit_code == 2
    assert run("gang", "get", "Bad_Name").exit_code == 2
    missing = run("gang", "get", "nope")
    assert missing.exit_code == 1
    assert missing.stderr.startswith("error: NOT_FOUND: ")
    deleted = run("gang", "delete", "nope", "other")
    assert deleted.exit_code == 1
    assert deleted.stderr.count("NOT_FOUND") == 2
