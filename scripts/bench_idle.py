#!/usr/bin/env python3
"""What an idle studio costs: ``ggstudio serve`` with three models resident and no requests.

Starts the real CLI in its own process with a config that preloads three zoo
models, waits until all are ready, then measures the studio process's own CPU time
(user + system, its llama-servers not counted) over a quiet window. Target: at most
0.1 % of one core.

    .venv/bin/python scripts/bench_idle.py [--seconds 30]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from launcher.build import ensure_built
from launcher.process import free_port
from studio.settings import Settings
from tests.support.zoo import ensure_zoo

MODELS = ("llama-dense", "qwen2-dense", "mistral3-dense")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=30.0)
    args = parser.parse_args()
    settings = Settings.from_env()
    zoo = ensure_zoo(ensure_built(settings.home), settings.home)
    scratch = Path(tempfile.mkdtemp(prefix="bench-idle-"))
    tables = "".join(f'[models."{m}"]\nn_ctx = 256\nspec = "off"\n' for m in MODELS)
    config = scratch / "config.toml"
    config.write_text(f'model_dirs = ["{zoo}"]\npreload = {list(MODELS)!r}\n{tables}'.replace("'", '"'))
    port = free_port()
    env = {**os.environ, "GGUF_STUDIO_CONFIG": str(config), "GGUF_STUDIO_PORT": str(port)}
    cli = str(Path(sys.executable).parent / "ggstudio")
    with subprocess.Popen([cli, "serve"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) as serve:
        try:
            deadline = time.monotonic() + 180
            while time.monotonic() < deadline:
                try:
                    models = httpx.get(f"http://127.0.0.1:{port}/api/status", timeout=5).json()["models"]
                    if len(models) == len(MODELS) and all(m["state"] == "ready" for m in models):
                        break
                except (httpx.HTTPError, KeyError, ValueError):
                    pass
                time.sleep(0.5)
            else:
                raise SystemExit("the three models did not become ready in 3 minutes")
            time.sleep(3)  # let start-up work settle
            studio = psutil.Process(serve.pid)
            before, t0 = studio.cpu_times(), time.monotonic()
            time.sleep(args.seconds)
            after, elapsed = studio.cpu_times(), time.monotonic() - t0
        finally:
            serve.terminate()
            serve.wait(30)
    used = (after.user + after.system) - (before.user + before.system)
    print(
        f"{len(MODELS)} models resident and idle for {elapsed:,.0f} s: the studio process used "
        f"{used * 1000:,.1f} ms of CPU = {used / elapsed:.3%} of a core (target <= 0.1 %)"
    )


if __name__ == "__main__":
    main()
