#!/usr/bin/env python3
"""Every ``google.rpc.ErrorInfo`` reason dxpool's code can produce, checked against
``docs/ERRORS.md``.

A reason counts when it is, in the source folders (``dxpool``, ``broker``, ``cli``,
``hostagent``, ``fabric``):

* the ``reason=`` argument of a call to an error class (``DxpoolError`` or a class that
  derives from it, found by reading the class definitions), or of ``super().__init__`` in
  such a class;
* the ``default_reason`` of an error class (what ``InvalidArgument(message)`` carries);
* the argument of a *reason helper*: a function that passes one of its own parameters on
  as ``reason=`` to an error class (``check_private(path, what, reason)``), given at a
  call of that helper by keyword or by position.

A reason is a string literal, a module constant (``TOO_SLOW = "WATCH_TOO_SLOW"``, also
imported by name), or an f-string. An f-string whose fields are parameters of the
function it is in is expanded with the literal arguments of every call of that function
(``f"INVALID_{kind.upper()}"`` with ``kind="node state"`` gives ``INVALID_NODE_STATE``);
otherwise each field becomes ``<NAME>`` after the variable it reads (``NODE_<STATE>``).
``error.reason`` passes an earlier error's reason on and adds none. Anything else is
reported as unreadable, so a reason cannot slip past by being computed.

Other ``reason`` arguments (a node's status reason such as ``AttachFailed``, a metric
label) are not calls to an error class nor to a reason helper, so they do not count.

The code a reason is returned with is the gRPC status code of the class raising it
(``code = grpc.StatusCode.X`` in the class or the nearest base that sets it); a reason
raised by two classes has two codes.

The table: every row of ``docs/ERRORS.md`` whose first cell is a reason in backticks,
and whose second cell lists its codes in backticks.

Usage::

    python scripts/error_reasons.py --check   # exit 1 and say what to change if the table is wrong
    python scripts/error_reasons.py --list    # every reason, its codes and where it is raised
"""

from __future__ import annotations

import argparse
import ast
import re
import sys
from collections import defaultdict
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TABLE = Path("docs") / "ERRORS.md"
SOURCE_FOLDERS = ("dxpool", "broker", "cli", "hostagent", "fabric")
"""Folders holding dxpool's code, relative to the repository root."""
PACKAGE_OF_FOLDER = {
    "dxpool": "dxpool",
    "broker": "dxpool.broker",
    "cli": "dxpool.cli",
    "hostagent": "dxpool.hostagent",
    "fabric": "dxpool.fabric",
}
"""The package each folder is imported as (``dxpool/broker`` and its siblings link to the
top-level folders)."""
ROOT_ERROR_CLASS = "DxpoolError"
ROOT_ERROR_CODE = "INTERNAL"
REASON_ATTRIBUTE = "reason"
"""``something.reason``: an earlier error's reason passed on."""
STRING_METHODS = frozenset(
    {"upper", "lower", "strip", "replace", "removeprefix", "removesuffix", "title"}
)
"""The ``str`` methods an f-string field may apply to a literal argument."""
GRPC_CODES = frozenset(
    {
        "OK",
        "CANCELLED",
        "UNKNOWN",
        "INVALID_ARGUMENT",
        "DEADLINE_EXCEEDED",
        "NOT_FOUND",
        "ALREADY_EXISTS",
        "PERMISSION_DENIED",
        "RESOURCE_EXHAUSTED",
        "FAILED_PRECONDITION",
        "ABORTED",
        "OUT_OF_RANGE",
        "UNIMPLEMENTED",
        "INTERNAL",
        "UNAVAILABLE",
        "DATA_LOSS",
        "UNAUTHENTICATED",
    }
)
REASON_SHAPE = re.compile(r"^[A-Z][A-Z0-9]*(?:_(?:[A-Z0-9]+|<[A-Z][A-Z0-9_]*>))*$")
"""UPPER_SNAKE_CASE, with ``<NAME>`` standing for a part known only at run time."""
_BACKTICKED = re.compile(r"`([^`]+)`")
_CELL_BORDER = re.compile(r"(?<!\\)\|")
"""A ``|`` between cells; ``\\|`` is a pipe inside a cell."""


_Function = ast.FunctionDef | ast.AsyncFunctionDef


@dataclass(frozen=True, order=True)
class Site:
    """One place that produces ``reason`` with gRPC status ``code``."""

    reason: str
    code: str
    path: str
    line: int

    def where(self) -> str:
        return f"{self.path}:{self.line}"


