#!/usr/bin/env python3
"""llama.cpp's own server tests, against the pinned llama-server directly and through the studio.

The pinned source carries llama-server's test suite (``tools/server/tests``, pytest). Its
``utils.ServerProcess`` starts the binary ``LLAMA_SERVER_BIN_PATH`` names with llama-server's
flags; this script runs the chosen modules twice on a copy of the suite:

- **direct**: the pinned llama-server itself;
- **studio**: an adapter in its place (this script with ``--as-llama-server``), which maps the
  suite's flags to a ``ggstudio serve`` (``--port``, ``--host``, the model, ``--ctx-size`` and
  ``--parallel`` and ``--chat-template`` as the model's load defaults, ``--alias a,b,c`` as its name (the
  first in sorted order, as llama-server's) and ``[aliases]``, ``--tags`` as its ``tags``,
  ``--no-jinja`` as ``jinja = false``, ``--api-key`` as the API token, ``--cors-origins`` as
  ``allowed_origins``, and ``default_for_unknown`` on, as a one-model llama-server answers any
  ``model``) and passes every other flag on as the model's
  ``extra_args``; the flags the studio manages itself (``launcher.extra_args.MANAGED_FLAGS``:
  ``--threads``, ``--jinja``, ``--context-shift``, ...) are left out.

The suite downloads its models from the Hub (``conftest.py``: ``ServerPreset.load_all``), which
cannot work offline; the copy's ``conftest.py`` loads nothing and gives every preset the same local
model, SmolLM2-135M-Instruct (``studio.library.default_model``), in both runs. So tests that expect
another model's words fail in both and are not counted: what is compared is, of the tests that
pass direct, how many pass through the studio. The suite's client side (pytest, requests, openai,
...) gets its own venv under the studio home, from the suite's ``requirements.txt``.

Prints per module the direct passes and how many of those pass through the studio, then every test
that passes direct but not through the studio, with its reason (the first line of its failure).
Several minutes on two cores; a script, not a test.

    .venv/bin/python scripts/upstream_suite.py [--modules basic,tokenize,...] [-k EXPR] [--runs direct,studio]

``--runs studio`` makes only that run and reports against the direct run's results kept from before
(``<home>/upstream-suite/results``); two shells can make the two runs at once.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import xml.etree.ElementTree as ET
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

#: The modules the issue's target counts (the router's needs a models dir of presets; left out).
MODULES = (
    "basic",
    "chat_completion",
    "completion",
    "compat_anthropic",
    "compat_oai_responses",
    "tokenize",
    "security",
    "stream",
    "ctx_shift",
    "template",
    "slot_save",
    "metrics",
    "embedding",
)
#: The security module's Origin/CORS tests: the studio refuses a foreign page's request on purpose (README).
CORS = "security (CORS)"
#: Seconds one test may take before it counts as failed (pytest-timeout).
TEST_TIMEOUT = 180
#: The suite's client side, besides its requirements.txt.
EXTRA_CLIENT_PACKAGES = ("pytest-timeout",)

#: The copy's conftest: the original's fixtures, no downloads, every preset on the local model.
CONFTEST = '''
import os
import pytest
from utils import *

LOCAL_MODEL = os.environ["UPSTREAM_SUITE_MODEL"]
_start = ServerProcess.start


def _start_local(self, *args, **kwargs):
    """Every preset's Hub model is the local one (the suite's downloads cannot work offline)."""
    if self.model_hf_repo or self.model_hf_file or self.model_url or not self.model_file:
        self.model_file = LOCAL_MODEL
    self.model_hf_repo = self.model_hf_file = self.model_url = None
    self.mmproj_url = None
    return _start(self, *args, **kwargs)


ServerProcess.start = _start_local


@pytest.fixture(autouse=True)
def stop_server_after_each_test():
    yield
    for server in set(server_instances):
        server.stop()
'''


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--as-llama-server":
        as_llama_server(sys.argv[2:])
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--modules", default=",".join(MODULES), help="comma-separated, without test_")
    parser.add_argument("-k", default=None, help="pytest -k expression, for both runs")
    parser.add_argument("--runs", default="direct,studio", help="which runs to make now: direct, studio or both")
    parser.add_argument("--out", type=Path, default=None, help="where each run's junit file and log go")
    args = parser.parse_args()

    from launcher.build import ensure_built
    from studio.library.default_model import ensure_default_model
    from studio.settings import Settings

    settings = Settings.from_env()
    build = ensure_built(settings.home)
    suite_src = build.layout.source_dir / "tools" / "server" / "tests"
    model = ensure_default_model(settings.models_dir)
    client = _client_venv(settings.home / "upstream-suite" / "venv", suite_src / "requirements.txt")
    out = args.out or settings.home / "upstream-suite" / "results"
    out.mkdir(parents=True, exist_ok=True)
    modules = [m.strip() for m in args.modules.split(",") if m.strip()]
    for run in (r.strip() for r in args.runs.split(",") if r.strip()):
        work = Path(tempfile.mkdtemp(prefix=f"upstream-suite-{run}-"))
        try:
            suite = work / "tests"
            shutil.copytree(suite_src, suite)
            (suite / "conftest.py").write_text(CONFTEST)
            adapter = work / "llama-server-via-studio"
            script = Path(__file__).resolve()
            adapter.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{script}" --as-llama-server "$@"\n')
            adapter.chmod(0o755)
            env = {
                **os.environ,
                "UPSTREAM_SUITE_MODEL": str(model),
                "UPSTREAM_SUITE_LLAMA_SERVER": str(build.llama_server),
                "UPSTREAM_SUITE_HOME": str(work / "studio-home"),
                "PORT": str(_free_port()),
                "LLAMA_SERVER_BIN_PATH": str(build.llama_server if run == "direct" else adapter),
            }
            _run(client, suite, modules, args.k, env, out, run)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    _report(modules, _outcomes(out / "direct.xml"), _outcomes(out / "studio.xml"))
    print(f"junit files and logs: {out}")


def _client_venv(venv: Path, requirements: Path) -> Path:
    """The python of a venv with the suite's client packages, made on first use."""
    python = venv / "bin" / "python"
    marker = venv / ".installed"
    if not marker.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run(
            [str(python), "-m", "pip", "install", "-q", "-r", str(requirements), *EXTRA_CLIENT_PACKAGES], check=True
        )
        marker.touch()
    return python


