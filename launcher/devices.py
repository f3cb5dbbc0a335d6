"""Which devices a llama-server child could run on, and how much memory each has free.

Sources, each optional and bounded by a timeout: ``nvidia-smi`` (NVIDIA),
``rocm-smi`` (AMD), ``llama-server --list-devices`` (whatever backends the build
has: Vulkan, Metal, SYCL...), and psutil for the CPU and system RAM. A source that
is missing is silent; one that fails, hangs or prints something unreadable is
skipped with a warning in the result, never an exception: the CPU entry is
always there, so a broken driver tool cannot stop the studio from serving.
RPC workers (``launcher.rpc``) add their devices after the local GPUs, in the
``--rpc`` order; a worker that does not answer is left out with a warning.

When the binary is given and its listing reads, that listing decides which
vendor-tool GPUs are kept: it reflects both the build and the driver, for any
binary, studio-built or not. A GPU whose backend it does not list could take no
layers, so it is left out with one warning per backend (the studio's build
marker, when there is one, says which build it is). An unknown binary filters
nothing.

GPU indices are physical (nvidia-smi's / rocm-smi's own numbering) after applying
the visibility masks the child would inherit, since those are what the child must
be pinned to. CUDA reads ``CUDA_VISIBLE_DEVICES`` left to right and stops at the
first entry it cannot use; the same rule is applied to the ROCm masks.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import psutil

from launcher.build import built_backend
from launcher.capabilities import ProbeError, run_tool
from launcher.rpc import RpcWorkers, WorkerReport, report_warnings, with_worker_indices
from launcher.units import MIB

Source = Literal["nvidia-smi", "rocm-smi", "llama-server", "psutil", "rpc"]

TOOL_TIMEOUT_S = 5.0
NVIDIA_QUERY = (
    "--query-gpu=index,uuid,name,memory.total,memory.free",
    "--format=csv,noheader,nounits",
)
ROCM_QUERY = ("--showproductname", "--showmeminfo", "vram", "--showuniqueid", "--json")
# "  CUDA0: NVIDIA H100 80GB HBM3 (81079 MiB, 80488 MiB free)" (common_print_available_devices)
_LISTED_DEVICE = re.compile(r"^\s+(?P<name>\S+): (?P<desc>.*) \((?P<total>\d+) MiB, (?P<free>\d+) MiB free\)$")
#: AMD GPU targets that only integrated GPUs have (APUs, sharing the system's memory), as rocm-smi's "GFX Version"
#: names them: Strix Halo (gfx1151), Strix / Krackan Point (gfx1150, gfx1152), Phoenix / Hawk Point (gfx1103),
#: Rembrandt / Raphael / Mendocino (gfx1035-gfx1037), Van Gogh (gfx1033), Renoir / Cezanne (gfx90c), Raven (gfx902,
#: gfx909). No discrete card uses one of these targets.
AMD_APU_TARGETS = frozenset(
    {
        "gfx1151",
        "gfx1150",
        "gfx1152",
        "gfx1103",
        "gfx1035",
        "gfx1036",
        "gfx1037",
        "gfx1033",
        "gfx90c",
        "gfx902",
        "gfx909",
    }
)
# Backends a vendor tool already reports, by the tool that reports them.
_COVERED_BY: dict[str, Source] = {"CUDA": "nvidia-smi", "ROCm": "rocm-smi", "HIP": "rocm-smi"}


@dataclass(frozen=True)
class Device:
    """One device and its memory in bytes."""

    backend: str  # ggml's backend name: "CUDA", "ROCm", "Vulkan", "Metal", "CPU"..., "RPC" for a worker's
    index: int | None  # physical index to pin to; a llama-server-only device: its backend ordinal; RPC: ``RPC<n>``
    name: str
    total_bytes: int
    free_bytes: int
    source: Source
    uuid: str | None = None
    #: What a plan may use here, set by whoever shares the device among several models (a memory budget,
    #: less what resident models hold); None: the planner's share of ``free_bytes``.
    budget_bytes: int | None = None
    endpoint: str | None = None  # an RPC device's worker, host:port
    worker_index: int | None = None  # an RPC device's index on its worker
    #: The CPU: the physical cores this process may run on (``usable_cores``), which the planner divides among
    #: the resident models; None: not counted (a hand-made inventory), and llama-server gets them all.
    cores: int | None = None
    #: An integrated GPU (an AMD APU) whose "VRAM" is a carve-out of system memory; only rocm-smi tells.
    integrated: bool = False

    @property
    def key(self) -> str:
        """A stable name for the physical device: ``CPU``, ``CUDA0``, ``ROCm1``..., ``RPC0[host:port]``."""
        if self.endpoint is not None:  # ``RPC<n>`` shifts with the workers that answer; the buffer name does not
            return f"RPC{self.worker_index}[{self.endpoint}]"
        return "CPU" if self.backend == "CPU" else f"{self.backend}{self.index if self.index is not None else ''}"

    @property
    def rpc_buffer_name(self) -> str | None:
        """What llama-server calls an RPC device's buffers, ``RPC<i>[host:port]``; None for a local device."""
        return self.key if self.endpoint is not None else None


