"""The tools the studio itself can run for ``/api/chat``: the built-in ``python`` tool and MCP servers' tools.

One ``Toolbox`` per app, started and stopped with it (``studio.http.app``). A chat
names the tools it lets the model use (``select``); nothing else ever runs, and a
name that is unknown or switched off is a 400. Each tool answers a call with a
``ToolResult`` and never raises for what the tool itself did wrong: a crash, a
timeout or a dead server is an error result the model reads, so the chat goes on.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog

from studio.chat.tool import Tool
from studio.errors import BadRequestError
from studio.settings import ToolSettings

if TYPE_CHECKING:
    from studio.chat.mcp_servers import MCPServer
    from studio.chat.python_tool import PythonTool

log = structlog.get_logger(__name__)


class Toolbox:
    """The configured tools; see the module docstring.

    Args:
        settings: the ``[tools.python]`` and ``[mcp_servers.*]`` config.
        scratch_dir: where the python tool makes a fresh folder per call.
        logs_dir: where MCP servers' stderr goes (one file per server).
    """

    def __init__(
        self, settings: ToolSettings, *, scratch_dir: Path, logs_dir: Path | None = None, start_timeout: float = 30.0
    ) -> None:
        self.settings = settings
        self.start_timeout = start_timeout
        self.python: PythonTool | None = None
        self.servers: dict[str, MCPServer] = {}
        if settings.python.enabled:
            from studio.chat.python_tool import PythonTool

            self.python = PythonTool(settings.python, scratch_dir)
        if settings.mcp_servers:
            from studio.chat.mcp_servers import MCPServer  # the mcp SDK costs ~1 s to import: only with servers

            self.servers = {name: MCPServer(config, logs_dir=logs_dir) for name, config in settings.mcp_servers.items()}

    @classmethod
    def empty(cls) -> Toolbox:
        """A toolbox with nothing in it (no tools configured)."""
        return cls(ToolSettings(), scratch_dir=Path("."))

    async def start(self) -> None:
        """Start every MCP server at once; one that fails is reported in ``status``, never raised."""
        await asyncio.gather(*(server.start(timeout=self.start_timeout) for server in self.servers.values()))

    async def aclose(self) -> None:
        """Stop every MCP server (each bounded in time)."""
        await asyncio.gather(*(server.stop() for server in self.servers.values()))

    def tools(self) -> dict[str, Tool]:
        """Every tool that can run now, by the name the model sees."""
        out: dict[str, Tool] = {}
        if self.python is not None:
            out[self.python.spec.name] = self.python
        for server in self.servers.values():
            for tool in server.tools():
                out[tool.spec.name] = tool
        return out

    def select(self, names: Iterable[str]) -> list[Tool]:
        """The tools named by a chat, in its order.

        Raises:
            BadRequestError: a name is not a tool that is configured, switched on and running.
        """
        available = self.tools()
        chosen, missing = [], []
        for name in dict.fromkeys(names):
            (chosen.append(available[name]) if name in available else missing.append(name))
        if missing:
            known = ", ".join(sorted(available)) or "none (enable [tools.python] or add [mcp_servers.NAME])"
            raise BadRequestError(
                f"no enabled tool is named {', '.join(map(repr, missing))}; available: {known}", param="use_tools"
            )
        return chosen

    def status(self) -> dict[str, Any]:
        """A JSON-able view for the GUI: each tool, the python tool's sandbox, each MCP server's state."""
        return {
            "tools": [
                dict(name=t.spec.name, description=t.spec.description, source=t.spec.source)
                for t in self.tools().values()
            ],
            "python": self.python.status() if self.python is not None else {"enabled": False},
            "mcp_servers": {name: server.status() for name, server in self.servers.items()},
        }
