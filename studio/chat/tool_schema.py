"""Checks the tool fields of a chat request before llama-server sees them.

llama-server answers a malformed ``tools`` list with a generic 500 or silently
ignores parts of it (b11434 ``tools/server/server-common.cpp`` reads
``tool_choice`` as a string and falls back to "auto" for anything else), so the
studio refuses what is wrong with a 400 that names the field, and translates
OpenAI's object form of ``tool_choice`` (force one named function) into what
llama-server understands: that function alone, and ``"required"``.
"""

from __future__ import annotations

from typing import Any

import jsonschema

from studio.errors import BadRequestError

TOOL_CHOICES = ("none", "auto", "required")


def check_tool_fields(body: dict[str, Any]) -> None:
    """Validate ``tools``, ``tool_choice`` and ``parallel_tool_calls`` in ``body``; rewrite a forced choice.

    Raises:
        BadRequestError: naming the offending field, e.g. ``tools[1].function.name``.
    """
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise BadRequestError(
                '`tools` must be a list of {"type": "function", "function": {...}} objects', param="tools"
            )
        names = [_check_tool(tool, f"tools[{i}]") for i, tool in enumerate(tools)]
        for i, name in enumerate(names):
            if name in names[:i]:
                raise BadRequestError(f"two tools are named {name!r}", param=f"tools[{i}].function.name")
    if "parallel_tool_calls" in body and not isinstance(body["parallel_tool_calls"], bool):
        raise BadRequestError("`parallel_tool_calls` must be true or false", param="parallel_tool_calls")
    if "tool_choice" in body:
        _check_choice(body)


def tool_names(body: dict[str, Any]) -> frozenset[str]:
    """The function names a (checked) request offers the model."""
    return frozenset(t["function"]["name"] for t in body.get("tools") or ())


def tool_parameters(body: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Each offered function's parameter schema (``{}`` where it has none)."""
    return {t["function"]["name"]: t["function"].get("parameters") or {} for t in body.get("tools") or ()}


def _check_tool(tool: Any, where: str) -> str:
    if not isinstance(tool, dict):
        raise BadRequestError(f"`{where}` must be an object", param=where)
    if tool.get("type", "function") != "function":
        raise BadRequestError(f'`{where}.type` must be "function" (got {tool.get("type")!r})', param=f"{where}.type")
    function = tool.get("function")
    if not isinstance(function, dict):
        raise BadRequestError(f"`{where}.function` must be an object with a name", param=f"{where}.function")
    name = function.get("name")
    if not isinstance(name, str) or not name.strip():
        raise BadRequestError(f"`{where}.function.name` must be a non-empty string", param=f"{where}.function.name")
    if "description" in function and not isinstance(function["description"], str):
        raise BadRequestError(f"`{where}.function.description` must be a string", param=f"{where}.function.description")
    if "parameters" in function:
        _check_parameters(function["parameters"], f"{where}.function.parameters")
    return name


def _check_parameters(schema: Any, where: str) -> None:
    """A function's parameters are a JSON schema of an object (OpenAI's rule)."""
    if not isinstance(schema, dict):
        raise BadRequestError(f"`{where}` must be a JSON schema object, not {type(schema).__name__}", param=where)
    kind = schema.get("type", "object")
    if kind != "object" and not (isinstance(kind, list) and "object" in kind):
        raise BadRequestError(f'`{where}.type` must be "object" (got {kind!r})', param=f"{where}.type")
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as exc:
        path = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in exc.path)
        raise BadRequestError(
            f"`{where}{path}` is not a valid JSON schema: {exc.message}", param=f"{where}{path}"
        ) from None


def _check_choice(body: dict[str, Any]) -> None:
    choice = body["tool_choice"]
    if isinstance(choice, str):
        if choice not in TOOL_CHOICES:
            raise BadRequestError(
                f"`tool_choice` must be one of {', '.join(TOOL_CHOICES)} or a function object (got {choice!r})",
                param="tool_choice",
            )
        return
    function = choice.get("function") if isinstance(choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str):
        raise BadRequestError(
            '`tool_choice` must be a string or {"type": "function", "function": {"name": ...}}', param="tool_choice"
        )
    chosen = [t for t in body.get("tools") or () if t["function"]["name"] == name]
    if not chosen:
        raise BadRequestError(
            f"`tool_choice` names {name!r}, which is not among `tools`", param="tool_choice.function.name"
        )
    body["tools"], body["tool_choice"] = chosen, "required"
