"""Command-line flags from typed settings, parsed and validated by pydantic-settings.

A config class is either flat (a pydantic dataclass: the dashboard's, the benchmarks') or made
of sections (`SECTIONS`, as `JoinConfig`). pydantic-settings' `CliSettingsSource` adds one
argument per field to an argparse parser and turns what argparse parsed into the sections;
pydantic validates them. Two hooks keep the command line as it always was: every flag is named
after its field alone (--inner-steps, not --train.inner-steps), and a section's flags appear
under its group title in --help. Errors come back as one line that names the flag.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import shlex
from collections.abc import Mapping
from typing import Annotated, Any, TypeVar, cast, get_args, get_origin

from pydantic import Field, ValidationError, create_model
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined
from pydantic_settings import BaseSettings, CliSettingsSource, PydanticBaseSettingsSource
from pydantic_settings import SettingsConfigDict as _SettingsConfigDict

from node.settings_types import OneOf, flag

ConfigT = TypeVar("ConfigT")

FLAT = "options"
"""The one section of a flat config class (its flags go in no titled group)."""

_INVALID_VALUE = {
    "int_parsing": "int",
    "int_from_float": "int",
    "float_parsing": "float",
    "finite_number": "float",
    "bool_parsing": "bool",
}
"""pydantic error types that argparse used to report as 'invalid int value: ...'."""


class _Flags(BaseSettings):
    """The settings parsed from flags alone: no environment variable or .env file reaches
    a config (a variable named NETWORK must not change how a node joins)."""

    model_config = _SettingsConfigDict(cli_implicit_flags=True, cli_kebab_case=True)

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return (init_settings,)


def sections_of(cls: type) -> Mapping[str, tuple[type, str | None]]:
    """Section name -> (section class, --help group title) of a config class."""
    return getattr(cls, "SECTIONS", None) or {FLAT: (cls, None)}


@functools.cache
def _flags_model(cls: type) -> type[_Flags]:
    fields: dict[str, Any] = {
        name: (section, Field(default_factory=dict, validate_default=True))
        for name, (section, _) in sections_of(cls).items()
    }
    return create_model(f"{cls.__name__}Flags", __base__=_Flags, **fields)


class _FlagBuilder:
    """The hooks through which pydantic-settings adds a config's arguments to a parser."""

    def __init__(self, cls: type) -> None:
        self.sections = sections_of(cls)
        self.groups: dict[str, Any] = {}

    def add_group(self, parser: argparse.ArgumentParser, **kwargs: Any) -> Any:
        """A section's group: its title's (two sections may share one), or none."""
        section = str(kwargs["title"]).removesuffix(" options")
        title = self.sections[section][1]
        if title is None:
            return parser
        if title not in self.groups:
            self.groups[title] = parser.add_argument_group(title)
        return self.groups[title]

    def add_argument(self, target: Any, *names: str, **kwargs: Any) -> Any:
        """--FIELD for the field `dest` names; a section's own JSON argument is left out."""
        dest = str(kwargs["dest"])
        if "." not in dest:
            return None
        section, name = dest.split(".", 1)
        info = _field_info(self.sections[section][0], name)
        options: dict[str, Any] = {"dest": dest, "default": argparse.SUPPRESS}
        options["help"] = _help(info).replace("%", "%%")  # argparse formats help with %
        if kwargs.get("action") is argparse.BooleanOptionalAction:
            options["action"] = argparse.BooleanOptionalAction
        elif kwargs.get("action") == "append":
            options |= {"nargs": "+", "metavar": "MADDR"}
        else:
            options["metavar"] = _metavar(name, info)
            options["type"] = _ARGPARSE_TYPES.get(_scalar(info.annotation), str)
        return target.add_argument(flag(name), **options)


def add_config_arguments(parser: argparse.ArgumentParser, cls: type) -> None:
    """One --flag per field of `cls` (of each of its sections), help from its docstring."""
    builder = _FlagBuilder(cls)
    CliSettingsSource(
        _flags_model(cls),
        root_parser=parser,
        add_argument_method=builder.add_argument,
        add_argument_group_method=builder.add_group,
    )


