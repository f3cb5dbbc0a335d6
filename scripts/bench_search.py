#!/usr/bin/env python3
"""Hub search with a fit per variant: time to the first fitted result, and per extra variant, headers kept or not.

A real studio (uvicorn in a thread, the real manager and planner with the pinned build's
capabilities) searches the Hub stand-in (``tests.hub_server``, with ``--rtt`` seconds before every
answer to imitate a distant Hub) holding one repo: five variants of a zoo model (small headers) and
the real Gemma 3 270M (a 6.5 MB header: a 262k-token vocabulary). Each round clears the kept
headers (cold) or keeps them (warm) and measures, through the HTTP API:

- ``GET /api/hub/search`` for the repo with every variant fitted (the page's one request);
- ``GET /api/hub/fit`` for the first variant (the first fitted result) and for each further one;
- bytes read from the stand-in against the headers' size.

It prints medians over ``--rounds`` and the warm/cold ratios, measured in the same run.

    .venv/bin/python scripts/bench_search.py [--rounds 5] [--rtt 0.03]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from launcher.build import ensure_built
from studio.library.default_model import ensure_gemma
from studio.settings import Settings
from tests.hub_server import HubServer
from tests.support.deep_zoo import deepen_model
from tests.support.studio import running_studio
from tests.support.zoo import ensure_zoo

REPO = "bench/fit-GGUF"
DEEP = {"Q2_K": 4, "Q3_K_M": 8, "Q4_K_M": 16, "Q5_K_M": 24, "Q8_0": 32}


def median_ms(values: list[float]) -> str:
    return f"{statistics.median(values) * 1000:8.1f} ms"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--rtt", type=float, default=0.03, help="seconds before each answer of the stand-in Hub")
    args = parser.parse_args()

    settings = Settings.from_env()
    build = ensure_built(settings.home)
    zoo = ensure_zoo(build, settings.home)
    work = Path(tempfile.mkdtemp(prefix="bench-search-"))
    hub = HubServer().start()
    try:
        repo = hub.repo(REPO)
        for label, blocks in DEEP.items():
            path = deepen_model(zoo / "llama-dense.gguf", work / f"deep-{label}.gguf", blocks)
            assert path is not None
            repo.add(f"deep-{label}.gguf", path)
        repo.add("gemma-3-270m-BF16.gguf", ensure_gemma(settings.models_dir))  # labelled apart from the deep ones
        hub.request_delay = args.rtt
        os.environ.update(HF_ENDPOINT=hub.url, HF_HOME=str(work / "hf"), HF_HUB_DISABLE_TELEMETRY="1")
        os.environ.pop("HF_HUB_OFFLINE", None)
        with running_studio(work / "studio", build.llama_server, {}) as studio:
            kept = work / "studio" / "hub-headers"
            client = httpx.Client(base_url=studio.url, timeout=300)
            labels = [*DEEP, "BF16"]
            times: dict[str, dict[str, list[float]]] = {
                mode: {"search": [], "first": [], "extra": []} for mode in ("cold", "warm")
            }
            read: dict[str, int] = {}
            for _ in range(args.rounds):
                for mode in ("cold", "warm"):
                    if mode == "cold":
                        shutil.rmtree(kept, ignore_errors=True)
                    started = time.perf_counter()
                    r = client.get("/api/hub/search", params={"q": "fit"})
                    r.raise_for_status()
                    times[mode]["search"].append(time.perf_counter() - started)
                    if mode == "cold":
                        shutil.rmtree(kept, ignore_errors=True)
                    for i, label in enumerate(labels):
                        started = time.perf_counter()
                        fit = client.get("/api/hub/fit", params={"model": f"{REPO}:{label}"})
                        fit.raise_for_status()
                        times[mode]["first" if i == 0 else "extra"].append(time.perf_counter() - started)
                        if mode == "cold":
                            read[label] = fit.json()["bytes_read"] - fit.json()["header_bytes"]
            client.close()
    finally:
        hub.stop()
        shutil.rmtree(work, ignore_errors=True)

    print(f"Hub stand-in, {args.rtt * 1000:.0f} ms before each answer; {len(labels)} variants; {args.rounds} rounds")
    print(f"{'':34}{'cold':>11}  {'warm':>11}  warm/cold")
    rows = (
        ("search, every variant fitted", "search"),
        ("first fitted result (/api/hub/fit)", "first"),
        ("each further variant", "extra"),
    )
    for name, key in rows:
        cold, warm = times["cold"][key], times["warm"][key]
        ratio = statistics.median(warm) / statistics.median(cold)
        print(f"{name:34}{median_ms(cold)}  {median_ms(warm)}  {ratio:9.2f}")
    print("bytes read beyond each header (limit 65,536): " + ", ".join(f"{k} {v:,}" for k, v in read.items()))


if __name__ == "__main__":
    main()
