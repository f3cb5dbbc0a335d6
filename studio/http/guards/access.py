"""Which ``Host`` names and which web-page origins may use the studio: the policy, without HTTP.

Two attacks from a web page the user merely opens:

- *Drive-by requests.* Any page may send requests to ``http://127.0.0.1:8080``; a
  browser marks them with the page's ``Origin``. Only the studio's own origin (its
  own page) and origins the user allow-listed get through.
- *DNS rebinding.* A page at ``http://evil.example:8080`` re-points its own name at
  127.0.0.1 and is then same-origin with the studio. Its requests still carry
  ``Host: evil.example:8080``, so only names that cannot be re-pointed are accepted:
  loopback addresses, ``localhost`` (browsers resolve it themselves), names the user
  configured, and, when the studio listens beyond loopback, the address it binds and
  this machine's own name. An address literal cannot be re-pointed by DNS at all, so
  a studio listening on every interface (``0.0.0.0``, ``::``) accepts any.

The port in ``Host`` is not checked: the name is what an attacker controls; a page
on another port of the same machine has another origin, which the origin check
refuses.
"""

from __future__ import annotations

import functools
import ipaddress
import re
import socket
from collections.abc import Iterable
from dataclasses import dataclass, field

ANY = "*"
_DEFAULT_PORTS = {"http": 80, "https": 443}
_WILDCARD_BINDS = frozenset({"", "0.0.0.0", "::"})
_ORIGIN = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*)://([^/?#@\s]+)/?")
# A studio sees a handful of distinct Host and Origin values; parsing one (ipaddress) costs ~10 µs, a
# lookup here well under 1 µs. Bounded, since the values come from clients.
_cached = functools.lru_cache(maxsize=1024)
_NAME = re.compile(r"[a-z0-9_]([a-z0-9_-]*[a-z0-9_])?(\.[a-z0-9_]([a-z0-9_-]*[a-z0-9_])?)*")


@_cached
def split_host(value: str) -> tuple[str, int | None]:
    """Return ``(host, port)`` of a ``Host`` header or an origin's authority, the host lower-cased.

    ``[::1]:8080`` gives ``("::1", 8080)``; ``LocalHost.`` gives ``("localhost", None)``.

    Raises:
        ValueError: not a host with an optional port.
    """
    value = value.strip().lower()
    if value.startswith("["):
        host, sep, rest = value[1:].partition("]")
        if not sep or (rest and not rest.startswith(":")):
            raise ValueError(f"not a host: {value!r}")
        ipaddress.IPv6Address(host)
        port_text = rest[1:] if rest else None
    elif value.count(":") == 1:
        host, port_text = value.split(":")
    else:
        host, port_text = value, None
    if host.endswith("."):  # the absolute form of a name is the same name
        host = host[:-1]
    if _is_ip(host):
        host = str(ipaddress.ip_address(host))
    elif not _NAME.fullmatch(host):
        raise ValueError(f"not a host: {value!r}")
    if port_text is None or port_text == "":
        return host, None
    if not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise ValueError(f"not a port: {port_text!r}")
    return host, int(port_text)


@_cached
def is_loopback(host: str) -> bool:
    """True for ``localhost`` and the loopback addresses (127.0.0.0/8, ``::1``, IPv4-mapped 127.x)."""
    if host == "localhost":
        return True
    try:
        address = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return False
    mapped = getattr(address, "ipv4_mapped", None)
    return address.is_loopback or bool(mapped and mapped.is_loopback)


def normalize_origin(text: str) -> str:
    """Return an origin as browsers write it (``scheme://host[:port]``, default port left out), or ``*``.

    Raises:
        ValueError: not an origin (a path, a bare host name, ``null``...).
    """
    text = text.strip()
    if text == ANY:
        return ANY
    match = _ORIGIN.fullmatch(text)
    if not match:
        raise ValueError(f"{text!r} is not an origin: write scheme://host[:port], e.g. http://localhost:3000")
    scheme = match[1].lower()
    host, port = split_host(match[2])
    return _origin(scheme, host, port)