def _free_port() -> int:
    from launcher.process import free_port

    return free_port()


#: (module, test name) -> None for a pass, else the reason it failed or was skipped.
Results = dict[tuple[str, str], str | None]


def _run(
    python: Path, suite: Path, modules: list[str], k: str | None, env: dict[str, str], out: Path, name: str
) -> None:
    """Run the modules' tests once against whatever ``LLAMA_SERVER_BIN_PATH`` names, into ``out/<name>.xml``."""
    junit = out / f"{name}.xml"
    files = [f"unit/test_{m}.py" for m in modules]
    argv = [str(python), "-m", "pytest", *files, "-q", "-p", "no:cacheprovider", f"--timeout={TEST_TIMEOUT}"]
    argv += [f"--junitxml={junit}", "-o", "junit_family=xunit1"]
    if k:
        argv += ["-k", k]
    print(f"running {len(files)} modules {name} ...", flush=True)
    with open(out / f"{name}.log", "w") as log:
        subprocess.run(argv, cwd=suite, env=env, stdout=log, stderr=subprocess.STDOUT, check=False)


def _outcomes(junit: Path) -> Results:
    results: Results = {}
    if not junit.exists():
        return results
    for case in ET.parse(junit).getroot().iter("testcase"):
        module = (case.get("classname") or "").rsplit(".", 1)[-1].removeprefix("test_")
        if module == "security" and (case.get("name") or "").startswith("test_cors"):
            module = CORS  # counted apart (module docstring)
        problem = next((c for c in case if c.tag in ("failure", "error", "skipped")), None)
        reason = None
        if problem is not None:
            text = (problem.get("message") or problem.text or problem.tag).strip()
            reason = f"{problem.tag}: {text.splitlines()[0][:300] if text else ''}"
        results[(module, case.get("name") or "?")] = reason
    return results


