"""The request bodies of the studio's own API: a field they do not know is refused, by name.

Pydantic drops unknown fields by default, so ``POST /api/load {"ctx": 8192}`` loaded with the
default context and said nothing, while the config file refuses unknown keys. ``ApiBody``
forbids them, and its 422 names the field with the one it looks like (``ctx: unknown field;
did you mean n_ctx?``) or the fields there are. The forwarded dialects' bodies (OpenAI's,
Anthropic's, Ollama's) are no ``ApiBody``: their unknown fields go on to llama-server. Nor is
``/api/chat``'s: it takes OpenAI's sampling fields on to llama-server too, so only its own
``tool_limits`` is one.
"""

from __future__ import annotations

import difflib
from typing import Any, Self

from pydantic import BaseModel, ConfigDict, ValidationError, ValidatorFunctionWrapHandler, model_validator
from pydantic_core import ErrorDetails, InitErrorDetails, PydanticCustomError


class ApiBody(BaseModel):
    """A body of the studio's own ``/api`` routes: unknown fields are refused, with a hint."""

    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="wrap")
    @classmethod
    def _name_unknown_fields(cls, data: Any, handler: ValidatorFunctionWrapHandler) -> Self:
        try:
            return handler(data)
        except ValidationError as exc:
            errors = exc.errors()
            if not any(_unknown_here(e) for e in errors):
                raise
            raise ValidationError.from_exception_data(exc.title, [_carried(cls, e) for e in errors]) from None


def _unknown_here(error: ErrorDetails) -> bool:
    """An unknown field of this model itself (a nested body's were named by its own validator)."""
    return error["type"] == "extra_forbidden" and len(error["loc"]) == 1


def _carried(model: type[BaseModel], error: ErrorDetails) -> InitErrorDetails:
    """``error`` as it reads, or, for an unknown field of ``model``, with the field it looks like."""
    message = error["msg"]
    if _unknown_here(error):
        known = list(model.model_fields)
        near = difflib.get_close_matches(str(error["loc"][0]), known, n=1, cutoff=0.6)
        message = "unknown field; " + (f"did you mean {near[0]}?" if near else f"the fields are {', '.join(known)}")
    return InitErrorDetails(type=PydanticCustomError(error["type"], message), loc=error["loc"], input=error["input"])
