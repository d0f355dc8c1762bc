"""Reads, from a test module's source, how long each test can wait and how long pytest lets it.

A wait is a bounded call: a ``timeout=`` or ``timeout_s=`` argument, a positional bound given
to a ``wait*`` call (a number, or a name ending in ``_S``/``_s``) and a deadline
``time.monotonic() + X``. Bounds are evaluated from the module's constants, tests/timeouts.py
and the literals. A call of a helper defined in the same module adds the helper's waits, its
parameters bound to the call's arguments (or their defaults). A wait inside a ``for`` over a
literal tuple, list or ``range(n)`` counts once per item; in any other loop, once, so the
sum is a lower bound and a mark states the loop's count itself (``3 * MERGE_S``). A number
given positionally to a ``wait*`` method is taken as a bound: pass counts by keyword.

Helpers imported from other test modules count the same way. Not counted: waits inside
fixtures (their teardown is what tests.timeouts.SETUP_S is for) and in library code; a bound
computed at run time is listed as unknown, so the check cannot pass over it in silence.
"""

from __future__ import annotations

import ast
import dataclasses
import tomllib
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import tests.timeouts

_TIMEOUT_KEYWORDS = frozenset({"timeout", "timeout_s"})
_REPO = Path(__file__).resolve().parents[1]


@dataclasses.dataclass(frozen=True)
class TestBudget:
    """One test's waits, added up, against the timeout pytest gives it."""

    name: str
    waits_s: float
    timeout_s: float
    unknown: tuple[str, ...] = ()
    """Bounds that could not be evaluated from constants (their waits are not in waits_s)."""

    @property
    def covered(self) -> bool:
        return self.timeout_s >= self.waits_s and not self.unknown


def global_timeout_s(pyproject: Path) -> float:
    """pytest-timeout's default: ``[tool.pytest.ini_options] timeout`` in pyproject.toml."""
    config = tomllib.loads(pyproject.read_text())
    return float(config["tool"]["pytest"]["ini_options"]["timeout"])


def budgets(source: str, default_timeout_s: float) -> list[TestBudget]:
    """Every ``test_*`` function of a module: the sum of its waits and its timeout."""
    module = ast.parse(source)
    constants = _module_constants(module)
    helpers = _imported_helpers(module) | _helpers(module, constants)
    module_timeout = _timeout_mark(_pytestmark(module), constants) or default_timeout_s
    tests = [f for f in module.body if isinstance(f, ast.FunctionDef) and f.name[:5] == "test_"]
    return [_budget(test, _Waits(helpers, constants), module_timeout) for test in tests]


def _budget(test: ast.FunctionDef, waits: _Waits, module_timeout_s: float) -> TestBudget:
    waits_s = waits.of_function(test, {})
    mark_s = _timeout_mark(test.decorator_list, waits.constants)
    if mark_s is None and any(_is_timeout_mark(d) for d in test.decorator_list):
        waits.unknown.append("its timeout mark")  # a mark, but not one made of constants
    return TestBudget(
        name=test.name,
        waits_s=waits_s,
        timeout_s=mark_s or module_timeout_s,
        unknown=tuple(waits.unknown),
    )


def _module_constants(module: ast.Module) -> dict[str, Any]:
    names: dict[str, Any] = {}
    shared = vars(tests.timeouts)
    for node in module.body:
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("tests."):
            names.update(_imported_constants(node, shared))
        targets = node.targets if isinstance(node, ast.Assign) else []
        for target in targets:
            value = _evaluate(node.value, names) if isinstance(node, ast.Assign) else None
            if isinstance(target, ast.Name) and value is not None:
                names[target.id] = value
    return names | {"covering": tests.timeouts.covering}


def _imported_constants(node: ast.ImportFrom, shared: Mapping[str, Any]) -> dict[str, Any]:
    """Constants imported from tests.timeouts or from another test module (read, not run)."""
    if node.module == "tests.timeouts":
        return {a.asname or a.name: shared[a.name] for a in node.names}
    path = _module_path(node)
    if path is None:
        return {}
    theirs = _module_constants(ast.parse(path.read_text()))
    return {a.asname or a.name: theirs[a.name] for a in node.names if a.name in theirs}


