"""`ggstudio run`, `ps`, `load`, `unload` and the exit codes, driven as real processes.

`run` is driven through a pseudo-terminal (stdlib ``pty``), as a person would:
a prompt, the streamed answer, Ctrl-C mid-answer, ``/bye``. Every test checks
that no llama-server it started outlives it (by an environment tag each
launch inherits, so other test runs on the machine do not count).
"""

from __future__ import annotations

import atexit
import functools
import json
import os
import pty
import re
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

from studio.settings import Settings
from tests.helpers import free_port, wait_for

CLI = str(Path(sys.executable).parent / "ggstudio")
TAG = "GGSTUDIO_TEST_TAG"

SMOL = "SmolLM2-135M-Instruct.Q4_1"
GEMMA = "gemma-3-270m-Q4_K_M"


#: What the test run's studio home borrows from the real one: what takes minutes to make (the pinned build,
#: the models, the zoo) and the probe cache. Not the discovery file, lock, logs or history.
BORROWED = ("llama.cpp", "models", "zoo", "cache")


@functools.cache
def run_home() -> Path:
    """The studio home of this test run's CLI launches: a folder of its own with the real home's build and models
    linked in.

    Not the real home itself: a studio someone runs there (a benchmark, a GUI) is found through its discovery file
    by ``run``, ``ps`` and ``serve``, which would then talk to it, or refuse to start, instead of the test's own.
    """
    real = Settings.from_env().home
    home = Path(tempfile.mkdtemp(prefix="ggstudio-test-home-"))
    atexit.register(shutil.rmtree, home, ignore_errors=True)  # unlinks the links; never follows them
    for name in BORROWED:
        (real / name).mkdir(parents=True, exist_ok=True)
        (home / name).symlink_to(real / name, target_is_directory=True)
    return home


def tagged_env(**extra: str) -> dict[str, str]:
    """The environment for one CLI launch, tagged so its llama-servers can be found even once orphaned, in the
    test run's own studio home unless ``extra`` names one."""
    env = {k: v for k, v in os.environ.items() if k not in ("GGUF_STUDIO_API_TOKEN", "GGUF_STUDIO_LOG_JSON")}
    home = {} if "GGUF_STUDIO_HOME" in extra else {"GGUF_STUDIO_HOME": str(run_home())}
    return {**env, TAG: uuid.uuid4().hex, "NO_COLOR": "1", **home, **extra}


def llama_servers(env: dict[str, str]) -> list[psutil.Process]:
    """Live llama-server processes started under ``env``'s tag."""
    out = []
    for p in psutil.process_iter(["name", "status"]):
        if p.info["name"] != "llama-server" or p.info["status"] == psutil.STATUS_ZOMBIE:
            continue
        try:
            if p.environ().get(TAG) == env[TAG]:
                out.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return out


def assert_no_llama_server(env: dict[str, str]) -> None:
    wait_for(lambda: not llama_servers(env), timeout=10, what="the run's llama-server to exit")


def cli(*args: str, env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [CLI, *args], capture_output=True, text=True, timeout=timeout, env=env if env is not None else tagged_env()
    )


def assert_one_error_line(out: subprocess.CompletedProcess[str], code: int, start: str) -> None:
    assert out.returncode == code, (out.returncode, out.stderr)
    assert out.stderr.startswith(start), out.stderr
    assert "Traceback" not in out.stderr and out.stderr.count("\n") == 1, out.stderr


# --- run --once ----------------------------------------------------------------------------------