def _report(modules: list[str], direct: Results, studio: Results) -> None:
    """The table (the CORS tests in a row of their own, outside the total) and the tests lost on the way."""
    rows = list(modules) + ([CORS] if "security" in modules else [])
    print(f"\n{'module':<24}{'direct':>8}{'studio':>8}{'share':>8}")
    total_direct = total_studio = 0
    lost: list[tuple[str, str, str]] = []
    for module in rows:
        passed = [test for (m, test), why in direct.items() if m == module and why is None]
        through = [test for test in passed if (module, test) in studio and studio[(module, test)] is None]
        if module != CORS:
            total_direct += len(passed)
            total_studio += len(through)
        share = f"{100 * len(through) / len(passed):.0f} %" if passed else "-"
        print(f"{module:<24}{len(passed):>8}{len(through):>8}{share:>8}")
        lost += [(module, t, studio.get((module, t)) or "not run") for t in passed if t not in through]
    share = f"{100 * total_studio / total_direct:.1f} %" if total_direct else "-"
    print(f"{'all but CORS':<24}{total_direct:>8}{total_studio:>8}{share:>8}")
    if lost:
        print("\npass direct, not through the studio:")
        for module, test, why in lost:
            print(f"  {module}::{test}\n{textwrap.indent(why, '      ')}")


# -- the adapter: llama-server's flags -> ggstudio serve ------------------------------------------------

#: Flags that take a value (the suite's and a few more); every other flag is a switch.
_VALUED = {
    "--port", "--host", "--model", "-m", "--alias", "-a", "--ctx-size", "-c", "--parallel", "-np",
    "--api-key", "--cors-origins", "--temp", "--seed", "--batch-size", "-b", "--ubatch-size", "-ub",
    "--threads", "-t", "--n-gpu-layers", "-ngl", "--pooling", "--tags", "-ctk", "-ctv", "-fa",
    "--n-predict", "-n", "--slot-save-path", "--grp-attn-n", "--grp-attn-w", "--lora", "--spec-type",
    "--spec-draft-n-max", "--spec-draft-n-min", "--spec-synth-len", "--spec-synth-rates",
    "--reasoning-format", "--reasoning", "--chat-template", "--chat-template-file", "--media-path",
    "--sleep-idle-seconds", "--cache-ram", "--tools", "--tools-runtime", "--mcp-servers-config",
    "--mcp-servers-json", "--model-draft", "--hf-repo", "--hf-file", "--model-url", "--mmproj-url",
    "--models-dir", "--models-max", "--models-preset",
}  # fmt: skip
#: Switches that only matter to the suite's own process and are dropped.
_DROPPED = {"--offline", "--no-ui"}