@dataclass(frozen=True)
class Inventory:
    """Every device found, and why any source was skipped."""

    devices: tuple[Device, ...]  # GPUs first, then RPC workers' devices, the CPU last
    warnings: tuple[str, ...]
    workers: tuple[WorkerReport, ...] = ()  # every configured RPC worker, answering or not

    @property
    def gpus(self) -> tuple[Device, ...]:
        """The local GPUs (and other local accelerators)."""
        return tuple(d for d in self.devices if d.backend not in ("CPU", "RPC"))

    @property
    def rpc(self) -> tuple[Device, ...]:
        """The devices of the RPC workers that answered, in llama-server's ``RPC<n>`` order."""
        return tuple(d for d in self.devices if d.backend == "RPC")

    @property
    def cpu(self) -> Device:
        return self.devices[-1]


class _Unreadable(Exception):
    """A tool's output did not have the expected shape."""


def discover(
    *,
    llama_server: Path | None = None,
    env: Mapping[str, str] | None = None,
    timeout: float = TOOL_TIMEOUT_S,
    workers: RpcWorkers | None = None,
) -> Inventory:
    """Return the devices visible under ``env`` (default: this process's environment), and ``workers``' devices."""
    env = dict(os.environ if env is None else env)
    warnings: list[str] = []
    found: list[Device] = []
    worked: set[Source] = set()
    tools: list[tuple[Source, Callable[[str], list[Device]], Sequence[str]]] = [
        ("nvidia-smi", parse_nvidia_smi, NVIDIA_QUERY),
        ("rocm-smi", parse_rocm_smi, ROCM_QUERY),
    ]
    for tool, parse, args in tools:
        exe = shutil.which(tool, path=env.get("PATH", os.defpath))
        if exe is None:
            continue
        devices = _read(tool, [exe, *args], parse, env, timeout, warnings)
        if devices is not None:
            worked.add(tool)
            found += _visible_nvidia(devices, env, warnings) if tool == "nvidia-smi" else _visible_amd(devices, env)
    if llama_server is not None:
        listed = _read(
            "llama-server", [str(llama_server), "--list-devices"], parse_list_devices, env, timeout, warnings
        )
        if listed is not None:
            found = _reachable(found, listed, built_backend(llama_server), warnings)
            found += [d for d in listed if _COVERED_BY.get(d.backend) not in worked]
    reports = workers.query() if workers is not None else ()
    warnings += report_warnings(reports)
    return Inventory((*found, *rpc_devices(reports), _cpu()), tuple(warnings), reports)


def rpc_devices(reports: Sequence[WorkerReport]) -> list[Device]:
    """The answering workers' devices as inventory devices, numbered as llama-server numbers them."""
    return [
        Device("RPC", n, d.endpoint, d.total_bytes, d.free_bytes, "rpc", endpoint=d.endpoint, worker_index=d.index)
        for n, d in with_worker_indices([r for r in reports if r.usable])
    ]


def _reachable(vendor: list[Device], listed: list[Device], built: str | None, warnings: list[str]) -> list[Device]:
    """Return the vendor-tool GPUs whose backend the binary lists; warn once per backend it lacks.

    Planning on a GPU the binary cannot use would pin it, count layers on it that
    stay on the CPU, and size the context for memory the child never gets.
    """
    listed_by = {_COVERED_BY.get(d.backend) for d in listed}
    missing = [d for d in vendor if d.source not in listed_by]
    for source in dict.fromkeys(d.source for d in missing):
        gpus = [d for d in missing if d.source == source]
        warnings.append(_unreachable_warning(source, gpus[0].backend, len(gpus), built))
    return [d for d in vendor if d.source in listed_by]