@dataclass
class Scan:
    """What reading the code found: the reasons, and the expressions it could not read."""

    sites: list[Site] = field(default_factory=list)
    unreadable: list[str] = field(default_factory=list)

    def codes(self) -> dict[str, set[str]]:
        """Reason -> the gRPC codes it is raised with."""
        found: dict[str, set[str]] = defaultdict(set)
        for site in self.sites:
            found[site.reason].add(site.code)
        return dict(found)


@dataclass(frozen=True)
class _ErrorClass:
    name: str
    bases: tuple[str, ...]
    code: str | None
    default_reason: str | None
    path: str
    line: int


@dataclass(frozen=True)
class _Helper:
    """A function that passes its parameter ``parameter`` on as an error's reason."""

    name: str
    parameter: str
    position: int | None
    """Where a call gives ``parameter`` by position (None: by keyword only)."""
    code: str
    default: str | None
    """The literal default of ``parameter``, a reason of its own."""
    path: str
    line: int


@dataclass
class _Module:
    path: str
    package: str
    tree: ast.Module
    constants: dict[str, str]
    imported: dict[str, tuple[str, str]]
    """Local name -> (module, name) for ``from module import name``."""


def _modules(root: Path) -> Iterator[_Module]:
    for folder in SOURCE_FOLDERS:
        for file in sorted((root / folder).rglob("*.py")):
            relative = file.relative_to(root)
            parts = relative.with_suffix("").parts
            package = ".".join((PACKAGE_OF_FOLDER[folder], *parts[1:]))
            if parts[-1] == "__init__":
                package = package.removesuffix(".__init__")
            tree = ast.parse(file.read_text(encoding="utf-8"), filename=str(relative))
            yield _Module(relative.as_posix(), package, tree, _constants(tree), _imports(tree))


def _constants(tree: ast.Module) -> dict[str, str]:
    """Module-level ``NAME = "text"``."""
    found: dict[str, str] = {}
    for statement in tree.body:
        target: ast.expr | None = None
        if isinstance(statement, ast.Assign) and len(statement.targets) == 1:
            target = statement.targets[0]
        elif isinstance(statement, ast.AnnAssign):
            target = statement.target
        value = getattr(statement, "value", None)
        if isinstance(target, ast.Name) and _literal(value) is not None:
            found[target.id] = _literal(value) or ""
    return found


def _imports(tree: ast.Module) -> dict[str, tuple[str, str]]:
    found: dict[str, tuple[str, str]] = {}
    for statement in tree.body:
        if isinstance(statement, ast.ImportFrom) and statement.module and not statement.level:
            for alias in statement.names:
                found[alias.asname or alias.name] = (statement.module, alias.name)
    return found


def _literal(node: ast.AST | None) -> str | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    return None


def _called_name(call: ast.Call) -> str | None:
    """``Name(...)`` or ``anything.Name(...)`` -> ``Name``."""
    if isinstance(call.func, ast.Name):
        return call.func.id
    if isinstance(call.func, ast.Attribute):
        return call.func.attr
    return None


def _is_super_init(call: ast.Call) -> bool:
    func = call.func
    return (
        isinstance(func, ast.Attribute)
        and func.attr == "__init__"
        and isinstance(func.value, ast.Call)
        and isinstance(func.value.func, ast.Name)
        and func.value.func.id == "super"
    )


def _error_classes(modules: Sequence[_Module]) -> dict[str, _ErrorClass]:
    """Every class deriving from ``DxpoolError``, by name, with its code resolved."""
    defined: dict[str, _ErrorClass] = {}
    for module in modules:
        for node in ast.walk(module.tree):
            if not isinstance(node, ast.ClassDef):
                continue
            bases = tuple(
                base.id if isinstance(base, ast.Name) else base.attr
                for base in node.bases
                if isinstance(base, ast.Name | ast.Attribute)
            )
            code = reason = None
            for statement in node.body:
                if not isinstance(statement, ast.Assign | ast.AnnAssign):
                    continue
                targets = (
                    statement.targets if isinstance(statement, ast.Assign) else [statement.target]
                )
                names = {t.id for t in targets if isinstance(t, ast.Name)}
                value = statement.value
                if "code" in names and isinstance(value, ast.Attribute):
                    code = value.attr
                if "default_reason" in names:
                    reason = _literal(value)
            defined.setdefault(
                node.name,
                _ErrorClass(node.name, bases, code, reason, module.path, node.lineno),
            )
    errors: dict[str, _ErrorClass] = {}
    root = defined.get(ROOT_ERROR_CLASS)
    if root is None:
        return errors
    errors[root.name] = _with_code(root, root.code or ROOT_ERROR_CODE)
    grew = True
    while grew:
        grew = False
        for cls in defined.values():
            if cls.name in errors:
                continue
            parents = [errors[base] for base in cls.bases if base in errors]
            if parents:
                errors[cls.name] = _with_code(cls, cls.code or parents[0].code or ROOT_ERROR_CODE)
                grew = True
    return errors


