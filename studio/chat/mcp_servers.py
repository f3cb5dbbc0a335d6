"""MCP servers from the config: their tools, listed and called through the official ``mcp`` SDK.

Each server has one owner task (``MCPServer._own``) that alone holds its
``mcp.Client`` session, from start to stop; calls are sent to it and answered
through futures, so the SDK's task groups and cancel scopes stay inside the task
that opened them. A server that cannot start, or dies later (its process exits,
its HTTP endpoint goes away), is ``failed``: its tools disappear from the toolbox,
a call that was in flight ends with an error result the model reads and a notice
for the GUI, and the studio carries on.

Stdio servers' stderr goes to ``<logs>/mcp-<name>.log``; its last line is quoted
when the server dies.
"""

from __future__ import annotations

import asyncio
import enum
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import anyio
import mcp
import structlog
from mcp.client.stdio import get_default_environment, stdio_client
from mcp.types import CONNECTION_CLOSED

from studio.chat.tool import ToolResult, ToolSpec
from studio.settings import MCPServerConfig

log = structlog.get_logger(__name__)

#: Separates a server's name from its tool's in the name the model sees (``files__read_file``).
SEPARATOR = "__"
#: Seconds ``stop`` waits for a server to shut down before its task is cancelled.
STOP_GRACE = 5.0


class ServerState(enum.Enum):
    """Where one MCP server is."""

    STOPPED = "stopped"  # not started, or stopped with the studio
    STARTING = "starting"  # connecting and listing its tools
    READY = "ready"  # its tools can be called
    FAILED = "failed"  # could not start, or died; ``error`` says why


@dataclass
class _Call:
    name: str
    arguments: dict[str, Any]
    timeout: float
    answer: asyncio.Future[ToolResult]


class MCPTool:
    """One tool of one MCP server, as the toolbox offers it."""

    def __init__(self, server: MCPServer, tool: Any) -> None:
        self.server = server
        self.remote_name = tool.name
        schema = tool.input_schema if isinstance(tool.input_schema, dict) else {"type": "object"}
        self.spec = ToolSpec(
            f"{server.name}{SEPARATOR}{tool.name}",
            tool.description or tool.name,
            {k: v for k, v in schema.items() if k != "title"},
            f"mcp:{server.name}",
        )

    async def call(self, arguments: dict[str, Any], *, timeout: float) -> ToolResult:
        return await self.server.call(self.remote_name, arguments, timeout=timeout)


