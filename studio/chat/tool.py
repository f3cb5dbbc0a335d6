"""What a tool is to the chat loop: its spec (what the model is told), its result, and the call it answers.

Below the toolbox and the tools themselves (``studio.chat.python_tool``,
``studio.chat.mcp_servers``), so each tool imports these and the toolbox imports
the tools, never round in a circle.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

__all__ = ["Tool", "ToolResult", "ToolSpec"]


@dataclass(frozen=True)
class ToolSpec:
    """What the model is told about a tool: OpenAI's function fields, and where the tool comes from."""

    name: str
    description: str
    parameters: dict[str, Any]
    source: str  # "builtin" or "mcp:<server>"

    def as_openai(self) -> dict[str, Any]:
        """The tool as a chat request's ``tools`` entry."""
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }


@dataclass(frozen=True)
class ToolResult:
    """What a call returned, as text for the model; ``is_error`` when the tool failed.

    ``notice`` is for the GUI, not the model: something about the tool itself changed
    (its MCP server died), shown as a ``status`` event.
    """

    text: str
    is_error: bool = False
    notice: str | None = None


class Tool(Protocol):
    """A tool the loop can run."""

    spec: ToolSpec

    async def call(self, arguments: dict[str, Any], *, timeout: float) -> ToolResult:
        """Run the tool within ``timeout`` seconds; never raises for the tool's own failures."""
        ...