def _with_code(cls: _ErrorClass, code: str) -> _ErrorClass:
    return _ErrorClass(cls.name, cls.bases, code, cls.default_reason, cls.path, cls.line)


class _Reader:
    """Reads the reason expressions of one module."""

    def __init__(self, module: _Module, by_package: dict[str, _Module], calls: _Calls) -> None:
        self.module = module
        self.by_package = by_package
        self.calls = calls

    def constant(self, name: str) -> str | None:
        if name in self.module.constants:
            return self.module.constants[name]
        source = self.module.imported.get(name)
        if source is not None and source[0] in self.by_package:
            return self.by_package[source[0]].constants.get(source[1])
        return None

    def values(self, node: ast.expr, function: _Function | None) -> list[str] | None:
        """The reasons ``node`` can be, or None if it cannot be read."""
        literal = _literal(node)
        if literal is not None:
            return [literal]
        if isinstance(node, ast.Name):
            constant = self.constant(node.id)
            return [constant] if constant is not None else None
        if isinstance(node, ast.JoinedStr):
            return self._expand(node, function)
        return None

    def _expand(self, node: ast.JoinedStr, function: _Function | None) -> list[str]:
        parameters = _parameters(function) if function is not None else []
        fields = [part for part in node.values if isinstance(part, ast.FormattedValue)]
        used = {name for part in fields for name in _names_in(part.value)}
        if function is not None and used and used <= set(parameters):
            bindings = self.calls.arguments(function, sorted(used))
            if bindings:
                expanded = [_render(node, binding) for binding in bindings]
                if all(text is not None for text in expanded):
                    return sorted({text for text in expanded if text is not None})
        return [_render_template(node)]


def _parameters(function: _Function) -> list[str]:
    arguments = function.args
    return [a.arg for a in (*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs)]


def _position(function: _Function, name: str) -> int | None:
    """The index of the call argument that binds ``name`` (``self``/``cls`` not counted),
    or None when it can only be given by keyword."""
    positional = [a.arg for a in (*function.args.posonlyargs, *function.args.args)]
    if name not in positional:
        return None
    offset = 1 if positional[0] in {"self", "cls"} else 0
    return positional.index(name) - offset


def _default(function: _Function, name: str) -> str | None:
    """The literal default value of parameter ``name``, if it has one."""
    arguments = function.args
    positional = [*arguments.posonlyargs, *arguments.args]
    defaults: list[tuple[ast.arg, ast.expr | None]] = list(
        zip(
            positional[len(positional) - len(arguments.defaults) :], arguments.defaults, strict=True
        )
    )
    defaults.extend(zip(arguments.kwonlyargs, arguments.kw_defaults, strict=True))
    for argument, value in defaults:
        if argument.arg == name:
            return _literal(value)
    return None


def _names_in(node: ast.expr) -> set[str]:
    return {child.id for child in ast.walk(node) if isinstance(child, ast.Name)}


def _evaluate(node: ast.expr, binding: dict[str, str]) -> str | None:
    """A field of an f-string on literal arguments: names, literals and ``str`` methods."""
    literal = _literal(node)
    if literal is not None:
        return literal
    if isinstance(node, ast.Name):
        return binding.get(node.id)
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr in STRING_METHODS
        and not node.keywords
    ):
        target = _evaluate(node.func.value, binding)
        arguments = [_literal(argument) for argument in node.args]
        if target is None or any(argument is None for argument in arguments):
            return None
        result: object = getattr(target, node.func.attr)(*arguments)
        return result if isinstance(result, str) else None
    return None


def _render(node: ast.JoinedStr, binding: dict[str, str]) -> str | None:
    text = ""
    for part in node.values:
        if isinstance(part, ast.FormattedValue):
            value = _evaluate(part.value, binding)
            if value is None:
                return None
            text += value
        else:
            text += _literal(part) or ""
    return text


def _render_template(node: ast.JoinedStr) -> str:
    text = ""
    for part in node.values:
        if isinstance(part, ast.FormattedValue):
            root = part.value
            while isinstance(root, ast.Call | ast.Attribute | ast.Subscript):
                root = root.func if isinstance(root, ast.Call) else root.value
            name = root.id if isinstance(root, ast.Name) else "VALUE"
            text += f"<{name.upper()}>"
        else:
            text += _literal(part) or ""
    return text