def as_llama_server(argv: list[str]) -> None:
    """Start ``ggstudio serve`` the way the suite's llama-server flags ask; replaces this process."""
    from launcher.extra_args import MANAGED_FLAGS

    managed = {flag for flags in MANAGED_FLAGS for flag in flags}
    options: dict[str, str] = {}
    extra: list[str] = []
    dropped: list[str] = []
    i = 0
    while i < len(argv):
        flag = argv[i]
        value = argv[i + 1] if flag in _VALUED and i + 1 < len(argv) else None
        i += 2 if value is not None else 1
        if flag in ("--port", "--host", "--model", "-m", "--alias", "-a", "--ctx-size", "-c", "--parallel", "-np"):
            options[flag.lstrip("-")] = value or ""
        elif flag in ("--api-key", "--cors-origins", "--chat-template", "--tags"):
            options[flag.lstrip("-")] = value or ""
        elif flag == "--no-jinja":  # the suite's default for a server that does not ask for Jinja
            options["no-jinja"] = ""
        elif flag in managed or flag in _DROPPED:
            dropped += [flag] if value is None else [flag, value]
        else:
            extra += [flag] if value is None else [flag, value]
    if dropped:
        print(f"adapter: left out (the studio manages them): {' '.join(dropped)}", file=sys.stderr, flush=True)
    home = Path(os.environ["UPSTREAM_SUITE_HOME"])
    models = home / "models"
    shutil.rmtree(models, ignore_errors=True)
    models.mkdir(parents=True)
    source = Path(options.get("model") or options.get("m") or os.environ["UPSTREAM_SUITE_MODEL"]).resolve()
    # llama-server keeps --alias a,b,c in a std::set and is named by the first: the model's name, the rest aliases
    names = sorted({a.strip() for a in (options.get("alias") or options.get("a") or "").split(",") if a.strip()})
    name = names[0] if names else source.name.removesuffix(".gguf")
    (models / f"{name}.gguf").symlink_to(source)
    defaults: dict[str, object] = {"extra_args": extra, "spec": "off"}
    if options.get("tags"):
        defaults["tags"] = [t.strip() for t in options["tags"].split(",") if t.strip()]
    if options.get("ctx-size") or options.get("c"):
        defaults["n_ctx"] = int(options.get("ctx-size") or options["c"])
    if options.get("chat-template"):  # a built-in's name or Jinja text, as the load option takes both
        defaults["chat_template"] = options["chat-template"]
    if "no-jinja" in options:
        defaults["jinja"] = False
    if options.get("parallel") or options.get("np"):
        defaults["n_parallel"] = int(options.get("parallel") or options["np"])
    config = home / "config.toml"
    # a one-model llama-server answers whatever `model` a request names ("gpt-3.5-turbo", "test"): the switch
    # that makes the studio do the same
    top = {"model_dirs": [str(models)], "default_for_unknown": True}
    aliases = "".join(f"{_quote(alias)} = {_quote(name)}\n" for alias in names[1:])
    config.write_text(
        _toml(top) + (f"\n[aliases]\n{aliases}" if aliases else "") + f"\n[models.{_quote(name)}]\n" + _toml(defaults)
    )
    env = {
        **os.environ,
        "GGUF_STUDIO_HOME": str(home),
        "GGUF_STUDIO_CONFIG": str(config),
        "LLAMA_SERVER_PATH": os.environ["UPSTREAM_SUITE_LLAMA_SERVER"],
    }
    env.pop("GGUF_STUDIO_API_TOKEN", None)
    if options.get("api-key"):
        env["GGUF_STUDIO_API_TOKEN"] = options["api-key"]
    if options.get("cors-origins"):
        env["GGUF_STUDIO_ORIGINS"] = options["cors-origins"]
    serve = [
        sys.executable,
        "-c",
        "from studio.cli.app import main; main()",
        "serve",
        "--model",
        name,
        "--port",
        options.get("port", "8080"),
    ]
    serve += ["--host", options.get("host", "127.0.0.1")]
    os.chdir(Path(__file__).resolve().parents[1])
    os.execve(sys.executable, serve, env)


def _quote(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _toml(values: dict[str, object]) -> str:
    """``values`` as TOML lines (strings, ints, booleans and lists of strings are all the adapter writes)."""
    lines = []
    for key, value in values.items():
        if isinstance(value, bool):
            lines.append(f"{key} = {str(value).lower()}")
        elif isinstance(value, list):
            lines.append(f"{key} = [{', '.join(_quote(str(v)) for v in value)}]")
        elif isinstance(value, str):
            lines.append(f"{key} = {_quote(value)}")
        else:
            lines.append(f"{key} = {value}")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
