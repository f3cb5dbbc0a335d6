"""The studio page at ``/``: plain HTML, CSS and JavaScript modules from ``studio/web``, no build step.

The files are package data, served as they are. The page reaches the studio only
through same-origin relative URLs and has no inline script, style or event
handler, so it is served under a strict Content-Security-Policy: a script that
found its way into a model's output or a log line could neither run nor send
anything elsewhere.

What the load dialog may offer comes from ``GET /api/load-options`` (``studio.http.gui.gui_api``).
"""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import FileResponse
from starlette.exceptions import HTTPException

router = APIRouter()

WEB = Path(__file__).resolve().parents[2] / "web"
STATIC = WEB / "static"
CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data: blob:; "
    "media-src blob:; connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
#: Sent with the page and every file it loads.
HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",
    "Cache-Control": "no-cache",
}
_TYPES = {".js": "text/javascript", ".css": "text/css", ".svg": "image/svg+xml", ".png": "image/png"}


@router.get("/", include_in_schema=False)
async def page() -> FileResponse:
    return FileResponse(WEB / "index.html", media_type="text/html; charset=utf-8", headers=HEADERS)


@router.get("/static/{name:path}", include_in_schema=False)
async def static(name: str) -> FileResponse:
    """One of the page's files; nothing outside ``studio/web/static`` and only the types the page uses."""
    path = (STATIC / name).resolve()
    if not path.is_relative_to(STATIC) or path.suffix not in _TYPES or not path.is_file():
        raise HTTPException(404)  # answered in the one error shape by the app
    return FileResponse(path, media_type=_TYPES[path.suffix], headers=HEADERS)
