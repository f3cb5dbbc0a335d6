"""``ggstudio top``: a running studio's activity, live in the terminal, drawn with rich.

Two readers feed one state: ``/api/activity/events`` (the requests in flight and each record as it is
made) and ``/api/status`` once a ``--every`` (the models, their memory and the queue). The screen is
redrawn from that state only; nothing is computed twice. rich already draws the CLI's progress bars
(typer's dependency); ``top`` uses its ``Live`` display and tables.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Annotated, Any

import typer

from launcher.units import format_mib
from studio.cli.common import UrlOption, app, call_studio, stream_studio_events

if TYPE_CHECKING:
    from rich.console import RenderableType

#: Records shown under the requests in flight.
LAST = 15


@dataclass
class TopState:
    """What ``top`` shows: written by the readers, read by the drawing, under one lock."""

    status: dict[str, Any] = field(default_factory=dict)
    in_flight: list[dict[str, Any]] = field(default_factory=list)
    last: deque[dict[str, Any]] = field(default_factory=lambda: deque(maxlen=LAST))
    problem: str | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)

    def take(self, event: dict[str, Any]) -> None:
        """One live event of ``/api/activity/events``."""
        with self.lock:
            if event["type"] == "in_flight":
                self.in_flight = event["requests"]
            elif event["type"] == "begin":
                self.in_flight = [*self.in_flight, event["request"]]
            elif event["type"] == "record":
                record = event["record"]
                self.last.appendleft(record)
                self.in_flight = [r for r in self.in_flight if r["id"] != record["id"]]


def _seconds(value: float | None) -> str:
    if not value:
        return "-"
    return f"{value * 1000:.0f} ms" if value < 1 else f"{value:.1f} s"


def _mib(value: int | None) -> str:
    return "-" if value is None else format_mib(value)


def _clock(epoch: float | None) -> str:
    return "-" if epoch is None else time.strftime("%H:%M:%S", time.localtime(epoch))


def render(state: TopState) -> RenderableType:
    """The screen: the models and the queue, the requests in flight, the last records."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    with state.lock:
        status, in_flight, last, problem = dict(state.status), list(state.in_flight), list(state.last), state.problem

    models = Table(title="Models", title_justify="left", expand=True)
    for column in ("model", "state", "in flight", "memory (actual)", "context"):
        models.add_column(column)
    for m in status.get("models", []):
        actual = ((m.get("memory") or {}).get("actual") or {}).get("total")
        models.add_row(
            m["model"], m["state"], str(m.get("in_flight", 0)), _mib(actual), str(m.get("effective_context") or "-")
        )
    head = Text(f"queued for a load: {status.get('waiting', 0)}    in flight: {len(in_flight)}")

    running = Table(title="In flight", title_justify="left", expand=True)
    for column in ("id", "model", "route", "phase", "for", "retries", "client"):
        running.add_column(column)
    for r in in_flight:
        running.add_row(
            r["id"],
            r.get("model") or "-",
            r["route"],
            r["phase"],
            _seconds(r.get("seconds")),
            str(r.get("retries", 0)),
            (r.get("client") or {}).get("user_agent") or "-",
        )

    recent = Table(title="Last requests, loads and evictions", title_justify="left", expand=True)
    for column in ("at", "kind", "model", "route", "queued", "load", "prefill", "decode", "tok/s", "tokens", "outcome"):
        recent.add_column(column)
    for r in last:
        if r["kind"] == "request":
            phases, tokens = r["phases"], r["tokens"]
            rate = f"{r['decode_tps']:.1f}" if r.get("decode_tps") else "-"
            prompt = f"{tokens.get('prompt_processed') or 0}+{tokens.get('prompt_cached') or 0}c"
            made = f"{prompt}→{tokens.get('generated') or 0}"
            outcome = r["outcome"] + (f" ({r['retries']} retried)" if r.get("retries") else "")
            recent.add_row(
                _clock(r["times"]["arrived"]),
                "request",
                r.get("model") or "-",
                r["route"],
                _seconds(phases["queued"]),
                _seconds(phases["load_wait"]),
                _seconds(phases["prefill"]),
                _seconds(phases["decode"]),
                rate,
                made,
                outcome,
            )
        else:
            why = f"{r['outcome']}" + (f", evicted {', '.join(r['evicted'])}" if r.get("evicted") else "")
            recent.add_row(
                _clock(r["times"]["ended"]),
                r["kind"],
                r["model"],
                "-",
                "-",
                _seconds(r["seconds"]),
                "-",
                "-",
                "-",
                "-",
                why,
            )
    parts: list[RenderableType] = [head, models, running, recent]
    if problem:
        parts.insert(0, Text(problem, style="bold red"))
    return Group(*parts)


def _follow(url: str | None, state: TopState, stop: threading.Event) -> None:
    """Read the live events until ``stop``; a broken stream is said on the screen and opened again."""
    while not stop.is_set():
        try:
            for event in stream_studio_events(url, "/api/activity/events"):
                state.problem = None
                state.take(event)
                if stop.is_set():
                    return
        except Exception as exc:  # the studio went away: say so, try again
            state.problem = f"live events: {exc}"
        stop.wait(1.0)


def _poll(url: str | None, state: TopState, stop: threading.Event, every: float) -> None:
    while not stop.is_set():
        try:
            status = call_studio("GET", url, "/api/status", timeout=10)
            with state.lock:
                state.status = status
        except Exception as exc:
            state.problem = f"status: {exc}"
        stop.wait(every)


@app.command()
def top(
    url: UrlOption = None,
    every: Annotated[float, typer.Option(help="Seconds between two redraws (and reads of the status).")] = 1.0,
    once: Annotated[bool, typer.Option("--once", help="Print one screen and exit (for a script).")] = False,
) -> None:
    """Show a running studio's activity live.

    The models, the requests in flight and queued, and the last requests: each one's phases (queued,
    waiting for a load, prefill, decode), tokens and tokens/s; loads and evictions as they happen.
    Ctrl-C ends it:

    ggstudio top --url http://127.0.0.1:8081
    """
    from rich.console import Console
    from rich.live import Live

    state = TopState()
    state.status = call_studio("GET", url, "/api/status")  # a studio that is not there fails here, plainly
    found = call_studio("GET", url, f"/api/activity?limit={LAST}")
    state.in_flight = found["in_flight"]
    state.last.extend(found["records"])
    console = Console()
    if once:
        console.print(render(state))
        return
    stop = threading.Event()
    readers = [
        threading.Thread(target=_follow, args=(url, state, stop), daemon=True),
        threading.Thread(target=_poll, args=(url, state, stop, every), daemon=True),
    ]
    for reader in readers:
        reader.start()
    try:
        with Live(render(state), console=console, refresh_per_second=4, screen=False) as live:
            while True:
                time.sleep(min(every, 0.25))
                live.update(render(state))
    except KeyboardInterrupt:
        pass
    finally:
        stop.set()