class _Calls:
    """Every call in the code by the name called, to find the arguments a function gets."""

    def __init__(self, modules: Sequence[_Module]) -> None:
        self.by_name: dict[str, list[ast.Call]] = defaultdict(list)
        for module in modules:
            for node in ast.walk(module.tree):
                if isinstance(node, ast.Call):
                    name = _called_name(node)
                    if name is not None:
                        self.by_name[name].append(node)

    def arguments(self, function: _Function, wanted: list[str]) -> list[dict[str, str]]:
        """The literal values ``wanted`` parameters get at each call of ``function``
        (empty if any is not a literal, or the function is never called)."""
        bindings: list[dict[str, str]] = []
        for call in self.by_name.get(function.name, []):
            binding: dict[str, str] = {}
            for name in wanted:
                value = _argument(call, name, _position(function, name))
                literal = _literal(value)
                if literal is None:
                    return []
                binding[name] = literal
            bindings.append(binding)
        return bindings


def _argument(call: ast.Call, name: str, position: int | None) -> ast.expr | None:
    """The expression ``call`` gives parameter ``name`` (at ``position`` if positional)."""
    for keyword in call.keywords:
        if keyword.arg == name:
            return keyword.value
    if (
        position is not None
        and 0 <= position < len(call.args)
        and not any(isinstance(argument, ast.Starred) for argument in call.args[: position + 1])
    ):
        return call.args[position]
    return None


def _functions(tree: ast.Module) -> Iterator[tuple[ast.AST, _Function | None, str | None]]:
    """Every node with the function and the class it lies in (innermost)."""

    def walk(
        node: ast.AST, function: _Function | None, cls: str | None
    ) -> Iterator[tuple[ast.AST, _Function | None, str | None]]:
        yield node, function, cls
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                yield from walk(child, child, cls)
            elif isinstance(child, ast.ClassDef):
                yield from walk(child, None, child.name)
            else:
                yield from walk(child, function, cls)

    yield from walk(tree, None, None)


def scan(root: Path = REPO) -> Scan:
    """Every reason the code under ``root`` produces, with its codes and places."""
    modules = list(_modules(root))
    by_package = {module.package: module for module in modules}
    errors = _error_classes(modules)
    calls = _Calls(modules)
    result = Scan()
    for error_class in errors.values():
        if error_class.default_reason is not None:
            result.sites.append(
                Site(
                    error_class.default_reason,
                    error_class.code or ROOT_ERROR_CODE,
                    error_class.path,
                    error_class.line,
                )
            )
    helpers = _helpers(modules, errors)
    for helper in helpers.values():
        if helper.default is not None:
            result.sites.append(Site(helper.default, helper.code, helper.path, helper.line))
    for module in modules:
        reader = _Reader(module, by_package, calls)
        for node, function, cls in _functions(module.tree):
            if not isinstance(node, ast.Call):
                continue
            code, expression = _reason_of_call(node, errors, helpers, cls)
            if code is None or expression is None:
                continue
            where = f"{module.path}:{node.lineno}"
            if isinstance(expression, ast.Attribute) and expression.attr == REASON_ATTRIBUTE:
                continue  # an earlier error's reason, passed on
            if (
                isinstance(expression, ast.Name)
                and function is not None
                and expression.id in _parameters(function)
            ):
                continue  # a reason helper: its callers give the reason
            values = reader.values(expression, function)
            if values is None:
                result.unreadable.append(f"{where}: {ast.unparse(expression)}")
                continue
            result.sites.extend(Site(value, code, module.path, node.lineno) for value in values)
    result.sites.sort()
    return result


def _reason_of_call(
    call: ast.Call,
    errors: dict[str, _ErrorClass],
    helpers: dict[str, _Helper],
    cls: str | None,
) -> tuple[str | None, ast.expr | None]:
    """(code, reason expression) for a call that makes an error with a reason given."""
    name = _called_name(call)
    if _is_super_init(call) and cls in errors:
        code = errors[cls].code
    elif name in errors and not _is_super_init(call):
        code = errors[name].code
    elif name in helpers:
        helper = helpers[name]
        return helper.code, _argument(call, helper.parameter, helper.position)
    else:
        return None, None
    for keyword in call.keywords:
        if keyword.arg == REASON_ATTRIBUTE:
            return code, keyword.value
    return None, None