def _unreachable_warning(source: Source, backend: str, count: int, built: str | None) -> str:
    """Say which GPUs are left out and the fix: another build, or the driver when the build is right."""
    wanted = backend.lower()  # ggml's "CUDA" / "ROCm" are the pin's "cuda" / "rocm" backends
    rebuild = (
        f"to use them, run `ggstudio build-llama --backend {wanted}`: the studio then runs that build "
        "(unless LLAMA_SERVER_PATH names another)"
    )
    if built == wanted:
        has, fix = (
            f"(a {built} build) lists no {backend} device (its {backend} runtime cannot reach the GPUs)",
            "check the driver; `llama-server --list-devices` shows what it sees",
        )
    elif built is not None:
        has, fix = f"has no {backend} backend (a {built} build)", rebuild
    else:
        has, fix = f"lists no {backend} device (built without {backend}, or its runtime cannot reach the GPUs)", rebuild
    gpus = f"{count} GPU{'s' if count > 1 else ''}"
    return f"{source} sees {gpus}, but this llama-server {has}: the plan leaves the {backend} GPUs out; {fix}"


def _read(
    source: Source,
    argv: list[str],
    parse: Callable[[str], list[Device]],
    env: dict[str, str],
    timeout: float,
    warnings: list[str],
) -> list[Device] | None:
    """Run one source; return its devices, or None with a warning when it is broken."""
    try:
        result = run_tool(argv, timeout=timeout, env=env)
        if result.exit_code != 0 and not _no_devices(source, result.stdout):
            raise _Unreadable(f"exited with code {result.exit_code}: {_first_line(result.stdout + result.stderr)}")
        return parse(result.stdout)
    except (ProbeError, _Unreadable) as exc:
        warnings.append(f"{source} skipped: {exc}")
    return None


def _no_devices(source: Source, stdout: str) -> bool:
    """nvidia-smi exits 6 with this message when the driver works but sees no GPU."""
    return source == "nvidia-smi" and "No devices were found" in stdout


def _first_line(text: str) -> str:
    return next((line.strip() for line in text.splitlines() if line.strip()), "(no output)")[:200]


def parse_nvidia_smi(text: str) -> list[Device]:
    """Read ``nvidia-smi --query-gpu=index,uuid,name,memory.total,memory.free`` CSV (MiB, no header)."""
    if "No devices were found" in text:
        return []
    devices = []
    for line in filter(str.strip, text.splitlines()):
        fields = [f.strip() for f in line.split(",")]
        if len(fields) != 5 or not all(f.isdigit() for f in (fields[0], fields[3], fields[4])):
            raise _Unreadable(f"unexpected line {line[:120]!r}")
        index, uuid, name, total, free = fields
        devices.append(Device("CUDA", int(index), name, int(total) * MIB, int(free) * MIB, "nvidia-smi", uuid))
    return devices


def parse_rocm_smi(text: str) -> list[Device]:
    """Read ``rocm-smi --showproductname --showmeminfo vram --showuniqueid --json``."""
    try:
        data = json.loads(text[text.index("{") :])  # some versions print warnings before the JSON
    except ValueError as exc:
        raise _Unreadable(f"not JSON: {_first_line(text)}") from exc
    devices = []
    for card, fields in sorted(data.items(), key=lambda kv: _card_number(kv[0])):
        if not card.startswith("card"):
            continue  # e.g. "system"
        info = {str(k).lower(): str(v) for k, v in fields.items()}
        try:
            total = int(info["vram total memory (b)"])
            used = int(info["vram total used memory (b)"])
        except (KeyError, ValueError) as exc:
            raise _Unreadable(f"{card} has no readable VRAM totals") from exc
        name = info.get("card series") or info.get("card model") or card
        uid = info.get("unique id")
        uuid = f"GPU-{uid.removeprefix('0x')}" if uid and uid.startswith("0x") else None
        apu = info.get("gfx version", "").strip().lower() in AMD_APU_TARGETS
        devices.append(Device("ROCm", _card_number(card), name, total, total - used, "rocm-smi", uuid, integrated=apu))
    return devices


def _card_number(card: str) -> int:
    return int(card[4:]) if card[4:].isdigit() else -1


def parse_list_devices(text: str) -> list[Device]:
    """Read ``llama-server --list-devices`` (it leaves out CPU devices; "(none)" when no other)."""
    lines = text.splitlines()
    if "Available devices:" not in lines:
        raise _Unreadable(f"no device list in its output: {_first_line(text)}")
    devices = []
    for line in lines[lines.index("Available devices:") + 1 :]:
        if match := _LISTED_DEVICE.match(line):
            backend = re.sub(r"\d+$", "", match["name"])
            ordinal = match["name"][len(backend) :]
            devices.append(
                Device(
                    backend,
                    int(ordinal) if ordinal else None,
                    match["desc"],
                    int(match["total"]) * MIB,
                    int(match["free"]) * MIB,
                    "llama-server",
                )
            )
    return devices


