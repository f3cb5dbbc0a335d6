"""A real studio service for tests: the app under uvicorn on a free loopback port, in a thread."""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import uvicorn

from launcher.capabilities import probe
from launcher.registry import ChildRegistry
from launcher.supervisor import owner_token
from studio.history.service import History
from studio.http.app import create_app
from studio.http.server import StudioServer
from studio.library.catalog import Catalog
from studio.load_options import OPTIONS, Option
from studio.residency.manager import ModelManager, supervisor_factory
from studio.residency.requests import LoadRequest
from studio.settings import ModelDefaults, ResidencySettings
from tests.helpers import free_port, wait_for


@dataclass
class RunningStudio:
    url: str
    manager: ModelManager
    server: StudioServer


@contextmanager
def running_studio(
    root: Path,
    binary: Path,
    models: Mapping[str, Path],
    *,
    defaults: Mapping[str, ModelDefaults] | None = None,
    residency: ResidencySettings | None = None,
    preload: Sequence[LoadRequest] = (),
    aliases: Mapping[str, str] | None = None,
    api_token: str | None = None,
    port: int | None = None,
    hf_cache: Path | None = None,
    load_options: Sequence[Option] = OPTIONS,
    **manager_options: Any,
) -> Iterator[RunningStudio]:
    """A studio whose catalog holds ``models`` (name -> file, linked into ``root/models``) and, with
    ``hf_cache``, that Hugging Face cache; its chat history is in ``root/history`` and Hub headers are kept in
    ``root/hub-headers``. On ``port`` (default: a free one); stopped on exit."""
    folder = root / "models"
    folder.mkdir(parents=True, exist_ok=True)
    for name, path in models.items():
        link = folder / f"{name}.gguf"
        if not link.exists():
            link.symlink_to(path)
    manager = ModelManager(
        catalog=Catalog([folder], aliases=dict(aliases or {}), hf_cache=hf_cache),
        binary=binary,
        make_supervisor=supervisor_factory(root / "logs", ChildRegistry(root / "run", owner_token())),
        caps=probe(binary, cache_dir=root / "cache"),
        model_defaults=dict(defaults or {}),
        residency=residency,
        **manager_options,
    )
    port = port or free_port()
    app = create_app(
        manager,
        preload=preload,
        api_token=api_token,
        history=History(root / "history"),
        hub_headers=root / "hub-headers",
        load_options=load_options,
    )
    server = StudioServer(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_for(lambda: server.started, timeout=30, what="uvicorn to start")
    try:
        yield RunningStudio(f"http://127.0.0.1:{port}", manager, server)
    finally:
        server.should_exit = True
        server.wake()
        thread.join(60)
