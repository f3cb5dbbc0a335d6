"""The architecture traits registry against the pinned llama.cpp sources it describes."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import re
from pathlib import Path

from gguf import arch_traits
from gguf.arch_traits import DEFAULT_TRAITS, KNOWN_ARCHITECTURES, TRAITS, ArchTraits, architectures_with, traits_of


def _arch_names(llama_src: Path) -> dict[str, str]:
    """``LLM_ARCH_*`` enum name -> architecture name, from llama-arch.cpp's LLM_ARCH_NAMES."""
    text = (llama_src / "src" / "llama-arch.cpp").read_text()
    return dict(re.findall(r'\{\s*(LLM_ARCH_\w+),\s*"([^"]+)"\s*\}', text))


def _switch_cases(llama_src: Path, function: str) -> set[str]:
    """The architecture names a ``switch (arch)`` predicate of llama-arch.cpp lists before its first ``return``."""
    text = (llama_src / "src" / "llama-arch.cpp").read_text()
    body = text[text.index(f"bool {function}(") :]
    listed = body[: body.index("return")]
    names = _arch_names(llama_src)
    return {names[e] for e in re.findall(r"case (LLM_ARCH_\w+):", listed)}


def _archs_in(llama_src: Path, file: str, pattern: str) -> set[str]:
    """The architecture names tested on the first source line of ``file`` matching ``pattern``."""
    text = (llama_src / "src" / file).read_text()
    line = next(line for line in text.splitlines() if re.search(pattern, line))
    names = _arch_names(llama_src)
    return {names[e] for e in re.findall(r"LLM_ARCH_\w+", line)}


def test_known_architectures_are_llama_arch_cpps_names(llama_src):
    assert KNOWN_ARCHITECTURES == set(_arch_names(llama_src).values()) - {"(unknown)"}  # LLM_ARCH_UNKNOWN


def test_the_table_names_only_known_architectures_and_only_where_they_differ_from_the_default():
    assert set(TRAITS) <= KNOWN_ARCHITECTURES
    assert [arch for arch, traits in TRAITS.items() if traits == DEFAULT_TRAITS] == []


def test_an_architecture_the_table_does_not_name_gets_the_default():
    assert traits_of("llama") is DEFAULT_TRAITS
    assert traits_of("no-such-architecture") is DEFAULT_TRAITS
    assert traits_of("grok").flash_attn is False and traits_of("deepseek4").compressed_kv_cache is True


def test_rollback_and_mixed_batch_are_the_llama_arch_cpp_predicates(llama_src):
    assert set(architectures_with(lambda t: t.rs_rollback)) == _switch_cases(llama_src, "llm_arch_supports_rs_rollback")
    # llm_arch_supports_mixed_batch lists the architectures it returns false for
    assert set(architectures_with(lambda t: not t.mixed_batch_input)) == _switch_cases(
        llama_src, "llm_arch_supports_mixed_batch"
    )


def test_graph_and_context_checks_by_name_match_the_sources(llama_src):
    assert set(architectures_with(lambda t: t.moe_weight_before_ffn)) == _archs_in(
        llama_src, "llama-graph.cpp", r"const bool weight_before_ffn ="
    )
    assert set(architectures_with(lambda t: not t.flash_attn)) == _archs_in(
        llama_src, "llama-context.cpp", r"flash_attn_type != LLAMA_FLASH_ATTN_TYPE_DISABLED && model->arch =="
    )
    assert set(architectures_with(lambda t: t.kv_types_must_match)) == _archs_in(
        llama_src, "llama-context.cpp", r"is_mla\(\) \|\| model->arch ==.*type_k != params.type_v"
    )


def test_every_trait_has_a_docstring_saying_what_llama_cpp_does():
    tree = ast.parse(inspect.getsource(arch_traits))
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "ArchTraits")
    documented = {
        a.target.id
        for a, doc in zip(cls.body, cls.body[1:], strict=False)
        if isinstance(a, ast.AnnAssign)
        and isinstance(a.target, ast.Name)
        and isinstance(doc, ast.Expr)
        and isinstance(doc.value, ast.Constant)
        and isinstance(doc.value.value, str)
    }
    assert documented == {f.name for f in dataclasses.fields(ArchTraits)}
