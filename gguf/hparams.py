"""The hyper-parameters of one model as llama.cpp holds them (``llama_hparams``), while its facts are derived.

``gguf.arch_rules`` fills an ``HParams`` the way llama.cpp's loaders do;
``gguf.facts_builder`` turns it into the public ``ModelFacts``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


class HParams:
    """The hyper-parameters llama.cpp loads, under its names (``llama_hparams``), filled by ``gguf.arch_rules``."""

    def __init__(self) -> None:
        self.n_ctx_train = 0
        self.n_embd = 0
        self.n_layer_all = 0
        self.n_layer_nextn = 0
        self.n_expert = 0
        self.n_expert_used: list[int] = []
        self.n_head: list[int] = []
        self.n_head_kv: list[int] = []
        self.n_ff: list[int] = []
        self.n_embd_head_k = 0
        self.n_embd_head_v = 0
        self.n_embd_head_k_swa = 0
        self.n_embd_head_v_swa = 0
        self.k_mla = 0
        self.v_mla = 0
        self.n_lora_kv = 0
        self.n_lora_kv_swa = 0
        self.k_mla_swa = 0
        self.v_mla_swa = 0
        self.swa_type = 0
        self.n_swa = 0
        self.is_swa: list[bool] = []
        self.is_recr: list[bool] = []
        self.n_layer_kv_from_start = -1
        self.shared_kv_layers = 0
        self.full_attention_interval: int | None = None
        self.ssm = [0, 0, 0, 0, 0]  # conv_kernel, inner_size, state_size, time_step_rank, group_count
        self.n_expert_shared = 0
        self.rope_scaling_type = "linear"
        self.rope_scaling_factor = 0.0
        self.n_ctx_orig_yarn = 0
        self.rope_freq_base = 10000.0
        self.wkv_head_size = 0
        self.token_shift_count = 2
        self.shortconv_l_cache = 0
        self.n_embd_head_kda = 0
        self.n_embd_head_la = 0
        self.compress_ratios: list[int] = []

    @property
    def n_layer(self) -> int:
        """Blocks of the main forward pass (MTP blocks excluded)."""
        return self.n_layer_all - self.n_layer_nextn

    def set_swa_pattern(self, n_pattern: int, dense_first: bool = False) -> None:
        """Every ``n_pattern``-th layer is dense (0: all SWA); MTP layers are dense."""
        flags: list[bool] = []
        for il in range(self.n_layer_all):
            if il >= self.n_layer:
                flags.append(False)
            elif n_pattern == 0:
                flags.append(True)
            elif dense_first:
                flags.append(il % n_pattern != 0)
            else:
                flags.append(il % n_pattern < n_pattern - 1)
        self.is_swa = flags

    def n_embd_r(self) -> int:
        """Rolling (conv / token-shift) state floats per sequence and recurrent layer (llama.cpp ``n_embd_r``)."""
        if self.wkv_head_size:
            return self.token_shift_count * self.n_embd
        if self.shortconv_l_cache:
            return self.n_embd * (self.shortconv_l_cache - 1)
        if self.n_embd_head_kda:
            d_inner = (self.n_head[0] if self.n_head else 0) * self.n_embd_head_kda
            return 3 * (self.ssm[0] - 1 if self.ssm[0] > 0 else 3) * d_inner
        d_conv, d_inner, d_state, _, n_group = self.ssm
        return (d_conv - 1 if d_conv > 0 else 0) * (d_inner + 2 * n_group * d_state)

    def n_embd_s(self) -> int:
        """Recurrent (SSM / WKV / linear-attention) state floats per sequence and layer (llama.cpp ``n_embd_s``)."""
        n_head0 = self.n_head[0] if self.n_head else 0
        if self.wkv_head_size:
            return self.n_embd * self.wkv_head_size
        if self.n_embd_head_kda:
            return self.n_embd_head_kda * self.n_embd_head_kda * n_head0
        if self.n_embd_head_la:
            return self.n_embd_head_la * self.n_embd_head_la * n_head0
        return self.ssm[2] * self.ssm[1]


def array_into(flags: list[bool], values: Sequence[int]) -> list[bool]:
    """llama.cpp's get_arr into a per-layer array: the array's values, the rest unchanged."""
    out = list(flags)
    for i, v in enumerate(values[: len(out)]):
        out[i] = v != 0
    return out


@dataclass
class LoadContext:
    """What one facts load collects besides the hyper-parameters: the tensors, notes, and whether it guessed."""

    tensors: Sequence[Any]
    notes: list[str]
    approximate: list[bool]

    def guess(self, note: str) -> None:
        """Record ``note`` and mark the facts approximate."""
        self.notes.append(note)
        self.approximate[0] = True
