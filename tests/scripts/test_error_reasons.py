"""scripts/error_reasons.py: docs/ERRORS.md lists every ErrorInfo reason the code produces
with its codes, and the scanner counts exactly the reasons that reach an ErrorInfo.

The scanner's rules are proven on small source trees written here, beside a copy of the
real ``dxpool/errors.py``, so each rule is seen to count what it should and nothing else.
"""

from __future__ import annotations

import importlib.util
import shutil
import sys
import textwrap
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "error_reasons.py"
HEADER = "| Reason | Code | What it means | What the caller should do |\n|---|---|---|---|\n"


@pytest.fixture(scope="module")
def reasons() -> ModuleType:
    spec = importlib.util.spec_from_file_location("error_reasons", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while defining
    spec.loader.exec_module(module)
    return module


def _tree(root: Path, files: dict[str, str], table: str | None = None) -> Path:
    """A repository at ``root``: the real error tree, ``files`` and, if given, a table."""
    (root / "dxpool").mkdir(parents=True)
    shutil.copy(REPO / "dxpool" / "errors.py", root / "dxpool" / "errors.py")
    for relative, text in files.items():
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text), encoding="utf-8")
    if table is not None:
        (root / "docs").mkdir()
        (root / "docs" / "ERRORS.md").write_text(table, encoding="utf-8")
    return root


def _found(reasons: ModuleType, root: Path) -> dict[str, set[str]]:
    """Reason -> codes, without the error classes' defaults."""
    defaults = {
        "INTERNAL",
        "INVALID_ARGUMENT",
        "NOT_FOUND",
        "ALREADY_EXISTS",
        "FAILED_PRECONDITION",
        "NO_CAPACITY",
        "CONFLICT",
        "UNAVAILABLE",
        "UNAUTHENTICATED",
        "PERMISSION_DENIED",
    }
    codes: dict[str, set[str]] = reasons.scan(root).codes()
    return {reason: found for reason, found in codes.items() if reason not in defaults}


def test_the_table_lists_every_reason_the_code_produces(reasons: ModuleType) -> None:
    findings = reasons.check(REPO)
    assert not findings, "\n\n".join(findings)


def test_every_class_default_reason_counts_with_its_code(reasons: ModuleType) -> None:
    codes = reasons.scan(REPO).codes()
    assert codes["INTERNAL"] >= {"INTERNAL"}
    assert codes["NO_CAPACITY"] >= {"RESOURCE_EXHAUSTED"}
    assert codes["CONFLICT"] == {"ABORTED"}
    assert codes["PERMISSION_DENIED"] == {"PERMISSION_DENIED"}


def test_status_reasons_and_metric_labels_are_not_error_reasons(
    reasons: ModuleType, tmp_path: Path
) -> None:
    root = _tree(
        tmp_path,
        {
            "broker/control/controller.py": """
                from dxpool.errors import FailedPrecondition

                def fail(node, metrics, let_go, node_to):
                    let_go(node, "FAILED", "attach failed", reason="AttachFailed")
                    node_to(node, "FAILED", reason="GrowFailed")
                    metrics.WATCH_CUTOFFS.labels(reason="WATCH_TOO_SLOW").inc()
                    record(health_reason="XID_79")
                    raise FailedPrecondition("node is not ready", reason="NODE_NOT_READY")
                """,
        },
    )
    assert _found(reasons, root) == {"NODE_NOT_READY": {"FAILED_PRECONDITION"}}


def test_a_reason_raised_by_two_classes_has_both_codes(reasons: ModuleType, tmp_path: Path) -> None:
    root = _tree(
        tmp_path,
        {
            "broker/nodes/compose.py": """
                from dxpool import errors
                from dxpool.errors import AlreadyExists

                def lookup(found):
                    if found is None:
                        raise errors.FailedPrecondition("gone", reason="REQUEST_ID_REUSED")
                    raise AlreadyExists("used", reason="REQUEST_ID_REUSED")
                """,
        },
    )
    assert _found(reasons, root) == {"REQUEST_ID_REUSED": {"ALREADY_EXISTS", "FAILED_PRECONDITION"}}


