"""The field types of `join`'s settings (node/settings.py): each a value type with the check
pydantic runs on it, and the one-line error a bad value gets (naming its flag)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass as std_dataclass
from typing import Annotated, Any

from pydantic import AfterValidator, ConfigDict, GetCoreSchemaHandler, ValidationInfo
from pydantic_core import core_schema

FLAGS = ConfigDict(use_attribute_docstrings=True, allow_inf_nan=False, extra="forbid")
"""Every flag class's pydantic config: docstrings are help, no NaN or infinity, no stray keys."""


def flag(field_name: str | None) -> str:
    """inner_steps -> --inner-steps."""
    return "--" + (field_name or "").replace("_", "-")


@std_dataclass(frozen=True)
class OneOf:
    """A string field that takes one of `values` (shown as {a,b,c} in --help)."""

    values: tuple[str, ...]
    case_insensitive: bool = False

    def __get_pydantic_core_schema__(
        self, source: type[Any], handler: GetCoreSchemaHandler
    ) -> core_schema.CoreSchema:
        return core_schema.with_info_after_validator_function(self.check, handler(source))

    def check(self, value: str, info: ValidationInfo) -> str:
        seen = value.upper() if self.case_insensitive else value
        if seen not in self.values:
            choices = ", ".join(self.values)
            raise ValueError(f"{flag(info.field_name)} must be one of {choices}; got {value!r}")
        return value


def check(ok: Callable[[Any], bool], message: str) -> AfterValidator:
    """A field check: `message` (with {flag} and {value}) when `ok(value)` is false."""

    def validate(value: Any, info: ValidationInfo) -> Any:
        if value is not None and not ok(value):
            raise ValueError(message.format(flag=flag(info.field_name), value=value))
        return value

    return AfterValidator(validate)


PositiveInt = Annotated[
    int, check(lambda v: v > 0, "{flag} must be a positive integer, got {value}")
]
PositiveFloat = Annotated[
    float, check(lambda v: v > 0, "{flag} must be a positive number, got {value}")
]
NonNegativeFloat = Annotated[
    float, check(lambda v: v >= 0, "{flag} must be a non-negative number, got {value}")
]
NonNegativeInt = Annotated[int, check(lambda v: v >= 0, "{flag} must not be negative, got {value}")]
RunId = Annotated[str, check(lambda v: 0 < len(v) <= 64, "{flag} must be 1 to 64 characters long")]
Label = Annotated[str, check(lambda v: len(v) <= 64, "{flag} must be at most 64 characters long")]
Port = Annotated[
    int, check(lambda v: 0 <= v <= 65535, "{flag} must be between 0 and 65535, got {value}")
]
SpeedFactor = Annotated[
    float, check(lambda v: 1 <= v <= 1000, "{flag} must be between 1 and 1000, got {value}")
]
Momentum = Annotated[float, check(lambda v: 0 <= v < 1, "{flag} must be in [0, 1), got {value}")]
CorrectionStrength = Annotated[
    float, check(lambda v: 0 <= v <= 100, "{flag} must be in [0, 100], got {value}")
]
HeartbeatPeriod = Annotated[
    float, check(lambda v: 0.2 <= v <= 3600, "{flag} must be between 0.2 and 3600 seconds")
]
Megabytes = Annotated[
    float, check(lambda v: 0 <= v <= 1e7, "{flag} must be between 0 and 10000000")
]
GapWait = Annotated[
    float, check(lambda v: 0 < v <= 86400, "{flag} must be between 0 and 86400 seconds")
]
STALENESS_KINDS = ("constant", "polynomial", "hinge", "exponential")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


def _data_slice(value: str | None) -> str | None:
    if value is not None:
        from node.data import parse_data_slice  # here: the CLI's parser loads without torch

        parse_data_slice(value)  # raises with --data-slice in its message
    return value


DataSlice = Annotated[str | None, AfterValidator(_data_slice)]
