"""Read what llama-server actually allocated from its ``-lv 4`` log.

The result uses the estimator's own structures (``launcher.memory``), so a
prediction and a measurement compare field by field. The log prints MiB with
two decimals; the byte counts here are those MiB values times 2**20, so they are
exact only to that 0.01 MiB precision.

Buffer names map to devices the way the estimator names them: every host buffer
(``CPU``, ``CPU_Mapped``, ``CPU_REPACK``, ``CUDA_Host``...) is ``"CPU"``; a
device buffer ending in an index (``CUDA0``, ``ROCm1``, ``Vulkan0``, ``MTL0``) is
``"GPU<index>"``; an RPC worker's buffer keeps its own name, ``RPC<i>[host:port]``
(``i`` is the device's index on that worker), as the planner names it.

Each ``llama_context`` prints its own buffers after "constructing llama_context".
The MTP draft context (``--spec-type draft-mtp``) follows the target's after
"creating MTP draft context": its caches are labelled ``"MTP draft <label>"`` as
the estimator names them, its KV, compute and output buffers add to the
devices' totals. A context reserving its graph again (the draft does once its
backend samplers are set) resizes its one compute buffer: the last size counts.

A multimodal projector (``tools/mtmd/clip.cpp``) logs after the text model:
``clip_model_loader: model name:`` opens a projector file, ``clip_ctx: CLIP using
CPU backend`` one encoder context of it on that device (vision, then audio),
``load_hparams: model size`` the bytes of every tensor in the file (printed by
each encoder of a file with two; counted once: together they load them all), and
``reserve_compute_meta: <buffer> compute buffer size`` each context's warm-up
compute buffer (the last reservation counts). They go to ``MemoryBill.projector``
and to each device's ``projector``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from launcher.bill import CacheBill, DeviceBill, MemoryBill, ProjectorBill, RecurrentBill, StateBill
from launcher.units import MIB

_NUM = r"([\d.]+)"
_MODEL = re.compile(rf"load_tensors:\s+(\S+) model buffer size = +{_NUM} MiB")
_KV_CREATING = re.compile(r"creating\s+(.+?)\s+KV cache")
_KV_BUF = re.compile(rf"llama_kv_cache:\s+(\S+) KV buffer size = +{_NUM} MiB")
_KV_SIZE = re.compile(
    rf"llama_kv_cache: size = +{_NUM} MiB \( *(\d+) cells, +(\d+) layers, +(\d+)/(\d+) seqs\), "
    rf"K \((\w+)\): +{_NUM} MiB, V \((\w+)\): +{_NUM} MiB"
)
_RS_BUF = re.compile(rf"llama_memory_recurrent:\s+(\S+) RS buffer size = +{_NUM} MiB")
_RS_SIZE = re.compile(
    rf"llama_memory_recurrent: size = +{_NUM} MiB \( *(\d+) cells, +(\d+) layers, +(\d+) seqs +(\d+) rs_seq\), "
    rf"R \((\w+)\): +{_NUM} MiB, S \((\w+)\): +{_NUM} MiB"
)
_OUTPUT = re.compile(rf"llama_context:\s+(\S+) +output buffer size = +{_NUM} MiB")
_COMPUTE = re.compile(rf"sched_reserve:\s+(\S+) compute buffer size = +{_NUM} MiB")
_DSV4_STATE_BUF = re.compile(rf"llama_dsv4_comp_state:\s+(\S+) DSV4 \w+ state buffer size = +{_NUM} MiB")
_DSV4_STATE_SIZE = re.compile(
    rf"llama_dsv4_comp_state: (\w+) ratio = (\d+), state = (\d+) x (\d+), streams = (\d+), rs_seq = (\d+), "
    rf"layers = (\d+), size = +{_NUM} MiB"
)
_CLIP_FILE = "clip_model_loader: model name:"
_CLIP_CONTEXT = re.compile(r"clip_ctx: CLIP using (\S+) backend")
_CLIP_WEIGHTS = re.compile(rf"load_hparams: model size: +{_NUM} MiB")
_CLIP_COMPUTE = re.compile(rf"reserve_compute_meta:\s+(\S+) compute buffer size = +{_NUM} MiB")
_DEVICE_INDEX = re.compile(r"^[A-Za-z]+(\d+)$")
_RPC_BUFFER = re.compile(r"^RPC\d+\[[^\]]+\]$")
_NEW_CONTEXT = "llama_context: constructing llama_context"
_MTP_DRAFT = "creating MTP draft context"


def device_of(buffer_name: str) -> str:
    """The estimator's device name for a ggml buffer name."""
    if _RPC_BUFFER.match(buffer_name):
        return buffer_name
    m = _DEVICE_INDEX.match(buffer_name)
    return f"GPU{m.group(1)}" if m and not buffer_name.startswith("CPU") else "CPU"


def _bytes(mib: str) -> int:
    return round(float(mib) * MIB)


