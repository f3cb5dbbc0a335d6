"""ggml tensor types: block size and bytes per block, as the pinned llama.cpp knows them.

A tensor of ``n`` elements of type ``t`` occupies ``n // block_size * type_size``
bytes (``n`` along the first dimension is always a multiple of the block size).
Ids 4, 5 and 31-33, 36-38 were removed from ggml and are rejected.
"""

from __future__ import annotations

from dataclasses import dataclass

QK_K = 256


@dataclass(frozen=True)
class GGMLType:
    """One ggml tensor type."""

    id: int
    name: str
    block_size: int
    type_size: int

    @property
    def quantized(self) -> bool:
        """Stored in blocks of several values (llama.cpp's ``ggml_is_quantized``)."""
        return self.block_size > 1

    def nbytes(self, n_elements: int) -> int:
        """Return the bytes ``n_elements`` of this type occupy."""
        return n_elements // self.block_size * self.type_size


_TABLE = [
    (0, "F32", 1, 4),
    (1, "F16", 1, 2),
    (2, "Q4_0", 32, 18),
    (3, "Q4_1", 32, 20),
    (6, "Q5_0", 32, 22),
    (7, "Q5_1", 32, 24),
    (8, "Q8_0", 32, 34),
    (9, "Q8_1", 32, 36),
    (10, "Q2_K", QK_K, 84),
    (11, "Q3_K", QK_K, 110),
    (12, "Q4_K", QK_K, 144),
    (13, "Q5_K", QK_K, 176),
    (14, "Q6_K", QK_K, 210),
    (15, "Q8_K", QK_K, 292),
    (16, "IQ2_XXS", QK_K, 66),
    (17, "IQ2_XS", QK_K, 74),
    (18, "IQ3_XXS", QK_K, 98),
    (19, "IQ1_S", QK_K, 50),
    (20, "IQ4_NL", 32, 18),
    (21, "IQ3_S", QK_K, 110),
    (22, "IQ2_S", QK_K, 82),
    (23, "IQ4_XS", QK_K, 136),
    (24, "I8", 1, 1),
    (25, "I16", 1, 2),
    (26, "I32", 1, 4),
    (27, "I64", 1, 8),
    (28, "F64", 1, 8),
    (29, "IQ1_M", QK_K, 56),
    (30, "BF16", 1, 2),
    (34, "TQ1_0", QK_K, 54),
    (35, "TQ2_0", QK_K, 66),
    (39, "MXFP4", 32, 17),
    (40, "NVFP4", 64, 36),
    (41, "Q1_0", 128, 18),
    (42, "Q2_0", 64, 18),
]

GGML_TYPES: dict[int, GGMLType] = {i: GGMLType(i, n, b, s) for i, n, b, s in _TABLE}
BY_NAME: dict[str, GGMLType] = {t.name: t for t in GGML_TYPES.values()}
