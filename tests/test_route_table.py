"""The forwarded-route table without a server: which request goes where, and which slot file names are refused."""

from __future__ import annotations

import pytest

from studio.errors import BadRequestError
from studio.http.openai_proxy import FORWARDED, REFUSED, check_slot_file, route_for


def test_every_route_llama_server_serves_for_a_model_is_a_row():
    native = {"/completion", "/completions", "/tokenize", "/detokenize", "/apply-template", "/embedding", "/props"}
    native |= {"/slots", "/slots/{id_slot}", "/lora-adapters", "/infill", "/rerank", "/v1/audio/transcriptions"}
    native |= {"/chat/completions", "/v1/chat/completions", "/v1/completions", "/metrics"}
    assert native <= FORWARDED.keys()
    assert not REFUSED.keys() & FORWARDED.keys()


@pytest.mark.parametrize(
    ("method", "path", "query", "upstream"),
    [
        ("POST", "/completions", b"", "/completion"),  # llama-server's bare /completions is its native one
        ("POST", "/chat/completions", b"", "/v1/chat/completions"),
        ("GET", "/props", b"model=m", "/props"),
        ("GET", "/props", b"", "/props"),  # the default model's
        ("POST", "/props", b"", "/props"),
        ("POST", "/slots/12", b"action=save", "/slots/12"),
        ("GET", "/metrics", b"model=m", "/metrics"),
        ("GET", "/metrics", b"", None),  # the studio's own
        ("GET", "/metrics", b"xmodel=m", None),
        ("GET", "/tokenize", b"", None),  # llama-server takes POST only
        ("POST", "/slots/first", b"", None),
        ("POST", "/slots", b"", None),
    ],
)
def test_a_request_goes_to_the_route_llama_server_serves_it_on(method, path, query, upstream):
    found = route_for(method, path, query)
    assert (found[1] if found else None) == upstream


@pytest.mark.parametrize(
    "name", ["../escaped.bin", "/tmp/escaped.bin", "sub/slot.bin", "..", ".", "", "a\\b", "C:\\slots\\x.bin"]
)
def test_a_slot_file_outside_the_slot_folder_is_refused_with_the_reason(name):
    with pytest.raises(BadRequestError, match="plain name") as refused:
        check_slot_file({"filename": name})
    assert refused.value.param == "filename"


def test_a_plain_slot_file_name_and_an_erase_without_one_pass():
    check_slot_file({"filename": "slot-1.bin"})
    check_slot_file({})
    with pytest.raises(BadRequestError, match="must be a string"):
        check_slot_file({"filename": 3})