@pytest.mark.parametrize("by", ["name", "path"])
def test_run_once_prints_an_answer_and_exits_0(smollm_model, llama_server_bin, by):
    """An instruct model: a base model's chat may end at once on its borrowed template's turn marker."""
    env = tagged_env()
    model = smollm_model.name.removesuffix(".gguf") if by == "name" else str(smollm_model)
    out = cli("run", model, "--ctx", "1024", "--max-tokens", "8", "--once", "The capital of France is", env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip(), "no answer on stdout"
    assert "Traceback" not in out.stderr
    assert_no_llama_server(env)


def test_run_missing_model_file_exits_3(tmp_path, llama_server_bin):
    out = cli("run", str(tmp_path / "absent.gguf"), "--once", "hi")
    assert_one_error_line(out, 3, "error: model ")
    assert "absent.gguf" in out.stderr


def test_run_non_gguf_model_exits_5(tmp_path, llama_server_bin):
    bogus = tmp_path / "bogus.gguf"
    bogus.write_text("not a model\n")
    env = tagged_env()
    out = cli("run", str(bogus), "--once", "hi", env=env)
    assert_one_error_line(out, 5, f"error: cannot load {bogus}")
    assert "not a GGUF file" in out.stderr
    assert_no_llama_server(env)


def test_run_a_plan_that_does_not_fit_exits_4_before_any_load(gemma_model, llama_server_bin):
    env = tagged_env()
    out = cli("run", str(gemma_model), "--ctx", "100000000", "--once", "hi", env=env)
    assert out.returncode == 4, out.stderr
    assert out.stderr.startswith("error: ") and "does not fit" in out.stderr and "hint: " in out.stderr
    assert "Traceback" not in out.stderr
    assert_no_llama_server(env)


def test_debug_shows_the_traceback(tmp_path, llama_server_bin):
    out = cli("--debug", "run", str(tmp_path / "absent.gguf"), "--once", "hi")
    assert out.returncode == 3
    assert "Traceback" in out.stderr and "ModelNotFoundError" in out.stderr


@pytest.mark.parametrize("argv", [["serve", "--help"], ["plan", "--help"]])
def test_a_subcommands_help_loads_no_logging(argv):
    """``serve --help`` took ~0.7 s: the root callback set up structlog and rich before the subcommand's help."""
    probe = (
        "import atexit, sys\n"
        "atexit.register(lambda: print('LOADED' if 'structlog' in sys.modules else 'LEAN', file=sys.stderr))\n"
        f"sys.argv = ['ggstudio', *{argv!r}]\n"
        "from studio.cli.app import main\n"
        "main()\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "Usage: ggstudio" in out.stdout
    assert out.stderr.strip().splitlines()[-1] == "LEAN"


# --- help ------------------------------------------------------------------------------------------


def _commands_listed(help_text: str) -> dict[str, str]:
    """The "Commands:" section of a help text: each command's line, its wrapped continuation lines joined."""
    listed: dict[str, str] = {}
    section = help_text.split("\nCommands:\n", 1)[1]
    for line in section.splitlines():
        if not line.strip():
            break
        if line.startswith("  ") and not line.startswith("   "):  # a new command: "  name  Its help."
            name, _, text = line.strip().partition(" ")
            listed[name] = text.strip()
        else:  # click wraps after a hyphen too
            listed[name] += ("" if listed[name].endswith("-") else " ") + line.strip()
    return listed


@pytest.mark.parametrize("argv", [[], ["-h"], ["--help"]], ids=["bare", "-h", "--help"])
def test_bare_ggstudio_and_dash_h_print_the_help_and_exit_0(argv, tmp_path):
    """``ggstudio`` alone exited 2 and ``ggstudio -h`` was "No such option"; each rendered anew (a fresh home)."""
    out = cli(*argv, env=tagged_env(GGUF_STUDIO_HOME=str(tmp_path), COLUMNS="80"))
    assert out.returncode == 0 and out.stderr == "", out.stderr
    assert out.stdout.startswith("Usage: ggstudio [OPTIONS] COMMAND") and "\nCommands:\n" in out.stdout
    assert "-h, --help" in out.stdout


def _commands() -> dict:
    """Every command of the CLI by name, as click holds them."""
    from typer.main import get_command

    from studio.cli.app import app

    return get_command(app).commands


def test_every_subcommand_takes_dash_h():
    names = sorted(_commands())
    assert len(names) > 10
    for name in names:
        out = cli(name, "-h")
        assert out.returncode == 0, (name, out.stderr)
        assert out.stdout.startswith(f"Usage: ggstudio {name} "), out.stdout


@pytest.mark.parametrize("columns", [80, 50])
def test_help_lines_are_not_cut_mid_phrase(columns, tmp_path):
    """``--help`` listed "Build the pinned llama-server into the studio home (a...": click cut each line at the width.

    Each command is listed by its first sentence, whole (wrapped on a narrow terminal, never cut); at 80
    columns each fits its line.
    """
    commands = _commands()
    out = cli("--help", env=tagged_env(GGUF_STUDIO_HOME=str(tmp_path), COLUMNS=str(columns)))
    assert out.returncode == 0, out.stderr
    listed = _commands_listed(out.stdout)
    assert sorted(listed) == sorted(name for name, c in commands.items() if not c.hidden)
    for name, text in listed.items():
        first_sentence = " ".join(commands[name].help.split("\n\n", 1)[0].split()).split(". ", 1)[0].rstrip(".")
        assert not text.endswith("..."), (name, text)
        assert text.endswith(".") and text == first_sentence + ".", (name, text)
        if columns == 80:
            assert len(f"  {max(listed, key=len):13}{text}") <= 80, (name, text)


def test_usage_errors_exit_2():
    assert cli("run").returncode == 2
    assert cli("run", "m", "--serve-only", "--once", "hi").returncode == 2


# --- run, interactive, through a pseudo-terminal -----------------------------------------------


class Terminal:
    """A child process on a pseudo-terminal it has as its controlling terminal (so ^C is SIGINT)."""

    def __init__(self, argv: list[str], env: dict[str, str]) -> None:
        self.pid, self.fd = pty.fork()
        if self.pid == 0:  # the child: nothing but exec
            try:
                os.execve(argv[0], argv, env)
            finally:
                os._exit(127)
        self.output = b""
        self.status: int | None = None

    @property
    def text(self) -> str:
        return self.output.decode(errors="replace")

    def _read(self, timeout: float) -> bool:
        """Read what is there (waiting up to ``timeout``); False once the terminal is closed."""
        ready, _, _ = select.select([self.fd], [], [], timeout)
        if not ready:
            return True
        try:
            chunk = os.read(self.fd, 4096)
        except OSError:  # EIO: the child side is closed
            return False
        self.output += chunk
        return bool(chunk)

    def expect(self, pattern: str, *, since: int = 0, timeout: float) -> re.Match[str]:
        """Wait until ``pattern`` appears in the output after offset ``since``; return the match."""
        deadline = time.monotonic() + timeout
        while True:
            found = re.compile(pattern).search(self.text, since)
            if found:
                return found
            left = deadline - time.monotonic()
            if left <= 0 or not self._read(min(left, 0.2)):
                if found := re.compile(pattern).search(self.text, since):
                    return found
                raise AssertionError(f"{pattern!r} not seen within {timeout} s; output:\n{self.text[-3000:]}")

    def send(self, data: str) -> None:
        os.write(self.fd, data.encode())

    def wait_reading(self, timeout: float) -> None:
        """Wait until the child's main thread blocks reading its terminal (syscall 0, ``read``, on fd 0).

        The prompt is written a moment before ``input()`` blocks in ``read``, and CPython looks at a signal
        there only when the read is interrupted: one that lands in between takes effect at the next key. A
        person cannot hit that window; a test sending ^C as soon as it sees the prompt did, under load, and
        waited out its minute.
        """
        wait_for(
            lambda: Path(f"/proc/{self.pid}/syscall").read_text().split()[:2] == ["0", "0x0"],
            timeout=timeout,
            what="the chat to wait at its prompt",
        )

    def wait(self, timeout: float) -> int:
        """Drain the output until the child exits; return its exit code."""
        deadline = time.monotonic() + timeout
        while self.status is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.status = os.waitstatus_to_exitcode(status)
                break
            if time.monotonic() > deadline:
                raise AssertionError(f"the chat did not exit within {timeout} s; output:\n{self.text[-3000:]}")
            self._read(0.1)
        return self.status

    def close(self) -> None:
        if self.status is None:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.wait(10)
        os.close(self.fd)


def test_run_interactive_chat_streams_stops_on_ctrl_c_and_ends_on_bye(smollm_model, llama_server_bin):
    env = tagged_env(TERM="dumb")
    term = Terminal([CLI, "run", str(smollm_model), "--ctx", "2048", "--max-tokens", "600"], env)
    try:
        term.expect(r">>> ", timeout=120)
        [server] = wait_for(lambda: llama_servers(env), timeout=10, what="the run's llama-server")
        start = len(term.output)
        term.send("Write a very long story about a dragon, with many chapters.\r")
        echoed = term.expect(r"with many chapters\.\r?\n", since=start, timeout=10).end()
        # Streamed text arrives bit by bit, long before the 600 tokens are done.
        term.expect(r"\S[\s\S]{8,}", since=echoed, timeout=60)
        assert ">>> " not in term.text[echoed:], "the answer ended before Ctrl-C could interrupt it"
        term.send("\x03")
        stopped = term.expect(r"\[stopped\]", since=echoed, timeout=15).end()
        term.expect(r">>> ", since=stopped, timeout=15)
        # The generation really stopped: llama-server goes idle instead of decoding the rest of 600 tokens.
        server.cpu_percent()
        time.sleep(0.5)
        assert wait_for(lambda: server.cpu_percent(interval=1.0) < 30, timeout=10, what="llama-server to go idle")
        # The chat goes on after an interrupted answer.
        again = len(term.output)
        term.send("/bye\r")
        assert term.wait(timeout=60) == 0, term.text[again:]
        assert "Traceback" not in term.text
    finally:
        term.close()
    assert_no_llama_server(env)


@pytest.mark.parametrize(("how", "code"), [("ctrl-c", 0), ("sigterm", 128 + 15), ("sigkill", -9)])
def test_run_leaves_no_llama_server_however_it_ends(gemma_model, llama_server_bin, tmp_path, how, code):
    # A home of its own: a SIGKILLed run leaves its child's record behind for the next studio to reap.
    env = tagged_env(TERM="dumb", GGUF_STUDIO_HOME=str(tmp_path / "home"), LLAMA_SERVER_PATH=str(llama_server_bin))
    term = Terminal([CLI, "run", str(gemma_model), "--ctx", "1024"], env)
    try:
        term.expect(r">>> ", timeout=120)
        assert llama_servers(env)
        term.wait_reading(timeout=30)
        if how == "ctrl-c":  # at the prompt: the chat ends
            term.send("\x03")
        else:
            os.kill(term.pid, signal.SIGTERM if how == "sigterm" else signal.SIGKILL)
        assert term.wait(timeout=60) == code, term.text
        assert "Traceback" not in term.text
    finally:
        term.close()
    assert_no_llama_server(env)  # after SIGKILL: the child's parent-death signal


def test_run_llama_server_failure_exits_5_with_its_reason(gemma_model, llama_server_bin):
    """A context whose KV cache cannot be allocated at all: llama-server itself fails the load."""
    if Path("/proc/sys/vm/overcommit_memory").read_text().strip() == "1":
        pytest.skip("with overcommit always on, the allocation would succeed and the OOM killer decide")
    memory = psutil.virtual_memory().total + psutil.swap_memory().total
    ctx = (2 * memory // 3072 // 256 + 1) * 256  # Gemma's full-attention KV: 3 KiB per token
    env = tagged_env()
    out = cli("run", str(gemma_model), "--ctx", str(ctx), "--force", "--once", "hi", env=env)
    assert_one_error_line(out, 5, "error: llama-server exited with code")
    assert "failed to allocate" in out.stderr and "lower the context" in out.stderr
    assert_no_llama_server(env)


# --- ps, load, unload against a running serve --------------------------------------------------


def test_ps_load_unload_against_a_running_serve(gemma_model, llama_server_bin):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = tagged_env()
    with subprocess.Popen(
        [CLI, "serve", "--port", str(port), "--ctx", "2048"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    ) as serve:
        try:
            line = serve.stdout.readline()
            assert url in line, line + (serve.stderr.read() if serve.poll() is not None else "")

            def ps() -> dict:
                out = cli("ps", "--url", url, "--json", env=env)
                assert out.returncode == 0, out.stderr
                return json.loads(out.stdout)

            status = wait_for(lambda: (s := ps())["state"] == "ready" and s, timeout=120, what="the start-up load")
            assert status["model"] == SMOL and status["effective_context"] == 2048  # the chat default
            text = cli("ps", "--url", url, env=env)
            assert text.returncode == 0 and SMOL in text.stdout and "2,048" in text.stdout

            skip = cli("unload", "another-model", "--url", url, env=env)
            assert skip.returncode == 0 and "not resident" in skip.stderr and "nothing to do" in skip.stderr
            assert ps()["state"] == "ready"

            out = cli("load", str(gemma_model), "--ctx", "1024", "--url", url, "--json", env=env)
            assert out.returncode == 0, out.stderr
            loaded = json.loads(out.stdout)
            assert loaded["state"] == "ready" and loaded["effective_context"] == 1024 and loaded["model"] == GEMMA
            both = ps()
            assert {m["model"]: m["state"] for m in both["models"]} == {SMOL: "ready", GEMMA: "ready"}
            assert both["pid"] == loaded["pid"]  # the explicitly loaded model is the default
            text = cli("ps", "--url", url, env=env).stdout
            assert SMOL in text and f"{GEMMA}*" in text

            missing = cli("load", "no-such-model", "--url", url, env=env)
            assert_one_error_line(missing, 3, "error: model 'no-such-model' not found")
            assert len(ps()["models"]) == 2  # a failed load disturbs nothing resident

            out = cli("unload", SMOL, "--url", url, env=env)
            assert out.returncode == 0 and out.stdout.strip() == f"unloaded {SMOL}", out.stderr
            assert [m["model"] for m in ps()["models"]] == [GEMMA]

            out = cli("unload", "--url", url, env=env)
            assert out.returncode == 0 and out.stdout.strip() == "unloaded every model", out.stderr
            assert ps()["state"] == "unloaded"
            assert cli("ps", "--url", url, env=env).stdout.strip() == "no model loaded"

            serve.send_signal(signal.SIGINT)
            assert serve.wait(timeout=30) == 0
        finally:
            if serve.poll() is None:
                serve.kill()
    assert_no_llama_server(env)


@dataclass(frozen=True)
class Served:
    """What one ``serve --model SMOL --ctx 2048`` showed: its llama-server's argv, the launch files it named
    while it ran, its console log and the studio home's JSON log."""

    env: dict[str, str]
    argv: list[str]
    files_there: dict[str, bool]
    console: list[str]
    records: list[dict]
    planned_there: dict  # ``plan --url --json`` of the same model, asked of the running studio


@pytest.fixture(scope="module")
def served_smol(smollm_model, llama_server_bin, tmp_path_factory) -> Served:
    """SmolLM2 served, loaded, then stopped: a real load's argv and its log, shared by the tests that read them."""
    env = tagged_env(GGUF_STUDIO_HOME=str(tmp_path_factory.mktemp("home")))
    for name in BORROWED:  # the build and the models, not the shared test home's log
        (Path(env["GGUF_STUDIO_HOME"]) / name).symlink_to(run_home() / name, target_is_directory=True)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = tmp_path_factory.mktemp("serve") / "stderr.txt"
    with (
        log.open("w") as err,
        subprocess.Popen(
            [CLI, "serve", "--model", SMOL, "--ctx", "2048", "--port", str(port)],
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
            env=env,
        ) as serve,
    ):
        try:
            assert url in serve.stdout.readline(), log.read_text()

            def ps() -> dict:
                out = cli("ps", "--url", url, "--json", env=env)
                assert out.returncode == 0, out.stderr
                return json.loads(out.stdout)

            status = wait_for(lambda: (s := ps())["state"] == "ready" and s, timeout=120, what="the start-up load")
            argv = psutil.Process(status["pid"]).cmdline()
            files = {
                flag: Path(argv[argv.index(flag) + 1]).is_file() for flag in ("--chat-template-file", "--api-key-file")
            }
            there = cli("plan", SMOL, "--ctx", "2048", "--url", url, "--json", env=env)
            assert there.returncode == 0, there.stderr
            serve.send_signal(signal.SIGINT)
            assert serve.wait(timeout=30) == 0
        finally:
            if serve.poll() is None:
                serve.kill()
    assert_no_llama_server(env)
    studio_log = Path(env["GGUF_STUDIO_HOME"]) / "studio.log"
    records = [json.loads(line) for line in studio_log.read_text().splitlines()]
    return Served(env, argv, files, log.read_text().splitlines(), records, json.loads(there.stdout))


def test_state_change_log_lines_carry_no_none(served_smol):
    """The log's state-change lines read ``cause=None error=None``: a field with no value is left out."""
    changes = [line for line in served_smol.console if "llama-server state" in line or "resident model" in line]
    assert len(changes) >= 4, served_smol.console  # starting, ready, stopping, idle: they carried cause=None
    assert [line for line in served_smol.console if "=None" in line] == []
    assert [r for r in served_smol.records if None in r.values()] == []  # the same lines as JSON, in studio.log


def _launch_shape(argv: list[str]) -> list[str]:
    """``argv`` with what each launch makes anew as ``ggstudio plan`` shows it: ``<port>``, ``<launch>``."""
    shown = [re.sub(r"/ggstudio-launch-[^/]+/", "/<launch>/", a) for a in argv]
    shown[shown.index("--port") + 1] = "<port>"
    return shown


def test_plan_prints_the_argv_a_load_runs(served_smol):
    """``plan``'s "exact command" left out the chat template file and the slot folder a load passes, and showed
    a key file that did not exist: it is the real llama-server's argv, but for the placeholders it names."""
    out = cli("plan", SMOL, "--ctx", "2048", "--json", env=served_smol.env)
    assert out.returncode == 0, out.stderr
    planned = json.loads(out.stdout)
    assert planned["argv"] == _launch_shape(served_smol.argv)
    assert served_smol.files_there == {"--chat-template-file": True, "--api-key-file": True}
    assert "--slot-save-path" in planned["argv"]
    key_file = planned["argv"][planned["argv"].index("--api-key-file") + 1]
    assert "/<launch>/" in key_file and set(planned["argv_placeholders"]) == {"<port>", "<launch>"}
    text = cli("plan", SMOL, "--ctx", "2048", env=served_smol.env).stdout
    assert "\n  <launch>: the private folder each launch makes for its API key (a secret)" in text
    assert served_smol.planned_there["argv"] == planned["argv"]  # a running studio's plan shows it too


def test_ps_without_a_studio_is_one_line_and_exit_1():
    port = free_port()
    out = cli("ps", "--url", f"http://127.0.0.1:{port}")
    assert_one_error_line(out, 1, f"error: no GGUF Studio is running at http://127.0.0.1:{port}")
    out = cli("unload", env=tagged_env(GGUF_STUDIO_PORT=str(port)))
    assert_one_error_line(out, 1, f"error: no GGUF Studio is running at http://127.0.0.1:{port}")


def test_plan_without_a_studio_honours_the_memory_budget(gemma_model, llama_server_bin):
    """On b5a9904 ``GGUF_STUDIO_MEMORY_BUDGET=200MiB ggstudio plan gemma`` said it fits in 20 GiB: the plan
    without a running studio skipped the budget a load applies. It plans as a load does now."""
    env = tagged_env(GGUF_STUDIO_MEMORY_BUDGET="200MiB")
    out = cli("plan", GEMMA, "--ctx", "1024", "--json", env=env)
    assert out.returncode == 0, out.stderr
    planned = json.loads(out.stdout)
    assert planned["fits"] is False and any("over the budget" in w for w in planned["warnings"]), planned["warnings"]
    roomy = json.loads(cli("plan", GEMMA, "--ctx", "1024", "--json", env=tagged_env()).stdout)
    assert roomy["fits"] is True
