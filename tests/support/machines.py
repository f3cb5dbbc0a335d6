"""The made-up machines and requests the planning scripts plan for, so they compare like with like.

``scripts/predictions.py`` diffs plans across a refactor and ``scripts/bench_plan.py``
times them; both plan on these inventories (no GPU exists here, so the GPUs are
described, not probed) with these two requests.
"""

from __future__ import annotations

from launcher.devices import Device, Inventory
from launcher.planner import PlanRequest
from launcher.units import GIB, MIB

CPU = Device("CPU", None, "CPU", 64 * GIB, 48 * GIB, "psutil")
CPU_ONLY = Inventory((CPU,), ())
ONE_GPU = Inventory((Device("CUDA", 0, "GPU A", 24 * GIB, 20 * GIB, "nvidia-smi"), CPU), ())
#: Two GPUs too small for any zoo model, the first more free than the second: the layers are split.
TWO_SMALL_GPUS = Inventory(
    (
        Device("CUDA", 0, "GPU A", 8 * GIB, 60 * MIB, "nvidia-smi"),
        Device("CUDA", 1, "GPU B", 8 * GIB, 40 * MIB, "nvidia-smi"),
        CPU,
    ),
    (),
)
#: Eight GPUs with 100-800 MiB free, so the planner searches the sets of GPUs.
EIGHT_GPUS = Inventory(
    (*(Device("CUDA", i, f"GPU {i}", 8 * GIB, (i + 1) * 100 * MIB, "nvidia-smi") for i in range(8)), CPU), ()
)
#: (label, request): an automatic context; 4096 tokens in 2 slots with a q8_0 cache.
REQUESTS = (
    ("auto", PlanRequest()),
    ("c4096-np2-q8", PlanRequest(n_ctx=4096, n_parallel=2, cache_type_k="q8_0", cache_type_v="q8_0")),
)
