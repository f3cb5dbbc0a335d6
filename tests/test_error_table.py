"""The one error table: every error class of the three packages has its own row, drawn in its tree.

What the rows look like to HTTP clients (and in each dialect): tests/test_error_shapes.py.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import pytest

import gguf
import launcher
import studio
from gguf import errors as gguf_errors
from launcher import errors as launcher_errors
from launcher.errors import BinaryNotFoundError, LoadError
from studio import errors as studio_errors
from studio.cli.common import exit_code
from studio.error_table import ROOTS, TABLE, outcome
from studio.errors import (
    AlreadyRunningError,
    AnsweredError,
    CommandError,
    DiskSpaceError,
    DoesNotFitError,
    Exit,
    ModelNotFoundError,
    ModelResidentError,
    StudioError,
    StudioHomeError,
)

PACKAGES = {gguf: gguf_errors, launcher: launcher_errors, studio: studio_errors}


def error_classes() -> list[type[BaseException]]:
    """Every public exception class defined in a module of gguf, launcher or studio."""
    found: dict[str, type[BaseException]] = {}
    for package in PACKAGES:
        for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
            module = importlib.import_module(info.name)
            for name, obj in vars(module).items():
                if (
                    inspect.isclass(obj)
                    and issubclass(obj, BaseException)
                    and obj.__module__ == info.name
                    and not name.startswith("_")
                ):
                    found[f"{info.name}.{name}"] = obj
    return sorted(found.values(), key=lambda c: (c.__module__, c.__name__))


def unmapped(classes: list[type[BaseException]]) -> list[str]:
    """What is wrong with ``classes``: no root, no row of its own, or missing from its package's drawn tree."""
    wrong = []
    for cls in classes:
        package = next(p for p in PACKAGES if cls.__module__.split(".")[0] == p.__name__)
        if not issubclass(cls, ROOTS):
            wrong.append(f"{cls.__module__}.{cls.__name__} has no root of the three")
        if cls not in TABLE:
            wrong.append(f"{cls.__module__}.{cls.__name__} has no row in studio.error_table.TABLE")
        if f" {cls.__name__} " not in (PACKAGES[package].__doc__ or "").replace("\n", " \n"):
            wrong.append(f"{cls.__name__} is not in the tree drawn in {PACKAGES[package].__name__}")
    return wrong


def test_every_error_class_of_the_three_packages_has_a_row_and_a_place_in_its_tree():
    classes = error_classes()
    assert len(classes) > 40  # the walk found the packages' errors, not an empty list
    assert unmapped(classes) == []


def test_the_check_fails_on_a_class_left_unmapped():
    class FreshError(StudioError):
        """An error someone added without a row."""

    FreshError.__module__ = "studio.errors"
    assert unmapped([FreshError]) == [
        "studio.errors.FreshError has no row in studio.error_table.TABLE",
        "FreshError is not in the tree drawn in studio.errors",
    ]
    assert unmapped([ModelNotFoundError]) == []


def test_no_code_is_a_class_name():
    names = {cls.__name__ for cls in TABLE}
    assert not [row for row in TABLE.values() if row.code in names]


def test_the_most_specific_row_wins_and_an_instance_narrows_its_code():
    assert outcome(LoadError("exited", cause="out_of_memory")).code == "out_of_memory"
    assert outcome(LoadError("exited")).code == "load_failed"
    assert outcome(DoesNotFitError("too big")).code == "does_not_fit"
    assert outcome(ModelNotFoundError("gone", code="not_downloaded")).code == "not_downloaded"
    assert outcome(KeyError("a bug")) is None


@pytest.mark.parametrize(
    "exc, code",
    [
        (ModelNotFoundError("no such model"), Exit.NOT_FOUND),
        (BinaryNotFoundError(["/usr/bin"]), Exit.NOT_FOUND),
        (gguf.MissingShardError("shard 2 of 3 is missing"), Exit.NOT_FOUND),
        (FileNotFoundError("nothing there"), Exit.NOT_FOUND),
        (DoesNotFitError("too big"), Exit.DOES_NOT_FIT),
        (DiskSpaceError("full disk"), Exit.DOES_NOT_FIT),
        (LoadError("exited"), Exit.LLAMA_FAILED),
        (gguf.NotGGUFError("not a GGUF file"), Exit.ERROR),
        (CommandError("--port wants a number", exit=Exit.USAGE), Exit.USAGE),
        (AlreadyRunningError("a studio already runs", home="/h", pid=1, url=None), Exit.ALREADY_RUNNING),
        (ModelResidentError("it is resident"), Exit.ERROR),
        (StudioHomeError("read-only", path="/h/studio.lock"), Exit.ERROR),
        (KeyError("a bug"), Exit.ERROR),
    ],
)
def test_the_cli_exit_code_comes_from_the_same_table(exc, code):
    assert exit_code(exc) == code


@pytest.mark.parametrize(
    "status, code, exit",
    [
        (404, "model_not_found", Exit.NOT_FOUND),
        (404, None, Exit.NOT_FOUND),
        (400, "does_not_fit", Exit.DOES_NOT_FIT),
        (507, None, Exit.DOES_NOT_FIT),
        (502, "out_of_memory", Exit.LLAMA_FAILED),  # a code no row has: its status decides
        (502, None, Exit.LLAMA_FAILED),
        (400, None, Exit.ERROR),
        (418, None, Exit.ERROR),
        (409, "already_running", Exit.ALREADY_RUNNING),
        (409, "model_resident", Exit.ERROR),
        (409, None, Exit.LLAMA_FAILED),  # a bare 409 is a cancelled load: the one-studio rows come after
    ],
)
def test_a_running_studios_answer_gets_the_exit_code_its_code_or_status_has_here(status, code, exit):
    answer = AnsweredError("the studio said no", status=status, code=code)
    assert exit_code(answer) == exit
    assert (outcome(answer).status, outcome(answer).code) == (status, code)


def test_an_answer_that_is_not_in_openais_shape_is_quoted_not_parsed():
    error = AnsweredError.from_body(502, b"<html>Bad Gateway</html>", server="http://127.0.0.1:8080")
    assert error.message == "http://127.0.0.1:8080 answered HTTP 502: <html>Bad Gateway</html>"
    parsed = AnsweredError.from_body(
        404, b'{"error": {"message": "no model x", "type": "not_found_error", "code": "model_not_found"}}'
    )
    assert (parsed.message, parsed.type, parsed.code) == ("no model x", "not_found_error", "model_not_found")