def _evaluate(expr: ast.expr, names: Mapping[str, Any]) -> Any:
    """The expression's value when it needs only constants (and ``covering``); else None."""
    used = {n.id for n in ast.walk(expr) if isinstance(n, ast.Name)}
    if not used <= set(names) or any(isinstance(n, ast.Attribute) for n in ast.walk(expr)):
        return None
    try:
        return eval(compile(ast.Expression(expr), "<bound>", "eval"), {}, dict(names))  # noqa: S307
    except Exception:
        return None


def _number(expr: ast.expr, names: Mapping[str, Any]) -> float | None:
    value = _evaluate(expr, names)
    is_number = isinstance(value, int | float) and not isinstance(value, bool)
    return float(value) if is_number else None


def _pytestmark(module: ast.Module) -> list[ast.expr]:
    for node in module.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "pytestmark" for t in node.targets
        ):
            value = node.value
            return list(value.elts) if isinstance(value, ast.List | ast.Tuple) else [value]
    return []


def _is_timeout_mark(decorator: ast.expr) -> bool:
    return (
        isinstance(decorator, ast.Call)
        and isinstance(decorator.func, ast.Attribute)
        and decorator.func.attr == "timeout"
        and bool(decorator.args)
    )


def _timeout_mark(decorators: list[ast.expr], names: Mapping[str, Any]) -> float | None:
    marks = [d for d in decorators if _is_timeout_mark(d)]
    return _number(marks[0].args[0], names) if marks else None  # type: ignore[attr-defined]


Helper = tuple[ast.FunctionDef, dict[str, Any]]
"""A function the tests call, and the constants of the module that defines it."""


def _helpers(module: ast.Module, constants: dict[str, Any]) -> dict[str, Helper]:
    return {f.name: (f, constants) for f in module.body if isinstance(f, ast.FunctionDef)}


def _imported_helpers(module: ast.Module) -> dict[str, Helper]:
    """Functions imported from other test modules (``from tests.swarm.test_swarm import ...``)."""
    found: dict[str, Helper] = {}
    for node in module.body:
        path = _module_path(node)
        if isinstance(node, ast.ImportFrom) and path is not None:
            theirs = ast.parse(path.read_text())
            defined = _helpers(theirs, _module_constants(theirs))
            found |= {a.asname or a.name: defined[a.name] for a in node.names if a.name in defined}
    return found


def _module_path(node: ast.stmt) -> Path | None:
    if not isinstance(node, ast.ImportFrom) or not (node.module or "").startswith("tests."):
        return None
    path = _REPO / (str(node.module).replace(".", "/") + ".py")
    return path if path.is_file() else None


