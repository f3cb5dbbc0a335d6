"""``ggstudio bench-spec``: measure tokens/s per speculative mode for one model here, and store the winner.

For every mode the model and this machine's llama-server allow (off, ngram-mod,
ngram-simple, and MTP, MTP + ngram-mod where the model has MTP layers), it
starts the model's llama-server with the flags the planner gives that mode,
sends a small fixed set of prompts of different kinds (free prose, a copy-heavy
code edit, a repetitive list) and reads llama-server's own generation speed
from each answer's ``timings`` (prompt processing left out). Every prompt runs
greedily for the same number of tokens (``ignore_eos``), so each mode does the
same work; each round starts every mode's server anew, so no mode drafts from
what another run left behind, and the rounds interleave the modes against
drift on a busy machine. A mode's score is the geometric mean over the prompt
kinds of its median tokens/s per kind: each kind counts alike, and one
disturbed run does not decide.

The result goes to ``launcher.spec_measurements`` under the model file, the
devices and the binary build; the planner then resolves ``auto`` to the
measured winner on this machine, and a rebuilt binary or another device set
finds nothing until it is measured again.
"""

from __future__ import annotations

import datetime
import statistics
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

from launcher import spec_measurements
from launcher.capabilities import Capabilities
from launcher.command import HOST, build_command
from launcher.devices import Inventory
from launcher.planner import LaunchPlan, ModelInfo, PlanRequest, plan, spec_devices
from launcher.spec_measurements import ModeResult, SpecKey, SpecMeasurement


@dataclass(frozen=True)
class BenchPrompt:
    """One kind of work: what decoding is asked to continue."""

    kind: str
    text: str


_CODE = """def summarize(orders):
    total = 0
    count = 0
    largest = None
    for order in orders:
        if order.cancelled:
            continue
        total += order.amount
        count += 1
        if largest is None or order.amount > largest.amount:
            largest = order
    average = total / count if count else 0
    return {"total": total, "count": count, "average": average, "largest": largest}
"""

#: The fixed prompt set. Plain completions (no chat template), so base models and instruct models do the same work.
PROMPTS: tuple[BenchPrompt, ...] = (
    BenchPrompt(
        "prose",
        "The sea covers most of our planet, yet we know less about its depths than about the "
        "surface of the moon. In this essay I want to describe",
    ),
    BenchPrompt(
        "code edit",
        "Here is a Python function:\n\n```python\n" + _CODE + "```\n\nHere is the same "
        "function with `orders` renamed to `purchases`, and nothing else changed:\n\n"
        "```python\n",
    ),
    BenchPrompt("repetitive", "".join(f"- server {i:02d}: status ok, load normal, disk fine\n" for i in range(1, 9))),
)

#: Seconds a llama-server may take to load the model for one mode.
START_TIMEOUT = 600.0
Progress = Callable[[str], None]


def modes_for(caps: Capabilities, info: ModelInfo) -> tuple[str, ...]:
    """The modes worth measuring here: off and the ngram drafts, MTP (alone and with ngram-mod) where it runs."""
    modes = ["off"]
    if "ngram-mod" in caps.spec_types:
        modes.append("ngram")
    if "ngram-simple" in caps.spec_types:
        modes.append("ngram-simple")
    if info.facts.has_mtp and caps.mtp_type is not None:  # a trunk-only file cannot draft with MTP
        modes.append("mtp")
        if "ngram-mod" in caps.spec_types:
            modes.append("mtp+ngram")
    return tuple(modes)


@dataclass(frozen=True)
class _Run:
    """One prompt's answer: tokens generated, generation milliseconds, drafted and accepted tokens."""

    predicted_n: int
    predicted_ms: float
    draft_n: int
    draft_accepted: int


