"""A stand-in MCP server written with the official ``mcp`` SDK, for the tool-loop tests.

No MCP server ships with the studio and none can be downloaded here, so the tests
start this one, as a real child process over stdio (``python -m tests.mcp_standin_server``)
or over streamable HTTP (``--http PORT``). Its tools imitate what real servers do
to a client: answer (``get_weather``, ``add``), hang (``hang``), fail inside the tool
(``crash``, which the SDK reports as an error result), print megabytes
(``shout``), and die in the middle of a call (``die``: the process exits, as a
crashed server does).
"""

from __future__ import annotations

import argparse
import os

import anyio
from mcp.server.mcpserver import MCPServer

server = MCPServer("standin")


@server.tool()
def get_weather(city: str) -> str:
    """The weather in a city."""
    return f"Sunny, 21 C in {city}"


@server.tool()
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


@server.tool()
async def hang(seconds: float = 3600.0) -> str:
    """Take a very long time."""
    await anyio.sleep(seconds)
    return "done"


@server.tool()
def crash() -> str:
    """Fail inside the tool."""
    raise RuntimeError("the tool crashed on purpose")


@server.tool()
def shout(n: int) -> str:
    """Answer with n characters."""
    return "x" * n


@server.tool()
def die() -> str:
    """Exit the server process in the middle of the call."""
    os._exit(3)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--http", type=int, help="serve streamable HTTP on this port instead of stdio")
    port = parser.parse_args().http
    if port:
        server.run("streamable-http", host="127.0.0.1", port=port)
    else:
        server.run("stdio")
