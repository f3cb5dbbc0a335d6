"""Every answer ends, and the first question is answered right: the studio's answer limits, a base model's
borrowed template, and the per-model sampling defaults, through a real ``ggstudio serve`` and ``run``.

On b5a9904 an answer had no limit of its own: a chat got ``max_tokens`` = the context, llama-server's native
routes none at all, so SmolLM2 in a repetition loop was still generating after 10 minutes; a base model
chatting through llama-server's fallback ChatML wrote ``<|im_end|>\\n<|im_start|>`` turns on and on.
"""

from __future__ import annotations

import json
import signal
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from launcher.sampling import DEFAULT_MAX_TOKENS, Sampling, in_force
from studio.load_options import BY_NAME, config_problems
from tests.helpers import free_port, stop_studio, wait_for
from tests.test_cli import CLI, GEMMA, SMOL, assert_no_llama_server, cli, tagged_env

QUESTION = "What is the capital of France?"
#: An answer that never ends by itself: llama-server's own switch to ignore the end-of-generation token.
RUNAWAY = {"ignore_eos": True}


def test_a_requests_own_values_win_over_the_models_which_win_over_the_studios():
    model = Sampling(temperature=0.2, max_tokens=64)
    studio = Sampling(max_tokens=4096, max_seconds=30)
    merged = model.over(studio)
    assert merged == Sampling(temperature=0.2, max_tokens=64, max_seconds=30)
    argv = merged.argv(n_ctx=48)
    assert argv[:2] == ["--n-predict", "48"]  # never past the context
    assert argv[2:] == ["--temp", "0.2"]  # what is unset is not passed: the GGUF's own keys stay in force
    assert Sampling().argv(n_ctx=100_000)[:2] == ["--n-predict", str(DEFAULT_MAX_TOKENS)]
    shown = in_force(Sampling(top_p=0.9), (("temp", 0.6), ("top_k", 20.0)), n_ctx=1024)
    assert shown["top_p"] == {"value": 0.9, "source": "config"}
    assert shown["temperature"] == {"value": 0.6, "source": "model file"}
    assert shown["top_k"] == {"value": 20, "source": "model file"}
    assert shown["min_p"]["source"] == "llama-server"
    assert shown["max_tokens"] == {"value": 1024, "source": "studio"}
    limits = [BY_NAME[k] for k in ("temperature", "top_k", "max_tokens")]
    assert config_problems({"temperature": "hot", "top_k": 1.5, "max_tokens": 0}, limits)[1] == [
        "temperature must be a number from 0 to 5",
        "top_k must be an integer from 0 to 1000000, not 1.5",
        "max_tokens must be an integer from 1 to 16777216",
    ]


@contextmanager
def serving(tmp_path: Path, config: str, *args: str, env: dict[str, str] | None = None) -> Iterator[tuple[str, str]]:
    """A real ``ggstudio serve`` with ``config`` as its config file, listening for Ollama too: (url, ollama url)."""
    port, ollama = free_port(), free_port()
    (tmp_path / "config.toml").write_text(config)
    env = {
        **(env or tagged_env()),
        "GGUF_STUDIO_CONFIG": str(tmp_path / "config.toml"),
        "GGUF_STUDIO_OLLAMA_PORT": str(ollama),
    }
    url = f"http://127.0.0.1:{port}"
    with (
        (tmp_path / "serve.err").open("w") as err,
        subprocess.Popen(
            [CLI, "serve", "--port", str(port), *args], stdout=subprocess.PIPE, stderr=err, text=True, env=env
        ) as serve,
    ):
        try:
            assert serve.stdout is not None
            line = serve.stdout.readline()
            assert url in line, line + (tmp_path / "serve.err").read_text()

            def ready() -> bool:
                status = httpx.get(f"{url}/api/status", timeout=30).json()
                assert status["state"] in ("unloaded", "resolving", "loading", "ready"), status
                return status["state"] == "ready"

            wait_for(ready, timeout=300, interval=0.25, what="the model to load")
            yield url, f"http://127.0.0.1:{ollama}"
        finally:
            stop_studio(serve, signal.SIGTERM)
    assert_no_llama_server(env)


