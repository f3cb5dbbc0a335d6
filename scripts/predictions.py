"""Print every memory estimate and plan the studio makes over the zoo, one line each, to diff across a refactor.

A change meant to leave predictions alone (a faster estimator, a bounded planner)
is checked by running this before and after it and diffing the two outputs: they
must be identical. It starts no llama-server (unlike ``memory_accuracy.py``), so
it takes seconds.

What it covers: Gemma 3 270M, every zoo model, the zoo's Qwen3.5 with an MTP
block appended, the zoo deepened to 40 blocks, and (when generated) the widened and real-proportion MoE zoos;
for each, ``estimate()`` over ``memory_accuracy.CONFIGS`` on the CPU, with half
the layers on one GPU, and over two GPUs split 3:1; then ``plan()`` for an
automatic and an explicit context on three machines (CPU only, one GPU, two
GPUs of which the first is too small for the whole model).

Usage: ``.venv/bin/python scripts/predictions.py > before.txt`` (``--no-wide``: the zoo and Gemma only).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import gguf
from launcher.capabilities import Capabilities, probe
from launcher.errors import LauncherError
from launcher.memory import estimate, for_file
from launcher.planner import ModelInfo, plan
from scripts.memory_accuracy import CONFIGS
from tests.support.machines import CPU_ONLY, ONE_GPU, REQUESTS, TWO_SMALL_GPUS

#: Blocks of the deepened zoo (``tests.support.deep_zoo``): every layer pattern repeats, and the old quadratic
#: estimator still ran it in seconds.
DEEP_BLOCKS = 40
#: Layer placements each config is estimated under: (name, -ngl, tensor split).
PLACEMENTS = (("cpu", 0, (1.0,)), ("gpu-half", None, (1.0,)), ("gpu2-all", -1, (3.0, 1.0)))
MACHINES = {"cpu-only": CPU_ONLY, "one-gpu": ONE_GPU, "two-gpus": TWO_SMALL_GPUS}


def models(no_wide: bool, tmp: Path) -> Iterator[tuple[str, Path]]:
    """(name, file) of every model the predictions cover."""
    from launcher.build import ensure_built
    from studio.library.default_model import ensure_gemma
    from studio.settings import Settings
    from tests.support.deep_zoo import deepen_model
    from tests.support.wide_zoo import ensure_moe_zoo, ensure_wide_zoo
    from tests.support.zoo import derive_mtp_model, ensure_zoo

    settings = Settings.from_env()
    build = ensure_built(settings.home)
    zoo = ensure_zoo(build, settings.home)
    yield "gemma-3-270m", ensure_gemma(settings.models_dir)
    for path in sorted(zoo.glob("*.gguf")):
        yield path.stem, path
    yield "qwen35-mtp", derive_mtp_model(zoo / "qwen35-dense.gguf", tmp / "qwen35-mtp.gguf")
    for path in sorted(zoo.glob("*.gguf")):  # deep enough for layer patterns (SWA periods, intervals) to repeat
        deep = deepen_model(path, tmp / f"{path.stem}-deep.gguf", DEEP_BLOCKS)
        if deep is not None:
            yield deep.stem, deep
    if no_wide:
        return
    for path in ensure_wide_zoo(
        zoo, build.llama_server, zoo.with_name(f"{zoo.name}-wide8x16"), factor=8, ffn_factor=16
    ):
        yield path.stem, path
    for path in ensure_moe_zoo(zoo, build.llama_server, zoo.with_name(f"{zoo.name}-moe")):
        yield path.stem, path


def lines(name: str, path: Path, caps: Capabilities) -> Iterator[str]:
    """One line per estimate and per plan of the model at ``path``."""
    model = gguf.read(path)
    facts = model.facts
    base = for_file(model)
    for config in CONFIGS:
        for where, ngl, split in PLACEMENTS:
            options = dataclasses.replace(
                base,
                **{
                    k: getattr(config.options, k)
                    for k in (
                        "n_ctx",
                        "n_parallel",
                        "kv_unified",
                        "cache_type_k",
                        "cache_type_v",
                        "swa_full",
                        "n_batch",
                        "n_ubatch",
                        "flash_attn",
                        "spec",
                        "spec_n_max",
                    )
                },
                n_gpu_layers=facts.block_count // 2 if ngl is None else ngl,
                tensor_split=split,
            )
            variants = [("none", options)]
            if facts.nextn_predict_layers:
                variants.append(("mtp", dataclasses.replace(options, spec="mtp", spec_n_max=options.spec_n_max or 3)))
            for spec, opts in variants:
                yield f"estimate {name} {config.name} {where} {spec}: {_outcome(lambda: estimate(facts, opts))}"
    info = ModelInfo.from_gguf(model)
    for machine, inventory in MACHINES.items():
        for label, request in REQUESTS:
            yield f"plan {name} {machine} {label}: {_outcome(lambda: _plan_line(plan(info, inventory, caps, request)))}"


def _plan_line(p: object) -> str:
    fields = (
        "gpus",
        "offload",
        "n_gpu_layers",
        "tensor_split",
        "n_ctx",
        "max_safe_ctx",
        "flash_attn",
        "fit_target_mib",
        "spec",
        "reasons",
        "warnings",
    )
    return repr({f: getattr(p, f) for f in fields} | {"bill": p.bill})


def _outcome(make: Callable[[], object]) -> str:
    try:
        return repr(make())
    except (LauncherError, gguf.GGUFError) as exc:
        return f"{type(exc).__name__}: {exc}"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-wide", action="store_true", help="only Gemma, the zoo and the MTP model")
    args = parser.parse_args(argv)
    import structlog

    structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr))  # stdout holds only predictions
    from launcher.build import ensure_built
    from studio.settings import Settings

    settings = Settings.from_env()
    caps = probe(ensure_built(settings.home).llama_server, cache_dir=settings.home / "cache")
    with tempfile.TemporaryDirectory() as tmp:
        for name, path in models(args.no_wide, Path(tmp)):
            for line in lines(name, path, caps):
                print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
