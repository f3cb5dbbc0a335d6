"""Which model's llama-server holds a conversation's resumable stream: conv_id -> model, as llama.cpp's router keeps.

A generating request with an ``X-Conversation-Id`` header makes llama-server b11434 record its stream as a
session (``tools/server/server-stream.cpp``); the router remembers which child it forwarded the request to,
so ``GET``/``DELETE /v1/stream?conv_id=`` go straight to that child (``tools/server/server-models.h``:
``conv_model_tracker``). ``StreamOwners`` is the studio's copy, bounded to the last ``CAPACITY``
conversations: an older one is forgotten, and its stream is then found only by ``?model=``.

A request registers before it waits for its model (``claim``), as the router's does, so a stop during the
load can cancel it: ``forget`` marks the claim stopped, and the request, once its model is ready, finds
it so (``settle``) and answers that it was cancelled instead of starting a generation nobody can stop.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from starlette.requests import Request

from studio.errors import BadRequestError

#: The request header llama-server keys its stream sessions by.
CONVERSATION_HEADER = "X-Conversation-Id"
_RAW_HEADER = CONVERSATION_HEADER.lower().encode()  # as ASGI servers give header names
#: Conversations remembered; the oldest is forgotten beyond.
CAPACITY = 4096
#: The longest conversation id taken (llama.cpp's web UI sends a UUID and the model's name): bounds the map's memory.
MAX_ID = 1024


@dataclass(eq=False)
class Claim:
    """One request's registration of a conversation: the model that serves it once known, and whether a stop came."""

    model: str | None
    stopped: bool = False


class StreamOwners:
    """conv_id -> the ``Claim`` of the request that last streamed it, least recently used forgotten first."""

    def __init__(self, capacity: int = CAPACITY) -> None:
        self._capacity = capacity
        self._claims: OrderedDict[str, Claim] = OrderedDict()

    def claim(self, conv_id: str, model: str | None) -> Claim:
        """Register a request for ``conv_id`` asking for ``model`` (``None``: the default); it replaces an older one."""
        claim = self._claims[conv_id] = Claim(model)
        self._keep(conv_id)
        return claim

    def settle(self, conv_id: str, claim: Claim, model: str) -> bool:
        """Record that ``claim``'s request goes to ``model`` now; ``False``: a stop came while it waited."""
        if claim.stopped:
            return False
        claim.model = model
        if conv_id not in self._claims:  # forgotten for newer ones while it waited: it is the newest again
            self._claims[conv_id] = claim
            self._keep(conv_id)
        return True

    def owner(self, conv_id: str) -> Claim | None:
        """The latest claim of ``conv_id``, if it is remembered."""
        claim = self._claims.get(conv_id)
        if claim is not None:
            self._claims.move_to_end(conv_id)
        return claim

    def forget(self, conv_id: str) -> Claim | None:
        """Drop ``conv_id`` (a stop): a request still waiting for its model is cancelled; return what was there."""
        claim = self._claims.pop(conv_id, None)
        if claim is not None:
            claim.stopped = True
        return claim

    def _keep(self, conv_id: str) -> None:
        self._claims.move_to_end(conv_id)
        while len(self._claims) > self._capacity:
            self._claims.popitem(last=False)


def conversation_of(request: Request) -> str | None:
    """The request's ``X-Conversation-Id``, if it has one.

    Raises:
        BadRequestError: the id is longer than ``MAX_ID`` characters.
    """
    raw = next((value for name, value in request.scope["headers"] if name == _RAW_HEADER), None)  # no Headers object
    conv_id = raw.decode("latin-1") if raw is not None else None
    if conv_id and len(conv_id) > MAX_ID:
        raise BadRequestError(f"`{CONVERSATION_HEADER}` is longer than {MAX_ID} characters")
    return conv_id or None


def stream_owners(request: Request) -> StreamOwners:
    """The app's one ``StreamOwners`` (the Ollama listener shares the studio app's state)."""
    return request.app.state.stream_owners