def test_constants_helpers_and_subclasses_are_followed(reasons: ModuleType, tmp_path: Path) -> None:
    root = _tree(
        tmp_path,
        {
            "broker/api/node_watch.py": """
                from dxpool.errors import Aborted

                TOO_SLOW = "WATCH_TOO_SLOW"

                def check():
                    raise Aborted("fell behind", reason=TOO_SLOW)
                """,
            "broker/other.py": """
                from dxpool.broker.api.node_watch import TOO_SLOW
                from dxpool.errors import Unavailable

                def stop():
                    raise Unavailable("stopping", reason=TOO_SLOW)
                """,
            "dxpool/private_files.py": """
                from dxpool.errors import InvalidArgument

                def check_private(path, what, reason):
                    raise InvalidArgument(f"{what} {path} is open", reason=reason)

                def check_secret(path, reason="SECRET_OPEN"):
                    check_private(path, "secret", reason)
                """,
            "broker/api/auth.py": """
                from dxpool.private_files import check_private

                def load(path):
                    check_private(path, "token file", reason="INVALID_TOKEN_FILE")
                    check_private(path, "key file", "INVALID_KEY_FILE")
                """,
            "fabric/matrix.py": """
                from dxpool.errors import InvalidArgument

                class MatrixError(InvalidArgument, ValueError):
                    def __init__(self, where):
                        super().__init__(f"{where}: bad", reason="INVALID_MATRIX")

                class StaleMatrix(MatrixError):
                    code = grpc.StatusCode.FAILED_PRECONDITION
                    default_reason = "MATRIX_STALE"

                def load():
                    raise StaleMatrix("m.csv")
                """,
        },
    )
    assert _found(reasons, root) == {
        "WATCH_TOO_SLOW": {"ABORTED", "UNAVAILABLE"},
        "INVALID_TOKEN_FILE": {"INVALID_ARGUMENT"},
        "INVALID_KEY_FILE": {"INVALID_ARGUMENT"},
        "SECRET_OPEN": {"INVALID_ARGUMENT"},
        "INVALID_MATRIX": {"INVALID_ARGUMENT"},
        "MATRIX_STALE": {"FAILED_PRECONDITION"},
    }


def test_f_strings_expand_on_literal_arguments_or_become_templates(
    reasons: ModuleType, tmp_path: Path
) -> None:
    root = _tree(
        tmp_path,
        {
            "dxpool/client.py": """
                from dxpool.errors import FailedPrecondition, InvalidArgument

                def _enum_value(value, enum, kind):
                    raise InvalidArgument(
                        "unknown", reason=f"INVALID_{kind.upper().replace(' ', '_')}"
                    )

                def node_state(value):
                    return _enum_value(value, None, "node state")

                def gpu_state(value):
                    return _enum_value(value, None, kind="GPU state")

                def _reached(node):
                    state = node.state_name
                    raise FailedPrecondition("can no longer", reason=f"NODE_{state}")

                def again(error):
                    raise FailedPrecondition(f"gang: {error.message}", reason=error.reason)
                """,
        },
    )
    assert _found(reasons, root) == {
        "INVALID_NODE_STATE": {"INVALID_ARGUMENT"},
        "INVALID_GPU_STATE": {"INVALID_ARGUMENT"},
        "NODE_<STATE>": {"FAILED_PRECONDITION"},
    }


def test_a_reason_it_cannot_read_is_reported(reasons: ModuleType, tmp_path: Path) -> None:
    root = _tree(
        tmp_path,
        {
            "broker/x.py": """
                from dxpool.errors import NotFound

                def find(kind):
                    raise NotFound("no", reason=PICK[kind])
                """,
        },
        table=HEADER,
    )
    findings = reasons.check(root)
    assert any("broker/x.py:5: PICK[kind]" in finding for finding in findings), findings