def config_from_args(cls: type[ConfigT], args: argparse.Namespace) -> ConfigT:
    """The `cls` that the flags of `add_config_arguments(parser, cls)` parsed into `args`.

    Raises ValueError with one line naming the flag for a value pydantic refuses."""
    model = _flags_model(cast(type, cls))  # a class is hashable; mypy cannot tell of type[T]
    source: CliSettingsSource[argparse.ArgumentParser] = CliSettingsSource(
        model, root_parser=argparse.ArgumentParser(add_help=False)
    )
    sections = sections_of(cls)
    parsed = {k: v for k, v in vars(args).items() if k.split(".", 1)[0] in sections}
    try:
        flags = model(**source(parsed_args=parsed)())
        if FLAT in sections:
            return getattr(flags, FLAT)  # type: ignore[no-any-return]
        values = {
            field.name: getattr(section, field.name)
            for section in (getattr(flags, name) for name in sections)
            for field in dataclasses.fields(section)
        }
        return cls(**values)
    except ValidationError as exc:
        raise ValueError(one_line(exc)) from None


def one_line(error: ValidationError) -> str:
    """The first of pydantic's errors, as the one line the CLI prints."""
    first = error.errors()[0]
    cause = first.get("ctx", {}).get("error")
    if first["type"] == "value_error" and cause is not None:
        return str(cause)  # our own checks name their flag
    names = [part for part in first["loc"] if isinstance(part, str)]
    name = flag(names[-1]) if names else "a setting"
    kind = _INVALID_VALUE.get(first["type"])
    if kind is not None:
        return f"argument {name}: invalid {kind} value: {first['input']!r}"
    return f"argument {name}: {first['msg']}"


def _field_info(section: type, name: str) -> FieldInfo:
    fields: dict[str, FieldInfo] = getattr(section, "__pydantic_fields__", None) or getattr(
        section, "model_fields", {}
    )
    return fields[name]


def _help(info: FieldInfo) -> str:
    text = info.description or ""
    default = info.default
    if default is not PydanticUndefined and default is not None and default is not False:
        text += f" [default: {default}]"
    return text


def _metavar(name: str, info: FieldInfo) -> str:
    for meta in info.metadata:
        if isinstance(meta, OneOf):
            return "{" + ",".join(meta.values) + "}"
    if _is_list(info.annotation):
        return "MADDR"
    return name.upper()


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(text)
    return value


_finite_float.__name__ = "float"  # argparse names the type in its error message
_ARGPARSE_TYPES: dict[Any, Any] = {int: int, float: _finite_float}
"""argparse converts numbers itself, so a word for a number exits 2 as it always did."""


def _scalar(annotation: Any) -> Any:
    """int from int, int | None, Annotated[int, ...] | None."""
    if get_origin(annotation) is Annotated:
        return _scalar(get_args(annotation)[0])
    inner = [a for a in get_args(annotation) if a is not type(None)]
    return _scalar(inner[0]) if len(inner) == 1 else annotation


def _is_list(annotation: Any) -> bool:
    return any(get_origin(a) is list for a in (annotation, *get_args(annotation)))


__all__ = ["add_config_arguments", "config_from_args", "one_line", "sections_of"]


def flag_value(args: argparse.Namespace, name: str) -> Any:
    """The value parsed for field `name`'s flag, None when the command line did not give it
    (flags parse into 'section.field' names, and to nothing when absent)."""
    for key, value in vars(args).items():
        if key.rsplit(".", 1)[-1] == name:
            return value
    return None


def check_command_given(parser: argparse.ArgumentParser, argv: list[str]) -> None:
    """A flag before any subcommand (`diloco-node --model tiny`): suggest `join` with it."""
    if not argv:
        parser.error("say what to do, e.g. 'diloco-node join' to train (see --help)")
    if argv[0].startswith("-") and argv[0] not in ("-h", "--help", "--version"):
        suggestion = shlex.join(["diloco-node", "join", *argv])
        parser.error(f"options such as {argv[0]} follow a subcommand: did you mean '{suggestion}'?")