class _Waits:
    """Adds up the waits of a function body, following calls of the module's own helpers."""

    def __init__(self, helpers: Mapping[str, Helper], constants: dict[str, Any]):
        self.helpers = helpers
        self.constants = constants
        self.active: set[str] = set()
        self.unknown: list[str] = []

    def of_function(
        self,
        function: ast.FunctionDef,
        bound: Mapping[str, Any],
        constants: dict[str, Any] | None = None,
    ) -> float:
        if function.name in self.active:  # recursion: its waits are already being counted
            return 0.0
        self.active.add(function.name)
        constants = self.constants if constants is None else constants
        names = constants | _defaults(function, constants) | dict(bound)
        total = sum(self._of_statement(s, names) for s in function.body)
        self.active.discard(function.name)
        return total

    def _of_statement(self, node: ast.AST, names: dict[str, Any]) -> float:
        if isinstance(node, ast.For):
            times = _iterations(node.iter, names)
            inner = sum(self._of_statement(s, names) for s in [*node.body, *node.orelse])
            return times * inner + self._of_nodes([node.iter], names)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            return self._of_nodes(list(ast.iter_child_nodes(node)), names)
        if isinstance(node, ast.stmt) and _has_nested_statements(node):
            return sum(self._of_statement(c, names) for c in ast.iter_child_nodes(node))
        return self._of_nodes([node], names)

    def _of_nodes(self, nodes: list[ast.AST], names: dict[str, Any]) -> float:
        total = 0.0
        for root in nodes:
            for node in ast.walk(root):
                total += self._of_call(node, names) + self._of_deadline(node, names)
        return total

    def _bound(self, expr: ast.expr, names: Mapping[str, Any]) -> float:
        value = _number(expr, names)
        if value is None:
            self.unknown.append(ast.unparse(expr))
        return value or 0.0

    def _of_deadline(self, node: ast.AST, names: Mapping[str, Any]) -> float:
        """``time.monotonic() + X`` bounds a polling loop by X."""
        if not (isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add)):
            return 0.0
        sides = (node.left, node.right)
        clock = [s for s in sides if isinstance(s, ast.Call) and _callee_name(s) == "monotonic"]
        other = [s for s in sides if s not in clock]
        return self._bound(other[0], names) if clock and other else 0.0

    def _of_call(self, node: ast.AST, names: dict[str, Any]) -> float:
        if not isinstance(node, ast.Call):
            return 0.0
        helper = self.helpers.get(node.func.id) if isinstance(node.func, ast.Name) else None
        if helper is not None:
            function, constants = helper
            return self.of_function(function, _arguments(function, node, names), constants)
        bounds = [k.value for k in node.keywords if k.arg in _TIMEOUT_KEYWORDS]
        if _callee_name(node).startswith("wait"):
            bounds += [a for a in node.args if _looks_like_a_bound(a)]
        return sum(self._bound(b, names) for b in bounds)


def _has_nested_statements(node: ast.stmt) -> bool:
    return any(isinstance(c, ast.stmt | ast.excepthandler) for c in ast.iter_child_nodes(node))


def _iterations(iterable: ast.expr, names: Mapping[str, Any]) -> int:
    if isinstance(iterable, ast.Tuple | ast.List):
        return len(iterable.elts)
    if not (isinstance(iterable, ast.Call) and _callee_name(iterable) == "range"):
        return 1
    count = _number(iterable.args[0], names) if len(iterable.args) == 1 else None
    return int(count) if count is not None else 1


def _callee_name(call: ast.Call) -> str:
    func = call.func
    return func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")


def _looks_like_a_bound(arg: ast.expr) -> bool:
    if isinstance(arg, ast.Constant):
        return isinstance(arg.value, int | float) and not isinstance(arg.value, bool)
    names = [n.id for n in ast.walk(arg) if isinstance(n, ast.Name)]
    return bool(names) and all(n.endswith(("_S", "_s")) for n in names)


def _defaults(function: ast.FunctionDef, names: Mapping[str, Any]) -> dict[str, Any]:
    arguments = function.args
    positional = [*arguments.posonlyargs, *arguments.args]
    pairs = list(
        zip(
            positional[len(positional) - len(arguments.defaults) :], arguments.defaults, strict=True
        )
    )
    pairs += [
        (a, d)
        for a, d in zip(arguments.kwonlyargs, arguments.kw_defaults, strict=True)
        if d is not None
    ]
    return {a.arg: v for a, d in pairs if (v := _evaluate(d, names)) is not None}


def _arguments(function: ast.FunctionDef, call: ast.Call, names: Mapping[str, Any]) -> dict:
    positional = [a.arg for a in [*function.args.posonlyargs, *function.args.args]]
    given = list(zip(positional, call.args, strict=False)) + [
        (k.arg, k.value) for k in call.keywords if k.arg
    ]
    return {p: v for p, expr in given if (v := _evaluate(expr, names)) is not None}


def module_budgets(
    paths: list[Path], default_timeout_s: float
) -> Iterator[tuple[Path, TestBudget]]:
    for path in paths:
        for budget in budgets(path.read_text(), default_timeout_s):
            yield path, budget