def normalize_host(text: str) -> str:
    """Return a host name or address as the ``Host`` check compares it (lower-case, no brackets), or ``*``.

    Raises:
        ValueError: not a bare host (it has a scheme, a path or a port).
    """
    text = text.strip()
    if text == ANY:
        return ANY
    bare = text.strip("[]") if text.startswith("[") else text
    if _is_ip(bare):
        return str(ipaddress.ip_address(bare))
    try:
        host, port = split_host(text)
    except ValueError:
        raise ValueError(f"{text!r} is not a host name: write a bare name or address, e.g. studio.lan") from None
    if port is not None:
        raise ValueError(f"{text!r}: a host is named without a port (write {host!r})")
    return host


@dataclass(frozen=True)
class AccessPolicy:
    """The hosts and origins a request may name; see the module docstring for why each is safe."""

    allowed_hosts: frozenset[str] = frozenset()  # normalized (``normalize_host``); ``*`` allows any
    allowed_origins: frozenset[str] = frozenset()  # normalized (``normalize_origin``); ``*`` allows any
    bind_host: str = "127.0.0.1"  # the address the studio listens on (normalized; "" or 0.0.0.0 or :: for all)
    machine_names: frozenset[str] = field(default_factory=frozenset)  # this machine's own names

    @classmethod
    def create(
        cls, *, bind_host: str = "127.0.0.1", allowed_hosts: Iterable[str] = (), allowed_origins: Iterable[str] = ()
    ) -> AccessPolicy:
        """The policy for a studio listening on ``bind_host``; host names and origins are normalized here.

        Listening beyond loopback, the machine's host name (and its ``.local`` mDNS name) is allowed too.
        """
        names: frozenset[str] = frozenset()
        if bind_host not in _WILDCARD_BINDS:
            bind_host = normalize_host(bind_host)
        if not is_loopback(bind_host):
            own = socket.gethostname().lower().rstrip(".")
            short = own.split(".")[0]
            names = frozenset(n for n in (own, short, f"{short}.local") if n)
        return cls(
            allowed_hosts=frozenset(normalize_host(h) for h in allowed_hosts),
            allowed_origins=frozenset(normalize_origin(o) for o in allowed_origins),
            bind_host=bind_host,
            machine_names=names,
        )

    def host_allowed(self, header: str) -> bool:
        """True when a request's ``Host`` header names this studio in a way DNS cannot fake."""
        try:
            host, _ = split_host(header)
        except ValueError:
            return False
        if is_loopback(host) or host in self.allowed_hosts or ANY in self.allowed_hosts:
            return True
        if is_loopback(self.bind_host):
            return False
        if host in self.machine_names:
            return True
        if self.bind_host in _WILDCARD_BINDS:
            return _is_ip(host)
        return host == self.bind_host

    def origin_allowed(self, origin: str, own: str | None) -> bool:
        """True when a page at ``origin`` may use the studio: it is the studio's own (``own``) or allow-listed."""
        if ANY in self.allowed_origins:
            return True
        page = origin_of(origin)
        return page is not None and (page == own or page in self.allowed_origins)


@_cached
def origin_of(header: str) -> str | None:
    """A request's ``Origin`` normalized, or None for ``null`` (sandboxed frames, ``file:`` pages) and garbage."""
    try:
        page = normalize_origin(header)
    except ValueError:
        return None
    return None if page == ANY else page


@_cached
def own_origin(scheme: str, host_header: str) -> str | None:
    """The origin of the studio's own page as the request reached it, or None for a bad ``Host``."""
    try:
        host, port = split_host(host_header)
    except ValueError:
        return None
    return _origin(scheme.lower(), host, port)


def _origin(scheme: str, host: str, port: int | None) -> str:
    shown = f"[{host}]" if ":" in host else host
    return f"{scheme}://{shown}" + (f":{port}" if port is not None and port != _DEFAULT_PORTS.get(scheme) else "")


@_cached
def _is_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True
