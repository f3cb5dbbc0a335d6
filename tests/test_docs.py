"""The documentation: every example marked runnable in README.md and docs/*.md runs, and the links between the pages
hold.

An example is marked by the line ``<!-- runnable -->`` right before its fenced ``sh``/``bash`` or ``python`` block.
The examples are written as a reader runs them, against a studio at ``http://127.0.0.1:8080`` (the Ollama API at
``http://127.0.0.1:11434``) with ``.venv/bin/ggstudio``: they run here against one real ``ggstudio serve`` (the default
model, SmolLM2-135M-Instruct, and the Ollama port) started for this module in the test run's studio home, with those
two addresses pointed at it, in a scratch folder whose ``.venv`` is the venv running the tests. The link check follows
GitHub's rules for heading anchors; external links are not fetched, only checked to be well-formed.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest

from studio.library.default_model import CHAT_FILENAME
from tests.helpers import assert_no_children, free_port, stop_studio, wait_for
from tests.test_cli import CLI, assert_no_llama_server, tagged_env

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MARK = "<!-- runnable -->"
LANGUAGES = ("sh", "bash", "python")
#: The addresses the examples name, as `make run` and `serve --ollama-port 11434` listen.
DOC_PORT, DOC_OLLAMA_PORT = 8080, 11434
#: Seconds one example may take; each is a few small requests to SmolLM2 or a CLI command.
EXAMPLE_SECONDS = 90


@dataclass(frozen=True)
class Example:
    """One runnable block: where it is, its language and its code."""

    page: Path
    line: int  # of the opening fence, 1-based
    language: str
    code: str

    @property
    def id(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def runnable_examples(page: Path) -> tuple[list[Example], list[str]]:
    """Return the runnable examples of ``page``, and a problem for each mark that is not on a block it can run."""
    lines = page.read_text().splitlines()
    examples, problems = [], []
    for i, line in enumerate(lines):
        if line.strip() != MARK:
            continue
        where = f"{page.relative_to(ROOT)}:{i + 1}"
        fence = lines[i + 1].strip() if i + 1 < len(lines) else ""
        language = fence.removeprefix("```")
        if not fence.startswith("```") or language not in LANGUAGES:
            problems.append(f"{where}: {MARK} is not right before a ```sh, ```bash or ```python block")
            continue
        end = next((j for j in range(i + 2, len(lines)) if lines[j].strip() == "```"), None)
        if end is None:
            problems.append(f"{where}: its block is never closed")
            continue
        examples.append(Example(page, i + 2, language, textwrap.dedent("\n".join(lines[i + 2 : end])) + "\n"))
    return examples, problems


EXAMPLES = [example for page in PAGES for example in runnable_examples(page)[0]]


# --- the link check ----------------------------------------------------------------------------------------------

FENCE = re.compile(r"^\s*```.*?^\s*```[ \t]*$", re.MULTILINE | re.DOTALL)
CODE_SPAN = re.compile(r"(`+).+?\1", re.DOTALL)
LINK = re.compile(r"\[[^\]]*\]\(([^()\s]*)\)")
AUTOLINK = re.compile(r"<(https?://[^>]*)>")
HEADING = re.compile(r"^#{1,6}[ \t]+(.+?)[ \t#]*$", re.MULTILINE)


def prose(text: str) -> str:
    """The page without its code blocks and code spans, where nothing is a link or a heading."""
    return CODE_SPAN.sub("", FENCE.sub("", text))


def slug(heading: str) -> str:
    """The anchor GitHub gives a heading: its text lowercased, punctuation dropped, each space a hyphen."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading anchors on its text
    text = re.sub(r"<[^>]+>", "", text).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """Every heading anchor of ``page``; a repeated heading gets -1, -2... as on GitHub."""
    seen: Counter[str] = Counter()
    out = set()
    for match in HEADING.finditer(FENCE.sub("", page.read_text())):
        base = slug(match.group(1))
        out.add(f"{base}-{seen[base]}" if seen[base] else base)
        seen[base] += 1
    return out


def broken_links(page: Path, root: Path = ROOT) -> list[str]:
    """Every link of ``page`` that points nowhere: a missing file, a missing heading, a malformed web address."""
    text = prose(page.read_text())
    targets = [m.group(1) for m in LINK.finditer(text)] + [m.group(1) for m in AUTOLINK.finditer(text)]
    problems = []
    for target in targets:
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):
            parts = urlsplit(target)
            if parts.scheme not in ("http", "https") or not parts.netloc:
                problems.append(f"{target}: not a well-formed http(s) address")
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.is_relative_to(root.resolve()):
            problems.append(f"{target}: outside the repository")
        elif not file.exists():
            problems.append(f"{target}: no such file")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file):
            problems.append(f"{target}: no heading #{anchor} in {file.name}")
    return problems


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_every_link_of_the_page_points_at_a_file_and_a_heading_that_exist(page):
    assert broken_links(page) == []


def test_the_link_check_finds_a_missing_page_a_missing_heading_and_a_malformed_address(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "b.md").write_text("# Page B\n\n## Load options, and the flags\n")
    page = tmp_path / "a.md"
    page.write_text(
        "# A\n\n[ok](docs/b.md#load-options-and-the-flags) [self](#a) [web](https://example.com/x)\n"
        "[gone](docs/c.md) [no heading](docs/b.md#nowhere) [bad](htp:/x) [up](../../etc/passwd)\n"
        "```\n[in code](nowhere.md)\n```\n`[in a span](nowhere.md)`\n"
    )
    assert broken_links(page, root=tmp_path) == [
        "docs/c.md: no such file",
        "docs/b.md#nowhere: no heading #nowhere in b.md",
        "htp:/x: not a well-formed http(s) address",
        "../../etc/passwd: outside the repository",
    ]


