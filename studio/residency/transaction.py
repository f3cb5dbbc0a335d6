"""One load of one model, as a transaction: check, reserve, start, then commit or undo; cancellable.

The manager (``studio.residency.manager``) owns every ``Load``, at most one per instance of a model
file (its chat instance, its embedding instance), and
runs its steps in one task:

- *check*: settings, extra flags, projector, plan and launch files, before anything running is
  touched, so a refused load changes nothing;
- *reserve*: under the placement lock, the victims to evict (and the old instance a restart
  replaces) are chosen and paused, so no new request reaches them; the wait for their requests
  in flight happens outside the lock, bounded by ``busy_wait``;
- *start*: the victims are unloaded and the new llama-server is started and awaited;
- *commit* (the new resident is routed and its settings remembered) or *undo* (paused victims
  resume, a started llama-server is stopped, nothing is remembered). Every waiter gets the same
  outcome, through one future.

An unload of the model, or the studio's shutdown, cancels the load. A later load of the same
model with other settings supersedes it: this one is undone, and its waiters follow the later
one, whose settings win once.
"""

from __future__ import annotations

import asyncio
import enum
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType

from studio.errors import ModelUnloadedError
from studio.library.catalog import CatalogEntry
from studio.residency.placement import Holder
from studio.residency.requests import LoadRequest, LoadSettings
from studio.residency.resident import ResidentModel

#: Which instance of which model file: ``LoadSettings.key``.
Key = tuple[Path, bool]


class LoadStep(enum.Enum):
    """Where a load is; ``/api/status`` shows a load whose resident does not exist yet as ``resolving``."""

    CHECKING = "checking"  # reading the header, planning: nothing running is touched
    WAITING = "waiting"  # busy models hold the memory: they are paused until they go idle (bounded)
    RESERVED = "reserved"  # victims chosen and paused; their requests in flight finish
    STARTING = "starting"  # victims gone; the new llama-server is starting
    COMMITTED = "committed"  # the new resident is ready and routed (final)
    UNDONE = "undone"  # refused, failed, cancelled or superseded; nothing it touched stays changed (final)


#: Every allowed step; anything else is a bug and raises.
STEPS: MappingProxyType[LoadStep, frozenset[LoadStep]] = MappingProxyType(
    {
        # checking -> committed: what runs already has the settings (a load superseded back to them)
        LoadStep.CHECKING: frozenset({LoadStep.WAITING, LoadStep.RESERVED, LoadStep.COMMITTED, LoadStep.UNDONE}),
        LoadStep.WAITING: frozenset({LoadStep.CHECKING, LoadStep.UNDONE}),
        LoadStep.RESERVED: frozenset({LoadStep.STARTING, LoadStep.UNDONE}),
        LoadStep.STARTING: frozenset({LoadStep.COMMITTED, LoadStep.UNDONE}),
        LoadStep.COMMITTED: frozenset(),
        LoadStep.UNDONE: frozenset(),
    }
)


class _Superseded(Exception):
    """A later load of the same model, with other settings, took this load's place (never reaches a client)."""


@dataclass(eq=False)
class Load:
    """One load in progress; only the manager's task for it changes it."""

    model: str  # the name the first request used
    entry: CatalogEntry
    request: LoadRequest  # an implicit load (a chat naming the model) asks for the remembered settings
    settings: LoadSettings
    replacing: ResidentModel | None  # the instance a restart with other settings replaces, or a failed one
    after: Load | None = None  # the superseded load, undone before this one starts anything
    outcome: asyncio.Future[ResidentModel] = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    step: LoadStep = LoadStep.CHECKING
    task: asyncio.Task[None] | None = None
    paused: list[ResidentModel] = field(default_factory=list)  # admitting no new requests for this load
    victims: tuple[ResidentModel, ...] = ()  # reserved to go (evictions, the replaced instance)
    restarts: tuple[tuple[ResidentModel, int], ...] = ()  # idle CPU residents restarted first with these threads
    reservation: Holder | None = None  # what the new model will hold, from reserve until its resident exists
    resident: ResidentModel | None = None  # the new instance, once started
    waiting_since: float | None = None  # monotonic time it first waited for memory: loads that evict take turns
    cancelled: str | None = None  # why it was cancelled: the error its waiters get
    superseded: bool = False

    def __post_init__(self) -> None:
        # A load nobody waits for any more (its client left) still settles: its error is no leak.
        self.outcome.add_done_callback(lambda done: done.cancelled() or done.exception())

    def failure(self) -> Exception:
        """What the waiters of a load that ended without a resident hear."""
        if self.superseded:
            return _Superseded()
        return ModelUnloadedError(self.cancelled or f"the load of {self.entry.name} was interrupted")

    def names(self, model: str) -> bool:
        """Whether ``model`` (a name a request used, the catalog name or the path) names this load's model.

        A path names the model's chat instance, not its embedding instance.
        """
        by_path = model == str(self.entry.path) and not self.settings.embeddings
        return by_path or model in (self.model, self.entry.name)

    def move(self, step: LoadStep) -> None:
        if step not in STEPS[self.step]:
            raise RuntimeError(f"illegal load step {self.step.value} -> {step.value} ({self.entry.name})")
        self.step = step

    def cancel(self, reason: str, *, superseded: bool = False) -> None:
        """End the load: its task undoes what it did; waiters get ``reason`` (or follow the later load)."""
        if self.task is None or self.task.done() or self.cancelled is not None:
            return
        self.cancelled, self.superseded = reason, superseded
        self.task.cancel()

    async def wait(self) -> ResidentModel:
        """The ready resident, or the load's error; a waiter that leaves does not cancel the load."""
        return await asyncio.shield(self.outcome)

    async def ended(self) -> None:
        """Return once the load's task finished, undo included."""
        if self.task is not None:
            await asyncio.wait({self.task})

    def resume_paused(self, reason: str) -> None:
        for victim in self.paused:
            victim.resume(reason)
        self.paused.clear()