def test_a_missing_reason_is_named_as_a_row_to_paste(reasons: ModuleType, tmp_path: Path) -> None:
    rows = "".join(
        f"| `{reason}` | `{code}` | default | - |\n"
        for reason, code in [
            ("INTERNAL", "INTERNAL"),
            ("INVALID_ARGUMENT", "INVALID_ARGUMENT"),
            ("NOT_FOUND", "NOT_FOUND"),
            ("ALREADY_EXISTS", "ALREADY_EXISTS"),
            ("FAILED_PRECONDITION", "FAILED_PRECONDITION"),
            ("NO_CAPACITY", "RESOURCE_EXHAUSTED"),
            ("CONFLICT", "ABORTED"),
            ("UNAVAILABLE", "UNAVAILABLE"),
            ("UNAUTHENTICATED", "UNAUTHENTICATED"),
            ("PERMISSION_DENIED", "PERMISSION_DENIED"),
        ]
    )
    root = _tree(
        tmp_path,
        {
            "broker/boxes.py": """
                from dxpool.errors import FailedPrecondition, NotFound

                def delete(box):
                    raise FailedPrecondition("in use", reason="BOX_IN_USE")

                def get(box):
                    raise NotFound("no box", reason="BOX_NOT_FOUND")
                """,
        },
        table=HEADER
        + rows
        + "| `BOX_NOT_FOUND` | `NOT_FOUND` | The box does not exist. | Check the name. |\n",
    )
    assert reasons.check(root) == [
        "docs/ERRORS.md lacks 1 reason(s) the code produces; add these rows, saying what "
        "each means and what the caller should do:\n"
        "| `BOX_IN_USE` | `FAILED_PRECONDITION` | ... | ... |\n"
        "raised at:\n"
        "  BOX_IN_USE: broker/boxes.py:5"
    ]


def test_stale_rows_wrong_codes_and_repeated_rows_are_named(
    reasons: ModuleType, tmp_path: Path
) -> None:
    root = _tree(
        tmp_path,
        {
            "broker/nodes.py": """
                from dxpool.errors import AlreadyExists, FailedPrecondition

                def compose(used):
                    raise AlreadyExists("exists", reason="NODE_EXISTS")

                def again():
                    raise FailedPrecondition("gone", reason="REQUEST_ID_REUSED")
                """,
        },
        table=HEADER
        + "| `NODE_EXISTS` | `ALREADY_EXISTS` | `nodes/{id}` exists (a \\| in a cell). | - |\n"
        + "| `NODE_EXISTS` | `ALREADY_EXISTS` | twice | - |\n"
        + "| `REQUEST_ID_REUSED` | `ALREADY_EXISTS` | used | - |\n"
        + "| `NODE_GONE` | `NOT_FOUND` | removed from the code | - |\n"
        + "Prose naming `NOT_A_ROW` is not a row.\n",
    )
    findings = [f for f in reasons.check(root) if "lacks" not in f]  # defaults left out
    assert findings == [
        "docs/ERRORS.md names `NODE_GONE`, which no code produces any more: remove its row",
        "docs/ERRORS.md: `REQUEST_ID_REUSED` is listed with `ALREADY_EXISTS` but the code "
        "raises it with `FAILED_PRECONDITION` (broker/nodes.py:8): set its code column to that",
        "docs/ERRORS.md has more than one row for `NODE_EXISTS`: keep one",
    ]


def test_check_mode_exits_1_and_prints_what_to_change(
    reasons: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = _tree(tmp_path, {}, table=HEADER)
    assert reasons.main(["--check", "--root", str(root)]) == 1
    out = capsys.readouterr().out
    assert "| `CONFLICT` | `ABORTED` | ... | ... |" in out

    assert reasons.main(["--check"]) == 0
    assert "lists every ErrorInfo reason" in capsys.readouterr().out


def test_list_mode_prints_each_reason_with_its_codes_and_sites(
    reasons: ModuleType, capsys: pytest.CaptureFixture[str]
) -> None:
    assert reasons.main(["--list"]) == 0
    lines = {line.split("\t")[0]: line.split("\t") for line in capsys.readouterr().out.splitlines()}
    assert lines["REQUEST_ID_REUSED"][1] == "ALREADY_EXISTS,FAILED_PRECONDITION"
    assert "broker/nodes/compose.py:" in lines["REQUEST_ID_REUSED"][2]
    assert "AttachFailed" not in lines