def visible(devices: Sequence[Device], mask: str | None) -> list[Device]:
    """Apply a ``*_VISIBLE_DEVICES`` mask: positions or UUIDs, stopping at the first unusable entry.

    Unusable: empty (so a trailing comma ends the list and "" hides every GPU), out of
    range, negative ("-1" is the usual way to hide all), an unknown or ambiguous UUID,
    or a device already listed.
    """
    if mask is None:
        return list(devices)
    chosen: list[Device] = []
    for entry in mask.split(","):
        device = _match(entry.strip(), devices)
        if device is None or device in chosen:
            break
        chosen.append(device)
    return chosen


def _match(entry: str, devices: Sequence[Device]) -> Device | None:
    if entry.isdigit():
        return devices[int(entry)] if int(entry) < len(devices) else None
    wanted = entry.lower().removeprefix("gpu-")
    if not wanted:
        return None
    # CUDA also takes a unique UUID prefix.
    hits = [d for d in devices if d.uuid and d.uuid.lower().removeprefix("gpu-").startswith(wanted)]
    return hits[0] if len(hits) == 1 else None


def _visible_nvidia(devices: list[Device], env: Mapping[str, str], warnings: list[str]) -> list[Device]:
    mask = env.get("CUDA_VISIBLE_DEVICES")
    if (
        mask
        and any(e.strip().isdigit() for e in mask.split(","))
        and len({d.name for d in devices}) > 1
        and env.get("CUDA_DEVICE_ORDER") != "PCI_BUS_ID"
    ):
        warnings.append(
            "CUDA_VISIBLE_DEVICES uses indices but CUDA_DEVICE_ORDER is not PCI_BUS_ID: CUDA may "
            "number these mixed GPUs differently from nvidia-smi; pin by UUID to be sure"
        )
    return visible(devices, mask)


def _visible_amd(devices: list[Device], env: Mapping[str, str]) -> list[Device]:
    """ROCR_VISIBLE_DEVICES filters first; HIP_VISIBLE_DEVICES (else CUDA_VISIBLE_DEVICES) indexes what is left."""
    devices = visible(devices, env.get("ROCR_VISIBLE_DEVICES"))
    return visible(devices, env.get("HIP_VISIBLE_DEVICES", env.get("CUDA_VISIBLE_DEVICES")))


def usable_cores() -> int:
    """Physical cores this process may run on (llama.cpp's own default ignores CPU affinity and cgroups)."""
    allowed = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    physical = psutil.cpu_count(logical=False) or allowed
    return max(1, min(physical, allowed))


def _cpu() -> Device:
    memory = psutil.virtual_memory()
    return Device("CPU", None, _cpu_name(), memory.total, memory.available, "psutil", cores=usable_cores())


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return os.uname().machine


#: How long a stop waits for the driver to release a GPU's memory (the reference backend's bound).
RELEASE_WAIT_S = 2.0
#: A change of free memory between two reads below max(this, RELEASE_SETTLED_FRACTION of the reading) is settled:
#: a desktop GPU's free memory jitters by a few MiB (a compositor, a browser), so it is rarely exactly still.
RELEASE_SETTLED_BYTES = 256 * MIB
RELEASE_SETTLED_FRACTION = 0.02


def wait_for_memory_release(
    read_free: Callable[[], Mapping[str, int]],
    *,
    timeout: float = RELEASE_WAIT_S,
    interval: float = 0.25,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> bool:
    """Wait until the free memory ``read_free`` reports has settled; return False on timeout.

    A GPU driver frees a killed process's memory a little after the process is
    reaped; a plan made in between would see too little free memory. Two
    successive reads settle when no device's free memory moved by more than
    max(256 MiB, 2 %), the reference backend's tolerance; a release of a model's
    buffers moves it by far more. The caller waits right after the reap, so every
    wait lies within the reference's 15 s of the kill.
    """
    deadline = clock() + timeout
    last = dict(read_free())
    while clock() < deadline:
        sleep(interval)
        now = dict(read_free())
        if now.keys() == last.keys() and all(_settled(last[k], now[k]) for k in now):
            return True
        last = now
    return False


def _settled(before: int, after: int) -> bool:
    """Whether free memory moving from ``before`` to ``after`` bytes is jitter rather than a release."""
    return abs(after - before) < max(RELEASE_SETTLED_BYTES, RELEASE_SETTLED_FRACTION * max(before, after))


def free_memory_of(uuids: Sequence[str], *, llama_server: Path | None = None) -> Callable[[], dict[str, int]]:
    """Return a reader of the free bytes of the GPUs with ``uuids`` (for ``wait_for_memory_release``)."""

    def read() -> dict[str, int]:
        gpus = discover(llama_server=llama_server).gpus
        return {d.uuid: d.free_bytes for d in gpus if d.uuid is not None and d.uuid in uuids}

    return read
