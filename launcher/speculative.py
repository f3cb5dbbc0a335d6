"""Pick llama-server's speculative-decoding flags for a model, a device and a binary.

Multi-token prediction (MTP) drafts with the model's own extra heads; ngram-mod
drafts from text already seen. What pays off was measured: MTP alone on a GPU
(2 drafted tokens), MTP chained with ngram-mod on a CPU (3), and for MTP models
under 3B parameters ngram-mod alone (MTP made them slower). Models without MTP
heads get llama-server's own ``--spec-default`` where the build has it.

That policy is a guess from published numbers; the winner varies by model,
device and workload. Where ``ggstudio bench-spec`` measured this model on these
devices with this binary (``launcher.spec_measurements``), ``auto`` takes the
measured winner instead, and says so.

A mode that would crash llama-server is never emitted: ``draft-mtp`` on a model
without MTP layers makes it exit while loading ("failed to create MTP context"),
so MTP is dropped for such models, with the reason recorded. A trunk-only file
(``nextn_predict_layers`` kept, the NextN tensors left out: ``gguf.facts.ModelFacts.
mtp_tensors``) fails the same way: ``auto`` leaves MTP out and says why, and a
mode that asks for MTP is refused before anything starts, with what to do.
Asking for MTP on a model under 3B parameters works but draws a warning, as the
reference backend gives: MTP was measured slower there than ngram-mod alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Literal, get_args

from launcher.capabilities import Capabilities
from launcher.errors import LauncherError

if TYPE_CHECKING:
    from gguf.facts import ModelFacts
    from launcher.spec_measurements import SpecMeasurement

SpecMode = Literal["auto", "mtp", "ngram", "mtp+ngram", "off", "ngram-simple"]
ResolvedMode = Literal["mtp", "ngram", "mtp+ngram", "off", "ngram-simple", "user"]
MODES: tuple[SpecMode, ...] = get_args(SpecMode)

_LEGACY_NAMES: dict[str, SpecMode] = {"default": "auto", "none": "off"}
_PARTS = {"mtp": "mtp", "draft-mtp": "mtp", "ngram": "ngram", "ngram-mod": "ngram"}
SMALL_MODEL_PARAMS = 3_000_000_000
GPU_MTP_N_MAX = 2
CPU_MTP_N_MAX = 3
# ngram-mod tuning: llama-server's own --spec-default values (lookup length, draft min/max).
NGRAM_N_MATCH, NGRAM_N_MIN, NGRAM_N_MAX = 24, 48, 64
#: llama.cpp's ngram-simple drafts up to its m-gram size (``ngram_simple.size_m``).
NGRAM_SIMPLE_N_MAX = 48


class SpeculativeConfigError(LauncherError, ValueError):
    """The requested speculative mode or draft length is not valid."""


@dataclass(frozen=True)
class SpecModel:
    """The few model facts the policy needs."""

    name: str  # file name, used only when the MTP layer count is unknown
    parameter_count: int
    nextn_layers: int | None = None  # None: facts unavailable
    mtp_tensors: bool = True  # the NextN tensors are in the file (False: a trunk-only file)

    @classmethod
    def from_facts(cls, facts: ModelFacts, path: Path) -> SpecModel:
        return cls(path.name, facts.parameter_count, facts.nextn_predict_layers, facts.mtp_tensors)

    @property
    def has_mtp(self) -> bool:
        if self.nextn_layers is not None:
            return self.nextn_layers > 0 and self.mtp_tensors
        return "-MTP" in self.name.upper()

    @property
    def trunk_only(self) -> bool:
        """The file declares MTP blocks but left their tensors out."""
        return bool(self.nextn_layers) and not self.mtp_tensors


@dataclass(frozen=True)
class SpecPlan:
    """The speculative flags to pass, and why."""

    requested: SpecMode
    resolved: ResolvedMode  # "user": the user's own --spec-type is in charge
    argv: tuple[str, ...]
    reasons: tuple[str, ...]
    #: The most tokens drafted per slot and step. llama-server sizes its logits for
    #: n_parallel x (1 + n_draft) outputs, which can dwarf the rest of the compute buffer.
    n_draft: int = 0
    #: The measurement ``auto`` followed (``ggstudio bench-spec``); None: the policy chose.
    measured: SpecMeasurement | None = field(default=None, compare=False)
    warnings: tuple[str, ...] = ()  # what works but is likely a mistake (MTP forced on a small model)


def normalize_mode(text: str) -> SpecMode:
    """Read a mode, accepting llama.cpp spellings (``draft-mtp,ngram-mod``, ``default``...).

    Raises:
        SpeculativeConfigError: not a mode; the message lists the valid ones.
    """
    word = text.strip().lower()
    if word in MODES:
        return word
    if word in _LEGACY_NAMES:
        return _LEGACY_NAMES[word]
    parts = {_PARTS.get(p.strip()) for p in word.replace("+", ",").split(",")}
    if parts == {"mtp"}:
        return "mtp"
    if parts == {"ngram"}:
        return "ngram"
    if parts == {"mtp", "ngram"}:
        return "mtp+ngram"
    raise SpeculativeConfigError(
        f"unknown speculative mode {text!r}; valid modes: {', '.join(MODES)} "
        "(llama.cpp spellings such as draft-mtp, ngram-mod or draft-mtp,ngram-mod work too)"
    )


def plan(
    requested: SpecMode | str,
    caps: Capabilities,
    model: SpecModel,
    *,
    on_gpu: bool,
    n_max: int | None = None,
    extra_args: Sequence[str] = (),
    measured: SpecMeasurement | None = None,
) -> SpecPlan:
    """Return the speculative flags for serving ``model`` with ``caps``' binary.

    ``n_max`` overrides the drafted-token count; a ``--spec-type`` or ``--spec-default``
    in ``extra_args`` wins and ours are left out. ``measured`` is what ``bench-spec``
    measured for this model, devices and binary: ``auto`` then takes its winner.

    Raises:
        SpeculativeConfigError: an unknown mode, ``n_max`` below 1, or a mode that asks for MTP on a
            trunk-only file.
    """
    mode = normalize_mode(requested)
    if n_max is not None and n_max < 1:
        raise SpeculativeConfigError(f"the draft length n_max must be at least 1, not {n_max}")
    user_flag = next(
        (a.split("=")[0] for a in extra_args if a.split("=")[0] in ("--spec-type", "--spec-default")), None
    )
    if user_flag:
        return SpecPlan(
            mode,
            "user",
            (),
            (f"{user_flag} in the extra arguments wins; no speculative flags added",),
            n_draft=NGRAM_N_MAX,
        )  # unknown: memory is planned for --spec-default's draft length
    reasons: list[str] = []
    if mode == "auto" and measured is not None:
        mtp, ngram, simple = _measured(measured, reasons)
    else:
        measured = None
        mtp, ngram, simple = _wanted(mode, model, on_gpu, reasons)
        if mode == "auto" and not (mtp or ngram):
            return _spec_default(caps, reasons, mode)
    if mtp and model.trunk_only:
        raise SpeculativeConfigError(
            f"spec = {mode} needs the model's MTP heads, but {model.name} is a trunk-only file: it declares "
            f"{model.nextn_layers} MTP block{'s' if model.nextn_layers != 1 else ''} without their NextN tensors "
            "(nextn.eh_proj), and llama-server would fail with 'failed to create MTP context'. Use the model's file "
            "that keeps the MTP heads, or spec = auto or ngram for this one."
        )
    if mtp and not model.has_mtp:
        mtp = False
        reasons.append(f"{model.name} has no MTP layers; llama-server would exit with 'failed to create MTP context'")
    if mtp and caps.mtp_type is None:
        mtp = False
        reasons.append(f"this llama-server has no MTP speculative type (it knows: {', '.join(caps.spec_types)})")
    if ngram and "ngram-mod" not in caps.spec_types:
        ngram = False
        reasons.append("this llama-server has no ngram-mod speculative type")
    if simple and "ngram-simple" not in caps.spec_types:
        simple = False
        reasons.append("this llama-server has no ngram-simple speculative type")
    if mode == "auto" and measured is None and not (mtp or ngram):
        return _spec_default(caps, reasons, mode)
    warnings = []
    if mtp and mode != "auto" and model.parameter_count < SMALL_MODEL_PARAMS:
        warnings.append(
            f"MTP asked for on a model under 3B parameters ({model.parameter_count / 1e9:.1f}B): it was measured "
            "slower there than ngram-mod alone, which spec = auto picks"
        )
    default_n = GPU_MTP_N_MAX if on_gpu else CPU_MTP_N_MAX
    argv, n_draft = _flags(caps, mtp=mtp, ngram=ngram, simple=simple, n_max=n_max, default_n=default_n, reasons=reasons)
    resolved: ResolvedMode = (
        "mtp+ngram" if mtp and ngram else "mtp" if mtp else "ngram" if ngram else "ngram-simple" if simple else "off"
    )
    return SpecPlan(mode, resolved, argv, tuple(reasons), n_draft=n_draft, measured=measured, warnings=tuple(warnings))


def _measured(measured: SpecMeasurement, reasons: list[str]) -> tuple[bool, bool, bool]:
    """Return (mtp, ngram-mod, ngram-simple) of the measured winner."""
    winner = measured.winner.mode
    reasons.append(f"auto -> {measured.summary()}")
    return "mtp" in winner, winner in ("ngram", "mtp+ngram"), winner == "ngram-simple"


def _wanted(mode: SpecMode, model: SpecModel, on_gpu: bool, reasons: list[str]) -> tuple[bool, bool, bool]:
    """Return (mtp, ngram-mod, ngram-simple) wanted for ``mode`` before the binary is consulted."""
    if mode != "auto":
        return "mtp" in mode, mode in ("ngram", "mtp+ngram"), mode == "ngram-simple"
    if model.trunk_only:
        reasons.append(
            "auto: the file declares MTP blocks but not their NextN tensors (a trunk-only file); no MTP, "
            "which llama-server would refuse"
        )
        return False, False, False
    if not model.has_mtp:
        reasons.append("auto: the model has no MTP layers")
        return False, False, False
    if model.parameter_count < SMALL_MODEL_PARAMS:
        reasons.append("auto: MTP model under 3B parameters; ngram-mod alone (MTP measured slower there)")
        return False, True, False
    if on_gpu:
        reasons.append(f"auto: MTP model on GPU; MTP alone, {GPU_MTP_N_MAX} drafted tokens")
        return True, False, False
    reasons.append(f"auto: MTP model on CPU; MTP chained with ngram-mod, {CPU_MTP_N_MAX} drafted tokens")
    return True, True, False


def _spec_default(caps: Capabilities, reasons: list[str], mode: SpecMode) -> SpecPlan:
    if caps.supports("--spec-default"):
        reasons.append("auto: llama-server's --spec-default (ngram-mod)")
        return SpecPlan(mode, "ngram", ("--spec-default",), tuple(reasons), n_draft=NGRAM_N_MAX)
    reasons.append("auto: this llama-server has no --spec-default; speculative decoding off")
    return SpecPlan(mode, "off", (), tuple(reasons))


def _flags(
    caps: Capabilities,
    *,
    mtp: bool,
    ngram: bool,
    simple: bool,
    n_max: int | None,
    default_n: int,
    reasons: list[str],
) -> tuple[tuple[str, ...], int]:
    """Spell the chosen types and their knobs the way this build wants them; also the longest draft they allow."""
    types = [t for t, on in ((caps.mtp_type, mtp), ("ngram-mod", ngram), ("ngram-simple", simple)) if on and t]
    if not types:
        return (), 0
    argv = ["--spec-type", ",".join(types)]
    drafts = [NGRAM_SIMPLE_N_MAX if simple else 0]
    draft_flag = caps.draft_n_max_flag
    if mtp:
        drafts.append(n_max or default_n)
        if draft_flag:
            argv += [draft_flag, str(n_max or default_n)]
        else:
            reasons.append("this llama-server has no draft n-max flag; its default draft length is used")
    if ngram:
        # The user's n_max is MTP's draft length when MTP runs; alone, ngram-mod's.
        ngram_max = n_max if n_max and not mtp else NGRAM_N_MAX
        drafts.append(ngram_max)
        ngram_min = min(NGRAM_N_MIN, ngram_max)
        if caps.ngram_style == "new":
            argv += [
                "--spec-ngram-mod-n-match",
                str(NGRAM_N_MATCH),
                "--spec-ngram-mod-n-min",
                str(ngram_min),
                "--spec-ngram-mod-n-max",
                str(ngram_max),
            ]
        elif caps.ngram_style == "legacy":
            argv += ["--spec-ngram-size-n", str(NGRAM_N_MATCH)]
            if mtp:  # one --draft-max is shared, and MTP's draft length matters more
                reasons.append("older llama-server: ngram-mod shares --draft-max with MTP")
            else:
                argv += ["--draft-min", str(ngram_min), "--draft-max", str(ngram_max)]
        else:
            reasons.append("this llama-server has no ngram-mod knobs; its defaults are used")
    if simple and n_max:
        reasons.append("n_max does not apply to ngram-simple; ignored")
    return tuple(argv), max(drafts)
