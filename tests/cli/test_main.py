"""Argument parsing and exit statuses of the ``dxpool`` command (no broker needed)."""

from __future__ import annotations

import click
import pytest
from click.testing import CliRunner

from dxpool.cli import main as cli_main
from dxpool.cli.errors import format_error
from dxpool.cli.help import summary
from dxpool.cli.main import DxpoolGroup, cli
from dxpool.errors import NotFound, ResourceExhausted
from dxpool.store.embedded import free_port


@pytest.fixture
def runner(monkeypatch: pytest.MonkeyPatch, tmp_path: object) -> CliRunner:
    monkeypatch.delenv("DXPOOL_ENDPOINT", raising=False)
    monkeypatch.setenv("DXPOOL_CONFIG", "")
    monkeypatch.setenv("HOME", str(tmp_path))
    return CliRunner()


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["node", "create", "--gpus", "H100:0"], "invalid GPU count 0"),
        (["node", "create", "--gpus", "H100:x"], "cannot parse GPU request 'H100:x'"),
        (["node", "create", "--gpus", "H100:2", "--max-latency", "fast"], "e.g. 4us"),
        (["node", "create", "--gpus", "H100:2", "--min-memory", "lots"], "e.g. 80GiB"),
        (["node", "create", "--gpus", "2", "--label", "novalue"], "expected KEY=VALUE"),
        (["node", "create", "--gpus", "2", "--host", "Bad_Host"], "invalid host id"),
        (["node", "create", "--gpus", "2", "--timeout", "soon"], "cannot parse duration"),
        (["node", "plan", "--gpus", "H100:99"], "1 to 64 GPUs"),
        (["node", "get", "nodes/"], "invalid node id"),
        (["node", "list", "-o", "xml"], "'xml' is not a format: use one of table"),
        (["gpu", "list", "--state", "busy"], "unknown GPU state 'busy'"),
        (["gpu", "get", "box1"], "expected 'BOX/SLOT'"),
        (["gpu", "get", "box1/\u00b3"], "expected an integer 0-4095"),
        (["gpu", "get", "boxes/box1/gpus/\u00b2"], "expected an integer 0-4095"),
        (["gpu", "get", "box1/" + "9" * 5000], "expected an integer 0-4095"),
        (["node", "create", "--gpus", "H100:" + "9" * 5000], "1 to 64 GPUs"),
        (["node", "create", "--gpus", "2", "--min-memory", "17TiB"], "at most 16TiB"),
        (["node", "create", "--gpus", "2", "--max-latency", "1" * 400 + "s"], "e.g. 4us"),
        (["box", "get", "box1\n"], "invalid box id"),
        (["box", "add", "box1", "--gpus", "8", "--memory", "80GiB"], "GPU model is missing"),
        (
            ["box", "add", "box1", "--gpus", "A100:8", "--model", "H100", "--memory", "80GiB"],
            "give the model once",
        ),
        (["fabric", "latency", "--host", "h1"], "Missing option '--box'"),
        (["--endpoint", "nohostport", "box", "list"], "expected host:port"),
        (["--endpoint", "https://h:1", "box", "list"], "cannot ask for TLS"),
        (["--endpoint", "http://h:1/api", "box", "list"], "has no path"),
        (["--request-timeout", "0s", "box", "list"], "must be positive"),
        (["frobnicate"], "No such command 'frobnicate'"),
        (["node", "create", "--gpus", "2", "--name", "Bad!"], "invalid node id 'Bad!'"),
        (["gang", "create", "--gpus", "2", "--count", "2", "--name", "Bad!"], "invalid gang id"),
        (["node", "create", "--gpus", "2", "--request-id", "a b"], "invalid request_id"),
        (["node", "create", "--gpus", "2", "--cpus", "100000000"], "1<=x<=65536"),
        (["node", "create", "--gpus", "2", "--tenant", "Bad!"], "invalid tenant id"),
        (["node", "create", "--gpus", "2", "--max-latency", "1000s"], "more than 10s"),
        (["audit", "--identity", "team-a"], "expected dxpool://ROLE/NAME"),
        (["audit", "--identity", "boss/team-a"], "unknown role 'boss'"),
    ],
)
def test_usage_errors_exit_2(runner: CliRunner, args: list[str], expected: str) -> None:
    result = runner.invoke(cli, args)
    assert result.exit_code == 2, result.output
    assert expected in result.stderr
    assert result.stdout == ""


def test_gpu_grammar_is_shown_on_a_bad_count(runner: CliRunner) -> None:
    result = runner.invoke(cli, ["node", "create", "--gpus", "H100:0"])
    assert "expected MODEL:COUNT (e.g. H100:4)" in result.stderr


def test_broker_down_is_an_api_error_with_a_hint(runner: CliRunner) -> None:
    endpoint = f"127.0.0.1:{free_port()}"
    result = runner.invoke(cli, ["--endpoint", endpoint, "box", "list"])
    assert result.exit_code == 1
    first, hint = result.stderr.splitlines()[:2]
    assert first.startswith("error: UNAVAILABLE: ")
    assert hint == (
        f"hint: is the broker running at {endpoint}? start one with `dxpool up`, or point "
        "--endpoint (or DXPOOL_ENDPOINT) at a running broker"
    )
    assert result.stdout == ""


def test_environment_endpoint_is_used(runner: CliRunner) -> None:
    endpoint = f"127.0.0.1:{free_port()}"
    result = runner.invoke(cli, ["host", "list"], env={"DXPOOL_ENDPOINT": endpoint})
    assert result.exit_code == 1
    assert f"broker running at {endpoint}?" in result.stderr


def _group_with(callback: click.Command) -> click.Group:
    group = DxpoolGroup(name="dxpool")
    group.add_command(callback)
    return group


