"""`make run`'s first chat: the default model answers a plain question, it does not echo it.

`make run` runs ``ggstudio serve`` with no model named, which preloads the chat default
(SmolLM2-135M-Instruct) with its built-in settings. Under the base Gemma that used to be
the default, "What is the capital of France?" came back as "What is the capital of
Canada?<|im_end|>..."; under SmolLM2's own template (with the system prompt it adds) as
"L'Étoile, la Marseillaise, la femme au martyre, ...".
"""

from __future__ import annotations

import os
import subprocess
import threading
import time
from pathlib import Path

import httpx
import psutil
import pytest
from openai import OpenAI

from studio.library.catalog import CatalogEntry
from studio.library.default_model import CHAT_FILENAME, CHATML, builtin_model_defaults
from studio.residency.requests import LoadRequest, load_settings
from studio.settings import ModelDefaults
from tests.helpers import free_port, stop_studio, wait_for
from tests.test_cli import CLI, assert_no_llama_server, tagged_env

ROOT = Path(__file__).resolve().parent.parent
QUESTION = "What is the capital of France?"
SMOL = CHAT_FILENAME.removesuffix(".gguf")


def test_the_chat_default_is_served_with_plain_chatml_unless_the_config_or_the_request_says_otherwise():
    entry = CatalogEntry(SMOL, Path("/models") / CHAT_FILENAME)
    defaults = builtin_model_defaults({SMOL: ModelDefaults(n_ctx=1024), "other": ModelDefaults(n_ctx=512)})
    settings = load_settings(LoadRequest(SMOL), entry, defaults)
    assert settings.chat_template == CHATML and settings.n_ctx == 1024  # the config's table keeps its values
    assert defaults["other"] == ModelDefaults(n_ctx=512)
    assert "system" not in CHATML and "SmolLM" not in CHATML
    own = builtin_model_defaults({SMOL: ModelDefaults(chat_template="{{ mine }}")})
    assert load_settings(LoadRequest(SMOL), entry, own).chat_template == "{{ mine }}"
    asked = load_settings(LoadRequest(SMOL, chat_template="{{ asked }}"), entry, defaults)
    assert asked.chat_template == "{{ asked }}"


def test_make_run_serves_the_default_model():
    """What the next test runs is what `make run` runs, once the set-up steps are done."""
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MAKELEVEL", "MFLAGS")}
    out = subprocess.run(
        ["make", "--no-print-directory", "-n", "run", "LLAMA_SERVER_PATH=/bin/true"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == ".venv/bin/ggstudio serve"


@pytest.mark.slow
def test_the_default_model_names_paris_at_temperature_0_and_make_run_prints_the_page(llama_server_bin, tmp_path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = tagged_env()
    with (
        (tmp_path / "serve.err").open("w") as err,
        subprocess.Popen(
            [CLI, "serve", "--port", str(port)], stdout=subprocess.PIPE, stderr=err, text=True, env=env
        ) as serve,
    ):
        try:
            line = serve.stdout.readline()
            assert line.startswith(f"GGUF Studio at {url}/ "), line + (tmp_path / "serve.err").read_text()
            page = httpx.get(f"{url}/", timeout=30)
            assert page.status_code == 200 and "<title>GGUF Studio</title>" in page.text

            def ready() -> bool:
                status = httpx.get(f"{url}/api/status", timeout=30).json()
                assert status["state"] in ("resolving", "loading", "ready"), status
                return status["state"] == "ready" and status["model"] == CHAT_FILENAME.removesuffix(".gguf")

            wait_for(ready, timeout=300, interval=0.5, what="the default model to load")
            client = OpenAI(base_url=f"{url}/v1", api_key="not-needed-on-loopback", timeout=600, max_retries=0)
            reply = client.chat.completions.create(
                model=CHAT_FILENAME.removesuffix(".gguf"),
                temperature=0,
                max_tokens=48,
                messages=[{"role": "user", "content": QUESTION}],
            )
            answer = reply.choices[0].message.content
            assert "Paris" in answer, answer
            assert "capital of France?" not in answer and "<|im_" not in answer, answer
        finally:
            stop_studio(serve)
    assert_no_llama_server(env)


def test_a_request_during_the_first_load_of_a_model_given_by_path_is_answered_not_404(llama_server_bin, tmp_path):
    """``ggstudio serve --model FILE`` with a file outside every model folder answers at once (``--ready-json``),
    its model still loading: a request then, naming the model or none, got a 404 ("not one of the known models
    (none)"): the default's name was looked up in the catalog, which does not list the file. The model's
    llama-server is stopped (SIGSTOP) as soon as it appears, so the requests come while it loads."""
    from studio.library.default_model import ensure_default_model
    from studio.settings import Settings
    from tests.support.home_studio import home_env, read_ready, start_serve, stop

    model = ensure_default_model(Settings.from_env().models_dir)
    env = home_env(tmp_path / "home", llama_server_bin)
    serve = start_serve(env, model, ctx=512)
    try:

        def loading() -> psutil.Process | None:
            for child in psutil.Process(serve.pid).children(recursive=True):
                try:
                    if "-m" in child.cmdline():
                        return child
                except psutil.Error:
                    continue
            return None

        server = wait_for(loading, timeout=60, interval=0.002, what="the model's llama-server")
        server.suspend()
        url = read_ready(serve, env)["url"]
        assert httpx.get(f"{url}/api/status", timeout=30).json()["state"] != "ready"  # the load is held
        answers: dict[str, httpx.Response] = {}

        def ask(label: str, named: dict[str, str]) -> None:
            body = {**named, "messages": [{"role": "user", "content": QUESTION}], "max_tokens": 4}
            answers[label] = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)

        asking = [
            threading.Thread(target=ask, args=(label, named))
            for label, named in (("no model", {}), ("by name", {"model": SMOL}))
        ]
        for thread in asking:
            thread.start()
        time.sleep(1)  # both wait for the held load (a 404 would have come at once)
        server.resume()
        for thread in asking:
            thread.join(150)
        for label, resp in answers.items():
            assert resp.status_code == 200, (label, resp.text)
            assert resp.json()["model"] == SMOL
        assert len(answers) == 2
    finally:
        stop(serve)