class MCPServer:
    """One ``[mcp_servers.NAME]``; see the module docstring."""

    def __init__(self, config: MCPServerConfig, *, logs_dir: Path | None = None) -> None:
        self.config = config
        self.name = config.name
        self.logs_dir = logs_dir
        self.state = ServerState.STOPPED
        self.error: str | None = None
        self._tools: list[MCPTool] = []
        self._calls: asyncio.Queue[_Call | None] = asyncio.Queue()
        self._task: asyncio.Task[None] | None = None
        self._ready = asyncio.Event()

    def tools(self) -> list[MCPTool]:
        """Its tools while it is ready; none otherwise."""
        return list(self._tools) if self.state == ServerState.READY else []

    def status(self) -> dict[str, Any]:
        return {
            "state": self.state.value,
            "error": self.error,
            "transport": "http" if self.config.url else "stdio",
            "tools": [t.spec.name for t in self.tools()],
        }

    async def start(self, *, timeout: float) -> None:
        """Connect and list the tools within ``timeout`` seconds; a failure is kept in ``error``, not raised."""
        self.state, self.error = ServerState.STARTING, None
        self._ready.clear()
        self._task = asyncio.create_task(self._own(), name=f"mcp-{self.name}")
        try:
            async with asyncio.timeout(timeout):
                await self._ready.wait()
        except TimeoutError:
            self._fail(f"did not answer within {timeout:g} s")
            await self.stop()
            self.state = ServerState.FAILED
        if self.state == ServerState.READY:
            log.info("mcp server ready", server=self.name, tools=[t.remote_name for t in self._tools])
        else:
            log.warning("mcp server unavailable", server=self.name, error=self.error)

    async def stop(self) -> None:
        """End the session (the SDK stops a stdio server's process); bounded, idempotent."""
        task, self._task = self._task, None
        if task is None:
            return
        self._calls.put_nowait(None)
        try:
            async with asyncio.timeout(STOP_GRACE):
                await asyncio.shield(task)
        except TimeoutError:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        if self.state != ServerState.FAILED:
            self.state = ServerState.STOPPED

    async def call(self, name: str, arguments: dict[str, Any], *, timeout: float) -> ToolResult:
        """Call tool ``name``; an error result when the server is down, dies, or takes longer than ``timeout``."""
        if self.state != ServerState.READY:
            return ToolResult(f"the MCP server {self.name!r} is not available: {self.error or self.state.value}", True)
        answer: asyncio.Future[ToolResult] = asyncio.get_running_loop().create_future()
        self._calls.put_nowait(_Call(name, arguments, timeout, answer))
        return await answer

    # -- the owner task ---------------------------------------------------------------------
    async def _own(self) -> None:
        errlog = self._open_errlog()
        try:
            async with mcp.Client(self._target(errlog)) as client:
                self._tools = [MCPTool(self, tool) for tool in await _list_tools(client)]
                self.state = ServerState.READY
                self._ready.set()
                async with anyio.create_task_group() as group:
                    while (call := await self._calls.get()) is not None:
                        group.start_soon(self._one_call, client, call)
                    group.cancel_scope.cancel()
        except Exception as exc:  # the SDK's errors, OSError, a dead process: all mean "the server is gone"
            self._fail(self._why(exc))
        finally:
            errlog.close()
            self._ready.set()
            self._drain(self.error or "the MCP server was stopped")

    async def _one_call(self, client: mcp.Client, call: _Call) -> None:
        try:
            with anyio.fail_after(call.timeout):
                result = await client.call_tool(call.name, call.arguments)
        except TimeoutError:
            _answer(call, ToolResult(f"the tool {call.name!r} did not answer within {call.timeout:g} s", True))
        except mcp.MCPError as exc:
            if exc.code != CONNECTION_CLOSED:  # the server refused this call; the session goes on
                _answer(call, ToolResult(f"the MCP server {self.name!r} refused the call: {exc}", True))
                return
            why = self._why(exc)
            self._fail(why)  # before the answer: the caller's next call must not queue for a dead session
            _answer(
                call,
                ToolResult(
                    f"the MCP server {self.name!r} went away during the call: {why}",
                    True,
                    notice=f"MCP server {self.name!r} went away: {why}",
                ),
            )
            raise
        else:
            _answer(call, ToolResult(_result_text(result), bool(result.is_error)))
        finally:  # cancelled with the session (another call found the server dead)
            _answer(
                call,
                ToolResult(
                    f"the MCP server {self.name!r} went away during the call",
                    True,
                    notice=f"MCP server {self.name!r} went away",
                ),
            )

    def _target(self, errlog: TextIO) -> Any:
        """What ``mcp.Client`` connects to: the URL, or a stdio transport whose stderr goes to ``errlog``."""
        if self.config.url:
            return self.config.url
        env = {**get_default_environment(), **self.config.env}
        params = mcp.StdioServerParameters(
            command=self.config.command or "", args=list(self.config.args), env=env, cwd=self.config.cwd
        )
        return stdio_client(params, errlog=errlog)

    def _open_errlog(self) -> TextIO:
        if self.config.url or self.logs_dir is None:
            return open(os.devnull, "w")
        self.logs_dir.mkdir(parents=True, exist_ok=True)
        return (self.logs_dir / f"mcp-{self.name}.log").open("a", encoding="utf-8")

    def _why(self, exc: BaseException) -> str:
        text = "; ".join(dict.fromkeys(str(e) or type(e).__name__ for e in _leaves(exc)))
        tail = self._errlog_tail()
        return f"{text} (its last words: {tail})" if tail else text

    def _errlog_tail(self) -> str | None:
        if self.config.url or self.logs_dir is None:
            return None
        try:
            lines = (self.logs_dir / f"mcp-{self.name}.log").read_text(errors="replace").strip().splitlines()
        except OSError:
            return None
        return lines[-1][-200:] if lines else None

    def _fail(self, why: str) -> None:
        if self.state == ServerState.FAILED:  # the first reason is the one worth keeping
            return
        was_ready = self.state == ServerState.READY
        self.state, self.error = ServerState.FAILED, why
        if was_ready:
            log.error("mcp server died", server=self.name, error=why)

    def _drain(self, why: str) -> None:
        """Answer every call still queued once the session is gone."""
        while not self._calls.empty():
            call = self._calls.get_nowait()
            if call is not None:
                _answer(
                    call,
                    ToolResult(
                        f"the MCP server {self.name!r} went away: {why}",
                        True,
                        notice=f"MCP server {self.name!r} went away: {why}",
                    ),
                )


async def _list_tools(client: mcp.Client) -> list[Any]:
    tools, cursor = [], None
    for _ in range(100):  # a paginator that never ends must not hang the start
        page = await client.list_tools(cursor=cursor)
        tools += page.tools
        cursor = page.next_cursor
        if not cursor:
            break
    return tools


def _leaves(exc: BaseException) -> list[BaseException]:
    """The exceptions inside (nested) exception groups; the SDK's task groups wrap what went wrong."""
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for inner in exc.exceptions for leaf in _leaves(inner)]
    return [exc]


def _answer(call: _Call, result: ToolResult) -> None:
    if not call.answer.done():
        call.answer.set_result(result)


def _result_text(result: Any) -> str:
    """A call's content blocks as text: text as is, other blocks named; structured content when that is all."""
    parts = []
    for block in result.content or ():
        text = getattr(block, "text", None)
        parts.append(text if isinstance(text, str) else f"[{getattr(block, 'type', 'content')} block]")
    if not parts and result.structured_content is not None:
        parts.append(json.dumps(result.structured_content, ensure_ascii=False))
    return "\n".join(parts) or "(no output)"
