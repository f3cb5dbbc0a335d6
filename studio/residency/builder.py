"""Turning a placed load into a resident model: its launch command, its lifetime, its supervisor.

What a new ``ResidentModel`` is made of (the command and its private files, the slot folder, the
TTL and pin a restart keeps, the wait for a GPU driver to give memory back after a stop) is decided
here, so that the manager only says when to make one.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import structlog

from gguf.templates import template_capabilities
from launcher.capabilities import Capabilities
from launcher.command import LaunchCommand, build_command
from launcher.devices import RELEASE_WAIT_S, Inventory, wait_for_memory_release
from launcher.errors import LauncherError
from launcher.planner import LaunchPlan
from launcher.registry import ChildRegistry
from launcher.supervisor import Status, Supervisor
from studio.errors import StudioError
from studio.library.catalog import CatalogEntry
from studio.residency.lifecycle import Admission, ResidentState
from studio.residency.placer import Placed
from studio.residency.requests import LoadRequest, model_defaults_for
from studio.residency.resident import ResidentModel
from studio.residency.slot_cache import SlotCache
from studio.settings import ModelDefaults, ResidencySettings

log = structlog.get_logger(__name__)

#: Makes one model's supervisor; it hands every state change to the callback it is given.
SupervisorFactory = Callable[[Callable[[Status], None]], Supervisor]


def supervisor_factory(logs_dir: Path, registry: ChildRegistry) -> SupervisorFactory:
    """Supervisors that log into ``logs_dir`` and record their children in ``registry``."""
    return lambda on_change: Supervisor(logs_dir=logs_dir, registry=registry, on_change=on_change)


@dataclass
class Builder:
    """Makes the launch command and the resident model of a placed load."""

    caps: Capabilities
    binary: Path
    make_supervisor: SupervisorFactory
    discover_devices: Callable[[], Inventory]
    residency: ResidencySettings
    model_defaults: Mapping[str, ModelDefaults]
    work_timeout: float
    files_root: Path | None = None
    slot_cache: SlotCache | None = None

    def launch_command(self, placed: Placed) -> LaunchCommand:
        """The command a load of ``placed`` runs: its private files under ``files_root``, its slot folder.

        ``ggstudio plan`` prints it too, so the command it shows is the one a load runs.
        """
        return self.command_for(placed.plan, embeddings=placed.settings.embeddings)

    def command_for(self, plan: LaunchPlan, *, embeddings: bool) -> LaunchCommand:
        """The command that runs ``plan``; an embedding instance's slots are never saved."""
        try:
            return build_command(
                plan,
                self.caps,
                binary=self.binary,
                files_root=self.files_root,
                slot_dir=self.slot_cache.folder(plan) if self.slot_cache is not None and not embeddings else None,
            )
        except OSError as exc:
            raise StudioError(f"could not prepare llama-server's launch files: {exc}", code="launch_files") from exc

    def resident(
        self,
        entry: CatalogEntry,
        request: LoadRequest,
        placed: Placed,
        command: LaunchCommand,
        *,
        was: ResidentModel | None,
        on_change: Callable[[ResidentModel], None],
        on_transition: Callable[[ResidentModel, ResidentState, ResidentState, float], None],
        on_admission: Callable[[ResidentModel, Admission, Admission, str], None],
    ) -> ResidentModel:
        """A new resident model for ``placed`` (not started); a restart keeps the lifetime ``was`` had (pin, TTL)."""
        own = model_defaults_for(entry, self.model_defaults)
        facts = placed.model.facts
        template = placed.settings.chat_template or facts.chat_template
        return self._made(
            placed.plan,
            command,
            name=entry.name,
            settings=placed.settings,
            facts=facts,
            template=template_capabilities(template) if template else None,
            ttl=next(t for t in (request.ttl, was.ttl if was else None, own.ttl, self.residency.ttl) if t is not None),
            pinned=next(p for p in (request.pinned, was.pinned if was else None, own.pinned, False) if p is not None),
            on_change=on_change,
            on_transition=on_transition,
            on_admission=on_admission,
            # an embedding instance's slots hold no conversation to continue: nothing is saved
            before_stop=None if self.slot_cache is None or placed.settings.embeddings else self.slot_cache.save,
        )

    def restarted(self, old: ResidentModel, threads: int, *, why: str) -> ResidentModel:
        """``old``'s model again (not started) with ``threads``: its settings, lifetime, callbacks and saved slots
        (the slot folder's key leaves threads out, so its conversations are restored). ``why`` ends its plan's
        reason: "threads: N, its share of the cores " + ``why``."""
        reason = f"threads: {threads}, its share of the cores {why}"
        kept = tuple(r for r in old.plan.reasons if not r.startswith("threads: "))  # a restart's reason replaces
        plan = replace(old.plan, threads=threads, reasons=(*kept, reason))
        command = self.command_for(plan, embeddings=old.settings.embeddings)
        return self._made(
            plan,
            command,
            name=old.name,
            settings=old.settings,
            facts=old.facts,
            template=old.template,
            ttl=old.ttl,
            pinned=old.pinned,
            on_change=old.on_change,
            on_transition=old.on_transition,
            on_admission=old.on_admission,
            before_stop=old.before_stop,
        )

    def _made(self, plan: LaunchPlan, command: LaunchCommand, **kept: Any) -> ResidentModel:
        """A resident of ``plan`` run by ``command``: its launch spec and supervisor are this builder's, the rest
        (name, settings, lifetime, callbacks) is ``kept``."""
        spec = replace(command.launch_spec(), after_stop=self.after_stop(plan))
        return ResidentModel(plan=plan, command=command, spec=spec, make_supervisor=self.make_supervisor, **kept)

    def after_stop(self, launch: LaunchPlan) -> Callable[[], None] | None:
        """What the supervisor runs once a llama-server on GPUs is reaped: wait until their free memory settles.

        A GPU driver frees a killed process's memory a little after the process is reaped; a plan made
        in between (the next load, an eviction's replacement, a restart) would see too little free memory.
        The resident stays ``unloading`` until this returns, so placement counts the memory as held.
        """
        keys = {d.key for d in launch.gpus}
        if not keys:
            return None  # host memory is back when the process is reaped

        def read_free() -> dict[str, int]:
            return {d.key: d.free_bytes for d in self.discover_devices().devices if d.key in keys}

        def wait() -> None:
            try:
                settled = wait_for_memory_release(read_free, timeout=min(self.work_timeout, RELEASE_WAIT_S))
            except (StudioError, LauncherError, OSError) as exc:  # a failing device query must not block a stop
                log.warning("could not watch GPU memory being released", error=str(exc))
                return
            if not settled:
                log.warning("GPU memory was still being released when the wait ended", gpus=sorted(keys))

        return wait