def measure(
    info: ModelInfo,
    inventory: Inventory,
    caps: Capabilities,
    binary: Path,
    *,
    work_dir: Path,
    tokens: int = 128,
    rounds: int = 1,
    n_ctx: int = 2048,
    modes: Sequence[str] | None = None,
    prompts: Sequence[BenchPrompt] = PROMPTS,
    progress: Progress | None = None,
) -> SpecMeasurement:
    """Measure every mode on ``prompts`` and return the result (not stored; see ``measure_and_store``).

    Raises:
        launcher.errors.ProcessError: a mode's llama-server failed to start (``LoadError`` with its reason,
            ``StartTimeoutError``).
        httpx.HTTPError: a request to it failed.
    """
    say = progress or (lambda _: None)
    modes = tuple(modes or modes_for(caps, info))
    runs: dict[str, list[_Run]] = {m: [] for m in modes}
    per_prompt: dict[str, dict[str, list[float]]] = {m: {p.kind: [] for p in prompts} for m in modes}
    for r in range(rounds):
        for mode in modes:
            launch = plan(info, inventory, caps, PlanRequest(n_ctx=n_ctx, n_parallel=1, spec=mode))
            say(
                f"round {r + 1}/{rounds}: {spec_measurements.LABELS[mode]} ({' '.join(launch.spec.argv) or 'no flags'})"
            )
            with (
                _serving(launch, caps, binary, work_dir, mode) as (url, headers),
                httpx.Client(base_url=url, headers=headers, timeout=None) as client,
            ):
                _complete(client, "Hello", 4)  # the first request pays for warm-up
                for prompt in prompts:
                    run = _complete(client, prompt.text, tokens)
                    runs[mode].append(run)
                    per_prompt[mode][prompt.kind].append(run.predicted_n / run.predicted_ms * 1000)
                    say(f"  {prompt.kind}: {per_prompt[mode][prompt.kind][-1]:.1f} tokens/s")
    results = []
    for mode in modes:
        medians = {kind: statistics.median(v) for kind, v in per_prompt[mode].items()}
        drafted = sum(x.draft_n for x in runs[mode])
        results.append(
            ModeResult(
                mode,
                statistics.geometric_mean(medians.values()),
                medians,
                sum(x.draft_accepted for x in runs[mode]) / drafted if drafted else None,
            )
        )
    key = SpecKey.of(info.path, spec_devices(inventory, caps), caps)
    now = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    return SpecMeasurement(key, tuple(results), now, tokens)


def measure_and_store(
    info: ModelInfo,
    inventory: Inventory,
    caps: Capabilities,
    binary: Path,
    *,
    store: Path,
    work_dir: Path,
    **options: object,
) -> tuple[SpecMeasurement, Path]:
    """``measure``, then store the result where the planner looks for it; return it and its file."""
    measurement = measure(info, inventory, caps, binary, work_dir=work_dir, **options)  # type: ignore[arg-type]
    return measurement, spec_measurements.save(store, measurement)


@contextmanager
def _serving(
    launch: LaunchPlan, caps: Capabilities, binary: Path, work_dir: Path, mode: str
) -> Iterator[tuple[str, dict[str, str]]]:
    """Run ``launch``'s llama-server until the block ends; yield its URL and auth headers."""
    command = build_command(launch, caps, binary=binary, files_root=work_dir)
    server = command.server(work_dir / f"llama-server-{mode}.log", host=HOST)
    server.start()
    try:
        server.wait_ready(timeout=START_TIMEOUT)
        yield server.url, command.auth_headers
    finally:
        server.stop()


def _complete(client: httpx.Client, prompt: str, tokens: int) -> _Run:
    resp = client.post(
        "/completion",
        json={"prompt": prompt, "n_predict": tokens, "temperature": 0, "ignore_eos": True, "cache_prompt": False},
    )
    resp.raise_for_status()
    t = resp.json()["timings"]
    return _Run(
        int(t["predicted_n"]), float(t["predicted_ms"]), int(t.get("draft_n") or 0), int(t.get("draft_n_accepted") or 0)
    )
