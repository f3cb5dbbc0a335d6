"""The access policy without HTTP: which Host names and page origins are trusted, and how they are written."""

from __future__ import annotations

import socket

import pytest

from studio.http.guards.access import AccessPolicy, normalize_host, normalize_origin, origin_of, own_origin, split_host


@pytest.mark.parametrize(
    "header",
    [
        "127.0.0.1:8080",
        "127.0.0.1",
        "127.8.9.10:1",
        "localhost:8080",
        "LOCALHOST.",
        "[::1]:8080",
        "[::1]",
        "::1",
        "[::ffff:127.0.0.1]:80",
    ],
)
def test_loopback_hosts_are_allowed_on_a_loopback_studio(header):
    assert AccessPolicy.create().host_allowed(header)


@pytest.mark.parametrize(
    "header",
    [
        "evil.example",
        "evil.example:8080",
        "localhost.evil.example:8080",
        "foo.localhost:8080",
        "127.0.0.1.evil.example",
        "192.168.1.20:8080",
        "[fe80::1]:8080",
        "0.0.0.0:8080",
        "",
        "evil example",
        "a:b:c:8080",
        "[::1]x",
        "host:99999",
    ],
)
def test_other_hosts_are_refused_on_a_loopback_studio(header):
    """A DNS-rebinding page's own name (and anything malformed) is refused; so are addresses we do not listen on."""
    assert not AccessPolicy.create().host_allowed(header)


def test_configured_hosts_are_allowed_by_name_whatever_the_port():
    policy = AccessPolicy.create(allowed_hosts=["Studio.LAN", "[fd00::5]"])
    assert policy.host_allowed("studio.lan:8080") and policy.host_allowed("STUDIO.lan.")
    assert policy.host_allowed("[fd00::5]:8080")
    assert not policy.host_allowed("studio.lan.evil.example") and not policy.host_allowed("lan")
    assert AccessPolicy.create(allowed_hosts=["*"]).host_allowed("anything.example:1")


def test_a_studio_bound_to_one_lan_address_answers_to_it_and_the_machine_name():
    policy = AccessPolicy.create(bind_host="192.168.1.20")
    assert policy.host_allowed("192.168.1.20:8080")
    assert policy.host_allowed(f"{socket.gethostname()}:8080")
    assert not policy.host_allowed("192.168.1.21:8080")  # another address: not where we listen
    assert not policy.host_allowed("evil.example:8080")
    assert policy.host_allowed("127.0.0.1:8080")  # still loopback


def test_a_studio_on_every_interface_answers_to_any_address_but_to_no_foreign_name():
    """Address literals cannot be re-pointed by DNS; names other than the machine's own can."""
    for bind in ("0.0.0.0", "::"):
        policy = AccessPolicy.create(bind_host=bind)
        assert policy.host_allowed("10.1.2.3:8080") and policy.host_allowed("[fd00::1]:8080")
        assert policy.host_allowed(f"{socket.gethostname().split('.')[0]}.local:8080")
        assert not policy.host_allowed("evil.example:8080")


def test_origins_are_compared_as_browsers_write_them():
    assert normalize_origin("HTTP://LocalHost:80/") == "http://localhost"
    assert normalize_origin("https://example.com:443") == "https://example.com"
    assert normalize_origin("http://[::1]:3000") == "http://[::1]:3000"
    assert normalize_origin("tauri://localhost") == "tauri://localhost"
    assert own_origin("http", "LOCALHOST:8080") == "http://localhost:8080"
    assert own_origin("https", "[::1]:443") == "https://[::1]"
    assert own_origin("http", "bad host") is None
    assert origin_of("null") is None and origin_of("*") is None


def test_only_the_own_origin_and_listed_ones_are_allowed():
    policy = AccessPolicy.create(allowed_origins=["http://localhost:3000"])
    own = "http://127.0.0.1:8080"
    assert policy.origin_allowed("http://127.0.0.1:8080", own)
    assert policy.origin_allowed("http://LOCALHOST:3000", own)
    for page in (
        "http://localhost:8080",
        "http://127.0.0.1:3000",
        "https://localhost:3000",
        "null",
        "http://evil.example",
        "garbage",
    ):
        assert not policy.origin_allowed(page, own), page
    assert not policy.origin_allowed("http://127.0.0.1:8080", None)  # no Host: no own origin
    assert AccessPolicy.create(allowed_origins=["*"]).origin_allowed("null", own)  # only when the user writes it


@pytest.mark.parametrize(
    "text", ["localhost:3000", "http://localhost:3000/app", "http://", "null", "http://a b", "http://user@host"]
)
def test_what_is_no_origin_is_refused_in_the_config(text):
    with pytest.raises(ValueError, match="not an origin|not a host"):
        normalize_origin(text)


@pytest.mark.parametrize("text", ["studio.lan:8080", "http://studio.lan", "studio.lan/x", "", "a b"])
def test_what_is_no_bare_host_is_refused_in_the_config(text):
    with pytest.raises(ValueError):
        normalize_host(text)


def test_split_host_reads_ports_and_brackets():
    assert split_host("[::1]:8080") == ("::1", 8080)
    assert split_host("Example.COM.") == ("example.com", None)
    assert split_host("[0:0::1]") == ("::1", None)