def test_heading_anchors_follow_githubs_rules(tmp_path):
    assert slug("Load options, and the flags the studio manages") == "load-options-and-the-flags-the-studio-manages"
    assert slug("The pinned llama.cpp") == "the-pinned-llamacpp"
    assert slug("A running studio: ps, load, unload, logs, rm") == "a-running-studio-ps-load-unload-logs-rm"
    assert slug("`/metrics` and [the docs](docs/README.md)") == "metrics-and-the-docs"
    assert slug("RPC workers: beyond one machine") == "rpc-workers-beyond-one-machine"
    page = tmp_path / "p.md"
    page.write_text("# Tools\n\n## Tools\n\n```\n# not a heading\n```\n")
    assert anchors(page) == {"tools", "tools-1"}


def test_every_docs_page_is_in_the_index():
    index = (ROOT / "docs" / "README.md").read_text()
    listed = {m.group(1) for m in LINK.finditer(index)}
    assert [p.name for p in PAGES[1:] if p.name != "README.md" and p.name not in listed] == []


def test_the_readme_is_a_front_page_whose_terminal_example_chats_with_an_instruct_model():
    """The README was 1,323 lines, and its terminal example chatted with the base Gemma model, which never stops."""
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 300
    assert "make test" in readme and "make run" in readme  # CI runs `make test`, as the README says
    assert "ggstudio run SmolLM2-135M-Instruct.Q4_1" in readme and "ggstudio run gemma-3-270m" not in readme


def test_every_runnable_mark_is_on_a_block_that_runs_and_the_readme_has_some():
    assert [problem for page in PAGES for problem in runnable_examples(page)[1]] == []
    in_readme = {e.language for e in EXAMPLES if e.page.name == "README.md" and e.page.parent == ROOT}
    assert {"sh", "python"} <= in_readme


# --- the examples --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Studio:
    """The studio the examples run against, and the environment it and they run in."""

    port: int
    ollama_port: int
    env: dict[str, str]


@pytest.fixture(scope="module")
def studio(llama_server_bin, smollm_model, tmp_path_factory) -> Iterator[Studio]:
    """``ggstudio serve`` as `make run` starts it, plus the Ollama port, in the test run's studio home."""
    port, ollama_port = free_port(), free_port()
    url = f"http://127.0.0.1:{port}"
    env = tagged_env()
    errors = tmp_path_factory.mktemp("docs") / "serve.err"
    argv = [CLI, "serve", "--port", str(port), "--ollama-port", str(ollama_port)]
    with errors.open("w") as err, subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=err, env=env) as serve:
        try:

            def ready() -> bool:
                assert serve.poll() is None, errors.read_text()[-3000:]
                try:
                    status = httpx.get(f"{url}/api/status", timeout=10).json()
                except httpx.TransportError:
                    return False
                return status["state"] == "ready" and status["model"] == CHAT_FILENAME.removesuffix(".gguf")

            wait_for(ready, timeout=180, interval=0.2, what="the studio and its default model")
            yield Studio(port, ollama_port, env)
        finally:
            stop_studio(serve)
    assert_no_llama_server(env)
    assert_no_children()


def pointed_at(code: str, studio: Studio) -> str:
    """The example's code with the addresses a reader's studio has replaced by this test's studio's."""
    for host in ("127.0.0.1", "localhost"):
        code = code.replace(f"{host}:{DOC_PORT}", f"{host}:{studio.port}")
        code = code.replace(f"{host}:{DOC_OLLAMA_PORT}", f"{host}:{studio.ollama_port}")
    return code


@pytest.mark.slow
@pytest.mark.shared_processes
@pytest.mark.parametrize("example", EXAMPLES, ids=[e.id for e in EXAMPLES])
def test_the_example_runs(example: Example, studio: Studio, tmp_path):
    (tmp_path / ".venv").symlink_to(sys.prefix, target_is_directory=True)  # `.venv/bin/ggstudio`, as after `make`
    code = pointed_at(example.code, studio)
    if example.language == "python":
        (tmp_path / "example.py").write_text(code)
        argv = [sys.executable, "example.py"]
    else:
        argv = ["bash", "-e", "-o", "pipefail", "-c", code]
    env = {**studio.env, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{studio.env['PATH']}"}
    with subprocess.Popen(
        argv, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    ) as run:
        try:
            out, err = run.communicate(timeout=EXAMPLE_SECONDS)
        except subprocess.TimeoutExpired:
            os.killpg(run.pid, signal.SIGKILL)  # the example's own children (curl, a CLI) too
            out, err = run.communicate()
            pytest.fail(f"{example.id} did not finish within {EXAMPLE_SECONDS} s\n{out[-2000:]}\n{err[-2000:]}")
    assert run.returncode == 0, (
        f"{example.id} exited {run.returncode}\n--- stdout\n{out[-3000:]}\n--- stderr\n{err[-3000:]}"
    )
    assert out.strip(), f"{example.id} printed nothing"
