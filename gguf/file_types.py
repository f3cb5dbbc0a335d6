"""``general.file_type`` ids (llama.cpp's ``llama_ftype``): their names, and llama.cpp's guess when a file has none."""

from __future__ import annotations

from collections.abc import Sequence

from gguf.reader import TensorInfo
from gguf.tensor_layout import layer_of

# llama_ftype id -> (short label, llama.cpp's llama_ftype_name()).
_FILE_TYPES: dict[int, tuple[str, str]] = {
    0: ("F32", "all F32"),
    1: ("F16", "F16"),
    2: ("Q4_0", "Q4_0"),
    3: ("Q4_1", "Q4_1"),
    7: ("Q8_0", "Q8_0"),
    8: ("Q5_0", "Q5_0"),
    9: ("Q5_1", "Q5_1"),
    10: ("Q2_K", "Q2_K - Medium"),
    11: ("Q3_K_S", "Q3_K - Small"),
    12: ("Q3_K_M", "Q3_K - Medium"),
    13: ("Q3_K_L", "Q3_K - Large"),
    14: ("Q4_K_S", "Q4_K - Small"),
    15: ("Q4_K_M", "Q4_K - Medium"),
    16: ("Q5_K_S", "Q5_K - Small"),
    17: ("Q5_K_M", "Q5_K - Medium"),
    18: ("Q6_K", "Q6_K"),
    19: ("IQ2_XXS", "IQ2_XXS - 2.0625 bpw"),
    20: ("IQ2_XS", "IQ2_XS - 2.3125 bpw"),
    21: ("Q2_K_S", "Q2_K - Small"),
    22: ("IQ3_XS", "IQ3_XS - 3.3 bpw"),
    23: ("IQ3_XXS", "IQ3_XXS - 3.0625 bpw"),
    24: ("IQ1_S", "IQ1_S - 1.5625 bpw"),
    25: ("IQ4_NL", "IQ4_NL - 4.5 bpw"),
    26: ("IQ3_S", "IQ3_S - 3.4375 bpw"),
    27: ("IQ3_M", "IQ3_S mix - 3.66 bpw"),
    28: ("IQ2_S", "IQ2_S - 2.5 bpw"),
    29: ("IQ2_M", "IQ2_M - 2.7 bpw"),
    30: ("IQ4_XS", "IQ4_XS - 4.25 bpw"),
    31: ("IQ1_M", "IQ1_M - 1.75 bpw"),
    32: ("BF16", "BF16"),
    36: ("TQ1_0", "TQ1_0 - 1.69 bpw ternary"),
    37: ("TQ2_0", "TQ2_0 - 2.06 bpw ternary"),
    38: ("MXFP4_MOE", "MXFP4 MoE"),
    39: ("NVFP4", "NVFP4"),
    40: ("Q1_0", "Q1_0"),
    41: ("Q2_0", "Q2_0"),
}
# The file type llama.cpp guesses from the most common tensor type when general.file_type is absent.
_GUESSED_FILE_TYPE: dict[str, int] = {
    "F32": 0,
    "F16": 1,
    "BF16": 32,
    "Q4_0": 2,
    "Q4_1": 3,
    "Q5_0": 8,
    "Q5_1": 9,
    "Q8_0": 7,
    "Q2_K": 10,
    "Q3_K": 12,
    "Q4_K": 15,
    "Q5_K": 17,
    "Q6_K": 18,
    "TQ1_0": 36,
    "TQ2_0": 37,
    "IQ2_XXS": 19,
    "IQ2_XS": 20,
    "IQ2_S": 28,
    "IQ3_XXS": 23,
    "IQ1_S": 24,
    "IQ1_M": 31,
    "IQ4_NL": 25,
    "IQ4_XS": 30,
    "IQ3_S": 26,
    "NVFP4": 39,
    "Q1_0": 40,
    "Q2_0": 41,
}


def file_type_names(file_type: int) -> tuple[str, str]:
    """Return (short label, llama.cpp description) of a ``general.file_type`` id."""
    return _FILE_TYPES.get(file_type, ("unknown", "unknown, may not work"))


def guess_file_type(tensors: Sequence[TensorInfo]) -> int:
    """llama.cpp's guess: the most common tensor type, ties going to the first to reach the count."""
    counts: dict[str, int] = {}
    best, best_count = "F32", 0
    for t in sorted(tensors, key=lambda t: (layer_of(t.name), t.name)):
        name = t.ggml_type.name
        counts[name] = counts.get(name, 0) + 1
        if counts[name] > best_count:
            best, best_count = name, counts[name]
    return _GUESSED_FILE_TYPE.get(best, 0)
