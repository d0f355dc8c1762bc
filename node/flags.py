"""Command-line flags from dataclass fields: one --flag per field, typed from its annotation,
with the docstring under the field as its help (JoinConfig, the dashboard's StandaloneConfig)."""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import math
from typing import Any, get_args, get_origin, get_type_hints


def flag_name(name: str) -> str:
    """A field's flag without its dashes: inner_steps -> inner-steps."""
    return name.replace("_", "-")


def field_docs(cls: type) -> dict[str, str]:
    """The docstring under each dataclass field, read from the class source."""
    tree = ast.parse(inspect.getsource(cls))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for node, following in zip(body, body[1:], strict=False):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(following, ast.Expr)
            and isinstance(following.value, ast.Constant)
            and isinstance(following.value.value, str)
        ):
            docs[node.target.id] = following.value.value
    return docs


def add_dataclass_arguments(
    parser: argparse.ArgumentParser, cls: type, *, skip: tuple[str, ...] = ()
) -> None:
    """One --flag per field of `cls`, typed from its annotation, help from its docstring.

    A class may name the allowed values of a field (CHOICES: shown as {a,b,c}) and put its
    flags in titled groups (FLAG_GROUPS); fields in no group go under "other options".
    """
    docs = field_docs(cls)
    hints = get_type_hints(cls)
    choices: dict[str, tuple[str, ...]] = getattr(cls, "CHOICES", {})
    groups = _argument_groups(parser, getattr(cls, "FLAG_GROUPS", {}))
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        target = groups.get(f.name, parser)
        default = None if f.default is dataclasses.MISSING else f.default
        help_text = docs.get(f.name, "")
        if default is not None and default is not False:
            help_text += f" [default: {default}]"
        flag = f"--{flag_name(f.name)}"
        help_text = help_text.replace("%", "%%")  # argparse formats help with %
        options: dict[str, Any] = {"dest": f.name, "default": argparse.SUPPRESS, "help": help_text}
        annotation = hints[f.name]
        metavar = "{" + ",".join(choices[f.name]) + "}" if f.name in choices else f.name.upper()
        if annotation is bool:
            target.add_argument(flag, action=argparse.BooleanOptionalAction, **options)
        elif _is_list(annotation):
            target.add_argument(flag, nargs="+", metavar="MADDR", **options)
        else:
            target.add_argument(flag, type=_scalar_type(annotation), metavar=metavar, **options)


def _argument_groups(
    parser: argparse.ArgumentParser, flag_groups: dict[str, tuple[str, ...]]
) -> dict[str, Any]:
    """field name -> the argparse group its flag goes in."""
    by_field: dict[str, Any] = {}
    for title, names in flag_groups.items():
        group = parser.add_argument_group(title)
        by_field |= dict.fromkeys(names, group)
    return by_field


def dataclass_from_args(cls: type, args: argparse.Namespace) -> Any:
    names = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in vars(args).items() if k in names})


def _is_list(annotation: Any) -> bool:
    return any(get_origin(a) is list for a in (annotation, *get_args(annotation)))


def _scalar_type(annotation: Any) -> type:
    if get_origin(annotation) is not None:
        inner = [a for a in get_args(annotation) if a is not type(None)]
        annotation = inner[0]
    if annotation is float:
        return _finite_float  # type: ignore[return-value]
    return annotation  # type: ignore[no-any-return]


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(text)
    return value


_finite_float.__name__ = "float"  # argparse names the type in its error message
