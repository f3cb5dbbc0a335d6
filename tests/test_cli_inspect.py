"""`ggstudio inspect`: what a user sees about a model, as text and JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

CLI = str(Path(sys.executable).parent / "ggstudio")


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([CLI, *args], capture_output=True, text=True, timeout=60)


def test_inspect_gemma_text(gemma_model):
    out = run("inspect", str(gemma_model))
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert "gemma3" in text and "268.10 M" in text and "Q4_K_M" in text
    assert "32,768 tokens" in text
    assert "512 tokens on 15 of 18 layers" in text
    assert "MTP               no" in text


def test_inspect_gemma_json(gemma_model):
    out = run("inspect", "--json", str(gemma_model))
    info = json.loads(out.stdout)
    assert info["architecture"] == "gemma3" and info["layers"] == 18
    assert info["heads"] == 4 and info["kv_heads"] == 1 and info["head_dim_k"] == 256
    # 18 layers x 1 KV head x (256 K + 256 V) x 2 bytes x 1024 tokens; 15 of them are SWA layers.
    assert info["kv_f16_bytes_per_1k_tokens"] == {"full": 3 * 1024 * 1024, "swa": 15 * 1024 * 1024}
    assert info["shards"] == [str(gemma_model)]


def test_inspect_vocab_with_a_template(llama_src):
    out = run("inspect", "--json", str(llama_src / "models" / "ggml-vocab-qwen2.gguf"))
    info = json.loads(out.stdout)
    assert info["vocab_size"] == 151936
    assert info["chat_template"]["supports_tools"] is False


def test_inspect_bad_file_is_one_line(tmp_path):
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"GGUF" + b"\x03\0\0\0" + b"\xff" * 16)
    out = run("inspect", str(bad))
    assert out.returncode == 1
    assert out.stderr.startswith("error: ") and str(bad) in out.stderr
    assert "Traceback" not in out.stderr and out.stderr.count("\n") == 1


def test_inspect_reports_an_r1_distill_template_as_always_reasoning(llama_src, tmp_path):
    """The distills' template strips past thinking and never names it; it was reported as ``reasoning no``."""
    from gguf.writer import rewrite
    from studio.settings import Settings
    from tests.test_templates import _r1_distill_as_shipped

    model = rewrite(
        llama_src / "models" / "ggml-vocab-qwen2.gguf",
        tmp_path / "r1-distill.gguf",
        metadata_updates={"tokenizer.chat_template": _r1_distill_as_shipped(Settings.from_env())},
    )
    out = run("inspect", str(model))
    assert out.returncode == 0, out.stderr
    assert "reasoning always on" in out.stdout


def test_inspect_takes_a_model_name(smollm_model, tmp_path):
    """``inspect NAME`` said "cannot open the file" where plan, run and load take the same name."""
    env = {**os.environ, "GGUF_STUDIO_HOME": str(tmp_path), "GGUF_STUDIO_MODEL_DIRS": str(smollm_model.parent)}
    name = smollm_model.name.removesuffix(".gguf")
    by_name = subprocess.run([CLI, "inspect", "--json", name], capture_output=True, text=True, timeout=60, env=env)
    assert by_name.returncode == 0, by_name.stderr
    assert json.loads(by_name.stdout)["shards"] == [str(smollm_model)]
    assert by_name.stdout == run("inspect", "--json", str(smollm_model)).stdout  # the same as by its path
    usage = subprocess.run([CLI, "inspect", "-h"], capture_output=True, text=True, timeout=60, env=env).stdout
    assert usage.startswith("Usage: ggstudio inspect [OPTIONS] {model}\n") and "{file}" not in usage

    unknown = subprocess.run([CLI, "inspect", "no-such-model"], capture_output=True, text=True, timeout=60, env=env)
    assert unknown.returncode == 3 and unknown.stderr.count("\n") == 1, unknown.stderr
    assert unknown.stderr.startswith("error: model 'no-such-model' not found") and name in unknown.stderr


def test_inspect_shows_the_sampling_defaults_in_force_and_where_each_comes_from(gemma_model, tmp_path):
    """The studio had no notion of per-model sampling: the authors' ``general.sampling.*`` keys, the model's table
    and llama-server's defaults are now one line, in the order a request without values of its own gets them."""
    from gguf.writer import rewrite

    model = rewrite(
        gemma_model,
        tmp_path / "gemma-tuned.gguf",
        metadata_updates={"general.sampling.temp": 1.0, "general.sampling.top_k": 64},
    )
    config = tmp_path / "config.toml"
    config.write_text('[models."gemma-tuned"]\ntop_p = 0.9\nmax_tokens = 512\n')
    env = {**os.environ, "GGUF_STUDIO_CONFIG": str(config)}
    out = subprocess.run([CLI, "inspect", "--json", str(model)], capture_output=True, text=True, timeout=60, env=env)
    info = json.loads(out.stdout)
    assert info["sampling_in_file"] == {"temp": 1.0, "top_k": 64.0}
    shown = info["sampling"]
    assert shown["temperature"] == {"value": 1.0, "source": "model file"}
    assert shown["top_k"] == {"value": 64, "source": "model file"}
    assert shown["top_p"] == {"value": 0.9, "source": "config"}
    assert shown["min_p"] == {"value": 0.05, "source": "llama-server"}
    assert shown["max_tokens"] == {"value": 512, "source": "config"}
    text = subprocess.run([CLI, "inspect", str(model)], capture_output=True, text=True, timeout=60, env=env).stdout
    assert "temperature 1 (model file), top_p 0.9 (config)" in text, text