@dataclass
class _Device:
    weights: int = 0
    kv: int = 0
    recurrent: int = 0
    compute: int = 0
    output: int = 0
    projector: int = 0


def parse_allocations(log: str) -> MemoryBill:
    """Parse one llama-server load log into a bill; buffers never printed stay 0.

    Raises ``ValueError`` when the log holds no allocation at all (the server
    failed before loading the model, or ``-lv`` was below 4... nothing to compare).
    """
    devices: dict[str, _Device] = {}
    caches: list[CacheBill] = []
    recurrent: list[RecurrentBill] = []
    states: list[StateBill] = []
    label = "main"
    prefix = ""  # "MTP draft " once the draft context is being built
    context = 0
    compute: dict[tuple[int, str], int] = {}  # (context, buffer name): that compute buffer's latest size
    clip_weights: dict[int, tuple[str, int]] = {}  # projector file: (device, bytes)
    clip_compute: dict[tuple[int, str], int] = {}  # (clip context, buffer name): latest size
    clip_file = clip_context = 0
    clip_device = "CPU"
    seen = False

    def dev(name: str) -> _Device:
        return devices.setdefault(device_of(name), _Device())

    for line in log.splitlines():
        if _MTP_DRAFT in line:
            prefix = "MTP draft "
            continue
        if _NEW_CONTEXT in line:
            context += 1
            continue
        if _CLIP_FILE in line:
            clip_file += 1
            continue
        if m := _CLIP_CONTEXT.search(line):
            clip_context += 1
            clip_device = device_of(m.group(1))
            continue
        if m := _CLIP_WEIGHTS.search(line):
            clip_weights.setdefault(clip_file, (clip_device, _bytes(m.group(1))))
        elif m := _CLIP_COMPUTE.search(line):
            clip_compute[(clip_context, m.group(1))] = _bytes(m.group(2))
        elif m := _MODEL.search(line):
            dev(m.group(1)).weights += _bytes(m.group(2))
        elif m := _KV_CREATING.search(line):
            label = m.group(1).strip()
        elif m := _KV_BUF.search(line):
            dev(m.group(1)).kv += _bytes(m.group(2))
        elif m := _KV_SIZE.search(line):
            _, cells, layers, _, streams, kt, km, vt, vm = m.groups()
            caches.append(
                CacheBill(
                    label=prefix + label,
                    cells=int(cells),
                    streams=int(streams),
                    layers=int(layers),
                    k_type=kt,
                    v_type=vt,
                    k_bytes=_bytes(km),
                    v_bytes=_bytes(vm),
                )
            )
            label = "main"
        elif m := _RS_BUF.search(line):
            dev(m.group(1)).recurrent += _bytes(m.group(2))
        elif m := _RS_SIZE.search(line):
            _, cells, layers, _, rs_seq, _, rm, _, sm = m.groups()
            recurrent.append(
                RecurrentBill(
                    cells=int(cells),
                    rows=int(cells) * (1 + int(rs_seq)),
                    layers=int(layers),
                    r_bytes=_bytes(rm),
                    s_bytes=_bytes(sm),
                )
            )
        elif m := _DSV4_STATE_BUF.search(line):
            dev(m.group(1)).kv += _bytes(m.group(2))
        elif m := _DSV4_STATE_SIZE.search(line):
            name, ratio, rows, width, streams, rs_seq, layers, mib = m.groups()
            states.append(
                StateBill(
                    name=name,
                    ratio=int(ratio),
                    rows=int(rows),
                    width=int(width),
                    streams=int(streams),
                    rs_seq=int(rs_seq),
                    layers=int(layers),
                    nbytes=_bytes(mib),
                )
            )
        elif m := _OUTPUT.search(line):
            dev(m.group(1)).output += _bytes(m.group(2))
        elif m := _COMPUTE.search(line):
            compute[(context, m.group(1))] = _bytes(m.group(2))
        else:
            continue
        seen = True
    if not seen:
        raise ValueError("the log holds no llama-server allocation lines (was it run with -lv 4?)")
    for (_, name), nbytes in compute.items():
        dev(name).compute += nbytes
    projector = None
    if clip_weights or clip_compute:
        for device, nbytes in clip_weights.values():
            devices.setdefault(device, _Device()).projector += nbytes
        for (_, name), nbytes in clip_compute.items():
            dev(name).projector += nbytes
        first = next(iter(clip_weights.values()), (clip_device, 0))[0]
        projector = ProjectorBill(first, sum(n for _, n in clip_weights.values()), sum(clip_compute.values()))
    bills = tuple(
        DeviceBill(
            device=name,
            weights=d.weights,
            kv=d.kv,
            recurrent=d.recurrent,
            compute=d.compute,
            output=d.output,
            projector=d.projector,
        )
        for name, d in sorted(devices.items())
    )
    return MemoryBill(
        devices=bills,
        caches=tuple(caches),
        recurrent=tuple(recurrent),
        approximate=False,
        reasons=(),
        states=tuple(states),
        projector=projector,
    )