def _generated(route: str, answer: dict) -> int:
    """Tokens the answer generated, read as each dialect reports them."""
    if route in ("/v1/chat/completions", "/v1/completions"):
        return answer["usage"]["completion_tokens"]
    if route == "/completion":
        return answer["tokens_predicted"]
    if route in ("/v1/responses", "/v1/messages"):
        return answer["usage"]["output_tokens"]
    return answer["eval_count"]  # Ollama's


@pytest.mark.slow
def test_an_answer_without_a_limit_of_its_own_ends_at_the_studios_on_every_route(llama_server_bin, tmp_path):
    """On b5a9904 each of these ran to the context (chat) or without end (native): the client's timeout hit."""
    limit = 12
    with serving(tmp_path, f"max_tokens = {limit}\n", "--model", SMOL, "--ctx", "2048") as (url, ollama):
        chat = {"messages": [{"role": "user", "content": "Count to a million."}], **RUNAWAY}
        asks = [
            (url, "/v1/chat/completions", chat),
            (url, "/v1/completions", {"prompt": "1, 2, 3,", **RUNAWAY}),
            (url, "/completion", {"prompt": "1, 2, 3,", **RUNAWAY}),
            (url, "/v1/responses", {"input": "Count to a million.", **RUNAWAY}),
            (url, "/v1/messages", {"messages": chat["messages"]}),  # llama-server drops ignore_eos here
            (ollama, "/api/chat", {"model": SMOL, "stream": False, **chat, "options": {}}),
            (ollama, "/api/generate", {"model": SMOL, "prompt": "1, 2, 3,", "stream": False, "raw": True}),
        ]
        counts = {}
        for base, route, body in asks:
            resp = httpx.post(base + route, json=body, timeout=60)
            assert resp.status_code == 200, (route, resp.text)
            answer = resp.json()
            counts[route] = _generated(route, answer)
            assert counts[route] <= limit, (route, answer)
            if route == "/v1/chat/completions":
                assert answer["choices"][0]["finish_reason"] == "length"
        print("tokens generated per route, limit", limit, counts)
        assert counts["/v1/chat/completions"] == counts["/completion"] == limit  # the runaways hit the limit
        own = httpx.post(f"{url}/completion", json={"prompt": "1, 2, 3,", "n_predict": 20, **RUNAWAY}, timeout=60)
        assert own.json()["tokens_predicted"] == 20  # a request's own limit wins over the studio's


@pytest.mark.slow
def test_a_generation_stops_at_the_wall_clock_backstop(llama_server_bin, tmp_path):
    """``max_seconds`` of a model's table: llama-server's ``t_max_predict_ms`` on each generation, which stops it
    at the first line break past the time."""
    config = f'max_tokens = 100000\n[models."{SMOL}"]\nmax_seconds = 1\n'
    with serving(tmp_path, config, "--model", SMOL, "--ctx", "8192") as (url, _):
        answer = httpx.post(f"{url}/completion", json={"prompt": "1\n2\n3\n", **RUNAWAY}, timeout=120).json()
        print("backstop:", answer["tokens_predicted"], "tokens in", answer["timings"]["predicted_ms"], "ms")
        assert answer["stop_type"] == "limit" and answer["tokens_predicted"] < 8000
        assert 1000 <= answer["timings"]["predicted_ms"] < 10_000
        chat = httpx.post(
            f"{url}/v1/chat/completions",
            # greedy: the backstop stops at a line break, and a sampled answer may write none for thousands of
            # tokens (a read timeout on a loaded machine)
            json={
                "messages": [{"role": "user", "content": "Count from 1 to 5000, one per line."}],
                "temperature": 0,
                **RUNAWAY,
            },
            timeout=120,
        ).json()
        assert chat["choices"][0]["finish_reason"] == "length" and chat["timings"]["predicted_ms"] < 10_000
        status = httpx.get(f"{url}/api/status", timeout=30).json()["models"][0]
        assert status["sampling"]["max_seconds"] == {"value": 1, "source": "config"}
        assert status["sampling"]["max_tokens"]["value"] == status["effective_context"]  # capped at the context


