"""The path rule (``studio.library.paths``) at the HTTP edge: checked before a request reaches the manager."""

from __future__ import annotations

import asyncio

from fastapi import Request

from studio.blocking import run_blocking
from studio.errors import PathNotAllowedError
from studio.residency.requests import base_name


async def check_model_path(request: Request, model: str | None) -> None:
    """Return if an API client may use ``model``; a resident model passes at once.

    A resident model was let in when it was loaded (by this rule, the command line or
    the config), so the hot path costs a dictionary look-up. Any other ``model`` is
    checked off the event loop: it may name a file on a slow or hostile file system.
    Requests that name it while its check runs wait for that check: 32 requests at once
    for a model that is not resident started 32 threads (+100 ms to each first token).

    Raises:
        studio.errors.PathNotAllowedError: a file outside the model folders, the HF cache and the studio home.
    """
    state = request.app.state
    manager = state.manager
    if model is None or manager.find(model) is not None:
        return
    checking: dict[str, asyncio.Future[None]] = state.path_checks
    check = checking.get(model)
    if check is None:  # one thread per name, however many requests name it at once (a fan-out to a cold model)
        check = checking[model] = asyncio.ensure_future(
            run_blocking(
                state.paths.check,
                base_name(model),  # an embedding instance's name: its model's file
                manager.catalog,
                timeout=manager.work_timeout,
                what=f"checking the path of {model}",
            )
        )
        check.add_done_callback(lambda _: checking.pop(model, None))
    await asyncio.shield(check)  # a client that leaves cancels its own wait, not the others'


async def check_projector_path(request: Request, mmproj: str | None) -> None:
    """Return if an API client may load the projector file ``mmproj`` (the models' path rule, for projectors).

    Raises:
        studio.errors.PathNotAllowedError: a file outside the model folders, the HF cache and the studio home.
    """
    if mmproj is None or mmproj.strip().lower() in ("", "none"):
        return
    manager = request.app.state.manager
    try:
        await run_blocking(
            request.app.state.paths.check,
            mmproj,
            manager.catalog,
            timeout=manager.work_timeout,
            what=f"checking the path of {mmproj}",
        )
    except PathNotAllowedError as exc:
        raise PathNotAllowedError(
            exc.message.replace("the model file", "the projector file", 1), path=exc.path, param="mmproj"
        ) from None


def check_extra_args(request: Request, args: list[str] | None) -> None:
    """Return if an API client may add ``args`` to llama-server's command line (only flags classified safe).

    Raises:
        studio.errors.PathNotAllowedError: a flag off ``launcher.client_flags.CLIENT_FLAGS``.
    """
    manager = request.app.state.manager
    request.app.state.paths.check_extra_args(args, manager.caps.aliases_of)
