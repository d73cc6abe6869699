"""The base of every model a user writes: the root config's sections and every plugin's ``Config``.

Two rules hold for all of them, built-in or third-party: a misspelt key is an error (``extra``
forbidden), and ``true`` is not a number (pydantic would read it as 1: ``layers: true`` would
build a one-layer pool).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, ModelWrapValidatorHandler, ValidationError, model_validator

#: annotations of number fields
_NUMBERS = (int, float, int | None, float | None)


class UserConfig(BaseModel):
    """A section of a config a user writes."""

    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="wrap")
    @classmethod
    def _no_booleans_for_numbers(cls, data: Any, handler: ModelWrapValidatorHandler[Any]) -> Any:
        # a model validator, not a field one: pydantic allows none on a discriminator (``type``);
        # the errors carry the field's name, so a config error names its dotted path
        if isinstance(data, dict):
            errors: list[Any] = [  # pydantic_core's InitErrorDetails, as plain dicts
                {
                    "type": "value_error",
                    "loc": (name,),
                    "input": value,
                    "ctx": {"error": ValueError(f"expected a number, got {str(value).lower()}")},
                }
                for name, value in data.items()
                if isinstance(value, bool)
                and name in cls.model_fields
                and cls.model_fields[name].annotation in _NUMBERS
            ]
            if errors:
                raise ValidationError.from_exception_data(cls.__name__, errors)
        return handler(data)
