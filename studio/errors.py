"""Errors of the studio service, and the one OpenAI-shaped body every HTTP error uses.

::

    StudioError
    ├── ModelNotFoundError (+LookupError)   a model name or path the studio cannot find (404)
    ├── BadRequestError (+ValueError)       a request the studio refuses as given (400)
    │   └── PayloadTooLargeError            the request body is over max_body_bytes (413)
    ├── BusyError                           too many requests waiting, or memory held by busy models (503 + Retry-After)
    ├── DoesNotFitError                     the model does not fit even with every idle model evicted (400)
    ├── ModelNotResidentError (+LookupError) an unload, pin or TTL names a model that is not resident (404)
    ├── ModelUnloadedError                  the model was unloaded while the request ran (503)
    ├── WorkTimeoutError (+TimeoutError)    a header read, plan or device query ran past its time limit (504)
    ├── PathNotAllowedError (+PermissionError) an API client named a file outside the library (403)
    ├── HubError                            Hugging Face Hub access or a download failed (502)
    │   ├── HubAuthError (+PermissionError) the repo needs a token with access: set HF_TOKEN (401)
    │   ├── DiskSpaceError (+OSError)       the download does not fit on the disk (507)
    │   └── DownloadCancelledError          the download was cancelled; the cache stays consistent (499)
    └── UpstreamError                       llama-server failed or went away (502)

Errors from the layers below (``gguf.GGUFError``, ``launcher.errors.*``) are
translated in ``studio.http.app`` at one boundary; clients always receive
``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

from typing import Any


class StudioError(Exception):
    """Base of the studio's own errors; carries the HTTP status it maps to."""

    status = 500
    type = "server_error"

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


class ModelNotFoundError(StudioError, LookupError):
    """The named model is neither registered nor an existing file."""

    status = 404
    type = "not_found_error"


class BadRequestError(StudioError, ValueError):
    """The request is malformed or asks for something the studio refuses."""

    status = 400
    type = "invalid_request_error"


class PathNotAllowedError(StudioError, PermissionError):
    """An API client named a model file outside the model folders, the Hugging Face cache and the studio home."""

    status = 403
    type = "permission_error"

    def __init__(self, message: str, *, path: str, param: str = "model", code: str = "path_not_allowed") -> None:
        super().__init__(message, param=param, code=code)
        self.path = path


class PayloadTooLargeError(BadRequestError):
    """The request body is longer than the configured ``max_body_bytes``."""

    status = 413
    type = "request_too_large"

    def __init__(self, message: str, *, limit: int) -> None:
        super().__init__(message, code="request_too_large")
        self.limit = limit


class BusyError(StudioError):
    """A load is in progress and the queue of waiting requests is full."""

    status = 503
    type = "server_busy"

    def __init__(self, message: str, *, retry_after: int = 5) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class DoesNotFitError(StudioError):
    """The plan does not fit the memory budget even with every idle, unpinned model evicted."""

    status = 400
    type = "invalid_request_error"

    def __init__(self, message: str, *, param: str | None = "n_ctx") -> None:
        super().__init__(message, param=param, code="does_not_fit")


class ModelNotResidentError(StudioError, LookupError):
    """An unload, pin or TTL change names a model that is not resident."""

    status = 404
    type = "not_found_error"

    def __init__(self, message: str) -> None:
        super().__init__(message, param="model", code="model_not_resident")


class ModelUnloadedError(StudioError):
    """The model was unloaded (by a user, a TTL or an eviction) while the request was running."""

    status = 503
    type = "model_unloaded"

    def __init__(self, message: str) -> None:
        super().__init__(message, code="model_unloaded")


class WorkTimeoutError(StudioError, TimeoutError):
    """Blocking work (a header read, a plan, a device query) ran past its time limit."""

    status = 504
    type = "timeout_error"

    def __init__(self, message: str) -> None:
        super().__init__(message, code="timeout")


class HubError(StudioError):
    """The Hugging Face Hub could not be reached or answered with an error."""

    status = 502
    type = "hub_error"


class HubAuthError(HubError, PermissionError):
    """The repo is gated or private and no token with access was given (set HF_TOKEN)."""

    status = 401
    type = "authentication_error"


class DiskSpaceError(HubError, OSError):
    """The files still to download need more space than the cache disk has free."""

    status = 507
    type = "insufficient_storage"

    def __init__(self, message: str, *, needed: int = 0, free: int = 0, fallback: str | None = None) -> None:
        super().__init__(message)
        self.needed = needed
        self.free = free
        self.fallback = fallback


class DownloadCancelledError(HubError):
    """The download was cancelled; complete files stay in the cache, the partial one is gone."""

    status = 499
    type = "cancelled"


class UpstreamError(StudioError):
    """llama-server failed to answer or went away."""

    status = 502
    type = "upstream_error"


def error_body(message: str, type: str, param: str | None = None, code: str | None = None,
               **extra: Any) -> dict[str, Any]:
    """Return OpenAI's error shape; ``extra`` adds fields such as ``n_ctx``."""
    return {"error": {"message": message, "type": type, "param": param, "code": code, **extra}}