def _helpers(modules: Sequence[_Module], errors: dict[str, _ErrorClass]) -> dict[str, _Helper]:
    """Functions that pass one of their parameters on as an error's reason."""
    helpers: dict[str, _Helper] = {}
    grew = True
    while grew:
        grew = False
        for module in modules:
            for node, function, cls in _functions(module.tree):
                if not isinstance(node, ast.Call) or function is None:
                    continue
                if function.name in helpers:
                    continue
                code, expression = _reason_of_call(node, errors, helpers, cls)
                if (
                    code is not None
                    and isinstance(expression, ast.Name)
                    and expression.id in _parameters(function)
                ):
                    helpers[function.name] = _Helper(
                        function.name,
                        expression.id,
                        _position(function, expression.id),
                        code,
                        _default(function, expression.id),
                        module.path,
                        function.lineno,
                    )
                    grew = True
    return helpers


def read_table(text: str) -> tuple[dict[str, set[str]], list[str]]:
    """The table's reason -> codes, and the reasons it names more than once."""
    table: dict[str, set[str]] = {}
    repeated: list[str] = []
    for line in text.splitlines():
        if not line.lstrip().startswith("|"):
            continue
        cells = [cell.strip() for cell in _CELL_BORDER.split(line.strip().strip("|"))]
        if len(cells) < 2:
            continue
        names = _BACKTICKED.findall(cells[0])
        if len(names) != 1 or not REASON_SHAPE.match(names[0]):
            continue
        reason = names[0]
        codes = {code for code in _BACKTICKED.findall(cells[1]) if code in GRPC_CODES}
        if reason in table:
            repeated.append(reason)
        table[reason] = codes
    return table, repeated


def _codes_cell(codes: Iterable[str]) -> str:
    return ", ".join(f"`{code}`" for code in sorted(codes))


def problems(found: Scan, table: dict[str, set[str]], repeated: Sequence[str]) -> list[str]:
    """What is wrong with the table, one finding per item, each saying what to change."""
    codes = found.codes()
    places: dict[str, list[str]] = defaultdict(list)
    for site in found.sites:
        places[site.reason].append(site.where())
    report: list[str] = []
    missing = sorted(set(codes) - set(table))
    if missing:
        rows = "\n".join(
            f"| `{reason}` | {_codes_cell(codes[reason])} | ... | ... |" for reason in missing
        )
        sources = "\n".join(f"  {reason}: {', '.join(places[reason])}" for reason in missing)
        report.append(
            f"{TABLE} lacks {len(missing)} reason(s) the code produces; add these rows, "
            f"saying what each means and what the caller should do:\n{rows}\n"
            f"raised at:\n{sources}"
        )
    for reason in sorted(set(table) - set(codes)):
        report.append(f"{TABLE} names `{reason}`, which no code produces any more: remove its row")
    for reason in sorted(set(table) & set(codes)):
        if table[reason] != codes[reason]:
            report.append(
                f"{TABLE}: `{reason}` is listed with {_codes_cell(table[reason]) or 'no code'} "
                f"but the code raises it with {_codes_cell(codes[reason])} "
                f"({', '.join(places[reason])}): set its code column to that"
            )
    for reason in sorted(set(repeated)):
        report.append(f"{TABLE} has more than one row for `{reason}`: keep one")
    for text in found.unreadable:
        report.append(
            f"cannot tell which reason {text} is: use a string literal or a module constant"
        )
    return report


def check(root: Path = REPO) -> list[str]:
    """The findings for the code and the table under ``root`` (empty when they agree)."""
    path = root / TABLE
    if not path.is_file():
        return [f"{TABLE} does not exist"]
    table, repeated = read_table(path.read_text(encoding="utf-8"))
    return problems(scan(root), table, repeated)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--check", action="store_true", help="compare the code with the table")
    mode.add_argument("--list", action="store_true", help="print every reason found")
    parser.add_argument("--root", type=Path, default=REPO, help="the repository root")
    options = parser.parse_args(argv)
    if options.list:
        found = scan(options.root)
        for reason, codes in sorted(found.codes().items()):
            where = ", ".join(site.where() for site in found.sites if site.reason == reason)
            print(f"{reason}\t{','.join(sorted(codes))}\t{where}")
        for text in found.unreadable:
            print(f"unreadable\t{text}")
        return 1 if found.unreadable else 0
    findings = check(options.root)
    for finding in findings:
        print(finding)
    if not findings:
        print(f"{TABLE} lists every ErrorInfo reason the code produces, with its codes")
    return 1 if findings else 0


if __name__ == "__main__":
    sys.exit(main())