def test_api_error_exits_1_with_code_name(runner: CliRunner) -> None:
    @click.command("get")
    def get() -> None:
        raise NotFound("host hosts/nope not found")

    result = runner.invoke(_group_with(get), ["get"])
    assert result.exit_code == 1
    assert result.stderr == "error: NOT_FOUND: host hosts/nope not found\n"


def test_timeout_exits_1(runner: CliRunner) -> None:
    @click.command("wait")
    def wait() -> None:
        raise TimeoutError("node nodes/n1 still ATTACHING after 1s")

    result = runner.invoke(_group_with(wait), ["wait"])
    assert result.exit_code == 1
    assert result.stderr.startswith("error: DEADLINE_EXCEEDED: node nodes/n1 still ATTACHING")


def test_ctrl_c_exits_130(runner: CliRunner) -> None:
    @click.command("watch")
    def watch() -> None:
        raise KeyboardInterrupt

    result = runner.invoke(_group_with(watch), ["watch"])
    assert result.exit_code == 130


def test_missing_lazy_command_is_not_mounted(
    runner: CliRunner, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(
        cli_main.COMMANDS,
        "ghost",
        cli_main.LazyCommand("dxpool.no_such_module", "command", "Haunt", "server"),
    )
    listed = runner.invoke(cli, ["--help"])
    assert listed.exit_code == 0
    assert "ghost" not in listed.stdout
    assert runner.invoke(cli, ["ghost"]).exit_code == 2


def test_installed_lazy_commands_are_mounted(runner: CliRunner) -> None:
    for name, entry in cli_main.COMMANDS.items():
        if not cli_main._module_exists(entry.module):
            continue
        result = runner.invoke(cli, [name, "--help"])
        assert result.exit_code == 0, result.output
        assert "Usage: dxpool " + name in result.stdout


def test_the_roots_summaries_are_the_commands_own() -> None:
    """The root lists commands from its table without importing them; each summary
    there must say what the command's own help says first."""
    context = click.Context(cli)
    for name, entry in cli_main.COMMANDS.items():
        command = cli.get_command(context, name)
        assert command is not None, name
        own = summary(command.help or "")
        assert entry.summary.split()[:3] == own.split()[:3], (name, entry.summary, own)


def test_help_imports_no_command_and_no_grpc() -> None:
    """``dxpool --help`` is what a newcomer runs first: it loads click and the table."""
    import subprocess
    import sys

    probe = (
        "import sys; from dxpool.cli.main import main; sys.argv = ['dxpool', '--help']\n"
        "try:\n    main()\nexcept SystemExit:\n    pass\n"
        "heavy = [m for m in sys.modules if m == 'grpc' or m.startswith(('dxpool.cli.commands',"
        " 'dxpool.broker', 'dxpool.hostagent', 'google.protobuf', 'rich'))]\n"
        "print(','.join(sorted(heavy)), file=sys.stderr)"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=120
    )
    assert "Commands:" in done.stdout
    assert done.stderr.strip() == ""


@pytest.mark.parametrize(
    ("text", "first"),
    [
        ("Compose a node, e.g. `dxpool node create --gpus H100:4`.", "Compose a node, e.g. "
         "`dxpool node create --gpus H100:4`"),
        ("List nodes, i.e. the ones not RELEASED. With -a all of them.", "List nodes, i.e. "
         "the ones not RELEASED"),
        ("One line.\n\nMore.", "One line"),
    ],
)  # fmt: skip
def test_summaries_end_at_the_first_sentence_not_at_an_abbreviation(text: str, first: str) -> None:
    assert summary(text) == first


def test_hints_say_what_to_do_next_without_repeating_the_message() -> None:
    bare = ResourceExhausted("no H100 free")
    assert format_error(bare, "h:1") == (
        "error: RESOURCE_EXHAUSTED: no H100 free\n"
        "hint: see why each host was dropped with `dxpool node plan` and the same flags"
    )
    explained = ResourceExhausted("no H100 free; `dxpool node plan` shows every candidate")
    assert "hint:" not in format_error(explained, "h:1")
    assert format_error(NotFound("x"), "h:1") == "error: NOT_FOUND: x"
    verbose = format_error(NotFound("x", reason="NODE_NOT_FOUND"), "h:1", verbose=True)
    assert verbose.splitlines()[1] == "reason: NODE_NOT_FOUND"


def test_completion_scripts_complete_commands() -> None:
    """The script `dxpool completion bash` prints calls back into dxpool, which answers
    with the commands that match."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from click.testing import CliRunner

    for shell in ("bash", "zsh", "fish"):
        script = CliRunner().invoke(cli, ["completion", shell])
        assert script.exit_code == 0 and "_DXPOOL_COMPLETE" in script.output
    dxpool = Path(sys.executable).parent / "dxpool"
    answer = subprocess.run(
        [str(dxpool)],
        env={**os.environ, "_DXPOOL_COMPLETE": "bash_complete", "COMP_WORDS": "dxpool no",
             "COMP_CWORD": "1"},
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )  # fmt: skip
    assert "plain,node" in answer.stdout.splitlines()


def test_ctrl_c_while_a_command_loads_exits_130_without_a_traceback() -> None:
    import subprocess
    import sys

    probe = (
        "import importlib, sys\n"
        "from dxpool.cli.main import main\n"
        "def interrupted(name, *args):\n"
        "    raise KeyboardInterrupt\n"
        "importlib.import_module = interrupted\n"
        "sys.argv = ['dxpool', 'node', 'list']\n"
        "main()\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=False, timeout=120
    )
    assert done.returncode == 130, done.stderr
    assert "Traceback" not in done.stderr