@pytest.mark.slow
def test_run_once_on_a_base_model_ends_and_says_it_borrows_a_template(llama_server_bin, gemma_model):
    """On b5a9904 this printed ``<|im_end|>\\n<|im_start|>admin`` turns and did not stop."""
    env = tagged_env()
    out = cli("run", GEMMA, "--ctx", "2048", "--once", QUESTION, env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "is a base model" in out.stderr and "/v1/completions" in out.stderr and "instruct model" in out.stderr
    assert "<|im_" not in out.stdout, out.stdout
    assert_no_llama_server(env)


@pytest.mark.slow
def test_a_base_models_chat_ends_at_the_borrowed_turn_markers(llama_server_bin, gemma_model, tmp_path):
    with serving(tmp_path, "", "--model", GEMMA, "--ctx", "2048") as (url, _):
        row = httpx.get(f"{url}/api/status", timeout=30).json()["models"][0]
        assert row["capabilities"]["fallback_template"]
        messages = [{"role": "user", "content": QUESTION}]
        for seed in range(3):
            answer = httpx.post(
                f"{url}/v1/chat/completions", json={"messages": messages, "seed": seed, "stop": ["\n\n\n"]}, timeout=120
            ).json()
            text = answer["choices"][0]["message"]["content"]
            assert "<|im_start|>" not in text and "<|im_end|>" not in text, text
            assert answer["usage"]["completion_tokens"] < DEFAULT_MAX_TOKENS
        native = httpx.post(f"{url}/completion", json={"prompt": "<|im_end|> x", "n_predict": 4}, timeout=60).json()
        assert native["stop_type"] == "limit"  # raw text keeps llama-server's own rules: no stops added


def _paris(texts: list[str]) -> int:
    return sum("Paris" in t for t in texts)


@pytest.mark.slow
def test_the_first_question_is_answered_right_at_the_default_settings(llama_server_bin, smollm_model, tmp_path):
    """The page's chat route and ``run --once``, at their defaults, ten fixed seeds each.

    On b5a9904 (llama-server's sampling, 0.8 / 0.95) seed 1 named "Le Canardefleuve"; the issue counted 2 wrong
    in 6 through ``run`` and 3 in 7 on the page.
    """
    seeds = range(1, 11)
    env = tagged_env()
    alone = [cli("run", SMOL, "--seed", str(s), "--once", QUESTION, env=env, timeout=300) for s in seeds]
    assert all(o.returncode == 0 and "using the studio" not in o.stderr for o in alone), [o.stderr for o in alone]
    with serving(tmp_path, "", env=env) as (url, _):  # no model named: the chat default, as `make run`
        sampling = httpx.get(f"{url}/api/status", timeout=30).json()["sampling"]
        assert sampling["temperature"]["value"] == 0.2 and sampling["top_p"]["value"] == 0.9  # its authors' advice
        page = []
        for seed in seeds:
            with httpx.stream(
                "POST", f"{url}/api/chat", json={"messages": [{"role": "user", "content": QUESTION}], "seed": seed}
            ) as resp:
                events = [json.loads(line[6:]) for line in resp.iter_lines() if line.startswith("data: ")]
            page.append("".join(e["text"] for e in events if e.get("type") == "content"))
        through = [cli("run", SMOL, "--seed", str(s), "--once", QUESTION, env=env, timeout=120) for s in seeds]
        assert all(f"using the studio running at {url}" in o.stderr for o in through), through[0].stderr
    print(
        f"Paris: page {_paris(page)}/10, run --once through a studio {_paris([o.stdout for o in through])}/10, "
        f"run --once alone {_paris([o.stdout for o in alone])}/{len(alone)}"
    )
    assert _paris(page) >= 9, page
    assert _paris([o.stdout for o in through]) >= 9, [o.stdout for o in through]
    assert _paris([o.stdout for o in alone]) >= 9, [o.stdout for o in alone]
