"""The base of every model a user writes: the root config's sections and every plugin's ``Config``.

Two rules hold for all of them, built-in or third-party: a misspelt key is an error (``extra``
forbidden), and ``true`` is not a number, alone or in a list (pydantic would read it as 1:
``layers: true`` would build a one-layer pool, ``failures: true`` open a breaker at one failure).
"""

from __future__ import annotations

from collections.abc import Sequence
from types import UnionType
from typing import Any, Union, get_args, get_origin

from pydantic import BaseModel, ConfigDict, ModelWrapValidatorHandler, ValidationError, model_validator

_NUMBER_TYPES = (int, float)
_SEQUENCES = (list, tuple, Sequence)


def _number_fields(annotation: Any) -> tuple[bool, bool]:
    """Whether a field's annotation takes a number (``int``, ``float``, optional or not), and
    whether it takes a list or tuple of them (``layer_ids``, a state's ``shape``)."""
    options = get_args(annotation) if get_origin(annotation) in (Union, UnionType) else (annotation,)
    one = any(option in _NUMBER_TYPES for option in options)
    many = any(
        get_origin(option) in _SEQUENCES
        and get_args(option)
        and all(arg in _NUMBER_TYPES or arg is Ellipsis for arg in get_args(option))
        for option in options
    )
    return one, many


def _boolean_errors(fields: dict[str, Any], data: dict[Any, Any]) -> list[dict[str, Any]]:
    """pydantic error details (plain dicts) for every ``true`` / ``false`` given for a number."""
    found: list[tuple[tuple[Any, ...], bool]] = []
    for name, value in data.items():
        field = fields.get(name) if isinstance(name, str) else None
        if field is None:
            continue
        one, many = _number_fields(field.annotation)
        if one and isinstance(value, bool):
            found.append(((name,), value))
        elif many and isinstance(value, list | tuple):
            found += [((name, i), item) for i, item in enumerate(value) if isinstance(item, bool)]
    return [
        {
            "type": "value_error",
            "loc": loc,
            "input": value,
            "ctx": {"error": ValueError(f"expected a number, got {str(value).lower()}")},
        }
        for loc, value in found
    ]


class UserConfig(BaseModel):
    """A section of a config a user writes."""

    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="wrap")
    @classmethod
    def _no_booleans_for_numbers(cls, data: Any, handler: ModelWrapValidatorHandler[Any]) -> Any:
        # a model validator, not a field one: pydantic allows none on a discriminator (``type``);
        # the errors carry the field's name, so a config error names its dotted path
        if isinstance(data, dict):
            errors: list[Any] = _boolean_errors(cls.model_fields, data)  # pydantic's InitErrorDetails
            if errors:
                raise ValidationError.from_exception_data(cls.__name__, errors)
        return handler(data)
