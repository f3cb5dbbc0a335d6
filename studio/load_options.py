"""The load options, each defined once: name, type, bounds, help text, default, and where it shows.

``OPTIONS`` is the one definition; every face of a load option is derived from its row:

- the config file's ``[models.NAME]`` tables, read through the pydantic model ``options_model`` builds
  (``studio.settings``);
- the load API's body (``/api/load``, ``/api/plan``) and ``/api/load-options`` (``studio.http.gui.gui_api``);
- ``ggstudio plan`` and ``ggstudio load``'s options (``studio.cli.common.with_load_options``);
- the planner's request (``studio.residency.requests``, through ``Option.plan``).

The rows are plain data and the pydantic model is built from them where pydantic is loaded anyway (the API,
a config file's tables): every CLI command builds its options at start-up, and ``serve`` starts its first
llama-server before it imports pydantic. Adding an option is a row here, the planner rule that uses it and
its test. ``OptionValues`` holds the values a request, a config table or a load's settings set. The config
file's own keys are rows of the same kind (``studio.settings.CONFIG_KEYS``), read by ``config_problems``.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Literal, Self

if TYPE_CHECKING:
    from pydantic import BaseModel

#: A value's type. Beyond the load options' kinds, the config file's own keys take ``port`` and ``size`` (an
#: integer or a string the row's check reads), ``sizes`` (a size, or a table of sizes), ``map`` (names to
#: strings), ``table`` (one sub-table of the row's ``table`` rows) and ``tables`` (named sub-tables of them).
Kind = Literal["int", "number", "bool", "text", "texts", "choice", "port", "size", "sizes", "map", "table", "tables"]

#: What a wrong value must be, by kind, unless the row says it otherwise.
_MUST = {
    "int": "{name} must be an integer from {least:.0f} to {most:.0f}",
    "number": "{name} must be a number from {least:g} to {most:g}",
    "bool": "{name} must be true or false",
    "text": "{name} must be a string",
    "texts": "{name} must be a list of strings",
    "choice": "{name} must be one of {choices}",
    "port": "{name} must be a port number (1-65535), not {value!r}",
    "size": '{name} must be a size such as "2GiB"',
    "sizes": '{name} must be a size such as "2GiB" or a table of sizes',
    "map": "{name} must map names to strings",
    "table": "[{name}] must be a table",
    "tables": "[{name}] must hold one table each: [{name}.NAME]",
}


@dataclass(frozen=True)
class Option:
    """One load option (or one key of the config file) and every face it has."""

    name: str
    kind: Kind
    help: str  # what it does
    default: str  # what leaving it out means, in words
    least: float | None = None
    most: float | None = None
    max_length: int | None = None
    #: ``module:NAME`` of the values a ``choice`` takes (read when needed: the launcher's planning modules are
    #: slow to import, and a CLI command that does not load needs none of them)
    choices: str | None = None
    #: the config file's check beyond the type: the value as kept, or ``ValueError`` saying what is wrong (the
    #: load API leaves these to the planner, which refuses with its own error)
    check: Callable[[Any], Any] | None = None
    wrong: str | None = None  # what a config error says, where the kind's wording does not say it
    api: bool = True  # in the load API's body and on the command line; False: the config file only
    cli: str | None = ""  # the command line's flag: "" for --NAME-with-dashes, None for none
    #: the planner request's field(s) it sets; ``"sampling"``: a sampling default; None: not the planner's
    plan: str | tuple[str, ...] | None = None
    restart: bool = True  # False: it shapes the model's lifetime, and a change never restarts it
    embedding: bool = False  # a model's embedding instance takes it from the config table too
    #: the config file's own keys (``studio.settings.CONFIG_KEYS``): the value leaving it out gives (the load
    #: options have none: theirs depends on the model), the rows of its sub-table(s), what an unknown key in
    #: them is told (default: the known keys), and the environment variable that overrides it
    value: Any = field(default=None, compare=False)
    table: tuple[Option, ...] = ()
    unknown: str | None = None
    env: str | None = None
    env_sep: str = ","  # a ``texts`` key's separator in its variable
    #: an ``int`` key that also takes a fraction, read as the whole number below it: only the keys b5a9904 took
    #: fractions for (``max_resident``, ``group_size``), so that every file it read is still read
    floors: bool = False

    @property
    def flag(self) -> str | None:
        """The command line's flag, or None."""
        if self.cli is None or not self.api:
            return None
        return self.cli or "--" + self.name.replace("_", "-")

    @property
    def described(self) -> str:
        """The help text with what leaving the option out means."""
        return f"{self.help} (default: {self.default})."

    def allowed(self) -> tuple[Any, ...]:
        """The values a ``choice`` (or a checked text) takes; () for none."""
        if self.choices is None:
            return ()
        module, name = self.choices.split(":")
        return tuple(getattr(importlib.import_module(module), name))

    def must(self, value: Any, *, name: str | None = None) -> str:
        """What a config file is told about a wrong ``value``; ``name``: what to call the key (a variable)."""
        text = self.wrong or _MUST[self.kind]
        told = text.format(
            name=name or self.name,
            value=value,
            least=self.least or 0,
            most=self.most or 0,
            choices=", ".join(self.allowed()),
        )
        if self.kind == "int" and isinstance(value, float):  # TOML's float, where an integer is asked for
            within = (self.least is None or value >= self.least) and (self.most is None or value <= self.most)
            return f"{told}, not {value!r}" + (f": write {value:.0f}" if value.is_integer() and within else "")
        return told


def joined(subject: str, text: str) -> str:
    """``text`` about ``subject``: "ttl must be ..." where it is a predicate, else "spec: unknown mode ..."."""
    return f"{subject} {text}" if text.startswith(("must ", "holds ")) else f"{subject}: {text}"


def _spec(value: str) -> str:
    from launcher.speculative import SpeculativeConfigError, normalize_mode

    try:
        return normalize_mode(value)
    except SpeculativeConfigError as exc:
        raise ValueError(str(exc)) from None


def _chat_template(value: str) -> str:
    from launcher.chat_templates import check_chat_template

    if problem := check_chat_template(value):
        raise ValueError(problem)
    return value


def _projector(value: str) -> str:
    return value if value.strip().lower() in ("none", "") else str(Path(value).expanduser())


def _sampling(name: str, kind: Kind, least: float, most: float, help: str) -> Option:
    default = "the GGUF's general.sampling keys, else llama-server's"
    return Option(name, kind, help, default, least=least, most=most, api=False, plan="sampling")


OPTIONS: tuple[Option, ...] = (
    Option(
        "n_ctx",
        "int",
        "Context size in tokens",
        "the config's, or the largest that fits",
        least=256,
        # no real model has a context above 16M tokens (Llama 4 Scout's 10M is the largest): a bigger one is a typo
        most=1 << 24,
        cli="--ctx",
        plan="n_ctx",
    ),
    Option(
        "n_parallel",
        "int",
        "Server slots",
        "the config's, else 4 on a unified KV cache (1 for an embedding instance)",
        least=1,
        most=64,
        cli="--parallel",
        plan="n_parallel",
    ),
    Option(
        "extra_args",
        "texts",
        "Extra llama-server flags",
        "the last ones, or the config's",
        cli=None,
        plan="extra_args",
    ),
    Option(
        "spec",
        "text",
        "Speculative mode: auto, mtp, ngram, mtp+ngram, off, ngram-simple",
        "the config's, or auto",
        choices="launcher.speculative:MODES",
        check=_spec,
        wrong="{name} must be a string, one of: {choices}",
        plan="spec",
    ),
    Option(
        "spec_n_max",
        "int",
        "Drafted tokens per step",
        "the config's, or the policy's",
        least=1,
        most=64,
        cli="--n-max",
        plan="spec_n_max",
    ),
    Option(
        "cache_type_kv",
        "choice",
        "KV cache type for K and V: f16, q8_0, q4_0... (quantized types need flash attention)",
        "the config's, or f16",
        choices="launcher.memory:CACHE_TYPES",
        wrong="{name}: unknown cache type {value!r}; valid: {choices}",
        cli="--cache-type",
        plan=("cache_type_k", "cache_type_v"),
        embedding=True,
    ),
    Option(
        "cache_ram",
        "int",
        "MiB of llama-server's prompt cache (--cache-ram), on the model's bill; 0: off",
        "the config's, or the planner's: two copies of the KV cache, bounded by free memory",
        least=0,
        most=1 << 20,
        plan="cache_ram_mib",
    ),
    Option(
        "ttl",
        "number",
        "Seconds idle before the model is unloaded (0: never)",
        "the config's, or the studio's ttl",
        least=0,
        most=365 * 86400,
        cli=None,
        restart=False,
    ),
    Option("pinned", "bool", "Never evict this model", "the config's, or not pinned", cli=None, restart=False),
    Option(
        "mmproj",
        "text",
        'A multimodal projector .gguf to load with the model, or "none"',
        "the config's, or the projector the library pairs with the model",
        check=_projector,
        wrong='{name} must be the path of a projector .gguf, or "none"',
    ),
    Option(
        "threads",
        "int",
        "CPU threads",
        "the config's, or the usable cores divided among the models on the CPU",
        least=1,
        most=1024,
        plan="threads",
        embedding=True,
    ),
    Option(
        "threads_batch",
        "int",
        "Prompt-processing threads",
        "the config's, or the same as threads",
        least=1,
        most=1024,
        plan="threads_batch",
        embedding=True,
    ),
    Option(
        "flash_attn",
        "choice",
        "Flash attention: on, off or auto (a quantized cache needs on or auto)",
        "the config's, or on when the cache type needs it, else auto",
        choices="launcher.memory:FLASH_ATTN",
        plan="flash_attn",
        embedding=True,
    ),
    Option(
        "context_shift",
        "bool",
        "Past the context, drop the oldest tokens instead of answering with an error",
        "the config's, or off",
        cli="--context-shift/--no-context-shift",
        plan="context_shift",
    ),
    Option(
        "chat_template",
        "text",
        "A chat template instead of the model's own: a llama.cpp built-in's name (chatml, llama3, command-r, ...) "
        "or Jinja text",
        "the config's, or the model's own",
        max_length=256 * 1024,
        check=_chat_template,
        wrong="{name} must be a llama.cpp built-in template's name or Jinja text",
        plan="chat_template",
    ),
    Option(
        "jinja",
        "bool",
        "Render chat templates with Jinja; false: llama-server's built-in renderer (--no-jinja), which refuses "
        "requests with tools",
        "the config's, or Jinja unless chat_template names a built-in",
        cli="--jinja/--no-jinja",
        plan="jinja",
    ),
    Option(
        "thinking",
        "bool",
        "Start with thinking on or off; a request's enable_thinking still wins",
        "the template's default; off for Qwen3.5/3.6 under 9B",
        api=False,
        plan="thinking",
    ),
    Option(
        "tags",
        "texts",
        "Labels GET /models lists with the model (llama-server's --tags)",
        "none",
        api=False,
        restart=False,
    ),
    _sampling("temperature", "number", 0.0, 5.0, "Sampling temperature a request's own value overrides"),
    _sampling("top_p", "number", 0.0, 1.0, "Top-p a request's own value overrides"),
    _sampling("top_k", "int", 0, 1_000_000, "Top-k a request's own value overrides"),
    _sampling("min_p", "number", 0.0, 1.0, "Min-p a request's own value overrides"),
    _sampling("repeat_penalty", "number", 0.0, 10.0, "Repeat penalty a request's own value overrides"),
    Option(
        "max_tokens",
        "int",
        "An answer's token limit when its request sets none (never past the context)",
        "the studio's max_tokens, else 4096",
        least=1,
        most=1 << 24,
        api=False,
        plan="sampling",
    ),
    Option(
        "max_seconds",
        "number",
        "The wall-clock limit of one generation, seconds (0: none)",
        "the studio's max_seconds, else 600",
        least=0,
        most=7 * 86400,
        api=False,
        plan="sampling",
    ),
)

#: Each option by name.
BY_NAME: Mapping[str, Option] = MappingProxyType({o.name: o for o in OPTIONS})


def api_options(options: Iterable[Option] = OPTIONS) -> tuple[Option, ...]:
    """The options a load request may carry (the API's body, the command line)."""
    return tuple(o for o in options if o.api)


class OptionValues:
    """The load options one source sets (a request, a config table, a load's settings), read as attributes.

    An option left out reads as ``None``. Equal values compare equal, which is how a load's settings tell
    whether a model must restart.
    """

    __slots__ = ("values",)
    values: Mapping[str, Any]

    def __init__(self, **values: Any) -> None:
        unknown = [k for k in values if k not in BY_NAME]
        if unknown:
            raise TypeError(f"{type(self).__name__}: no load option named {', '.join(unknown)}")
        object.__setattr__(self, "values", MappingProxyType({k: v for k, v in values.items() if v is not None}))

    @classmethod
    def of(cls, values: Mapping[str, Any]) -> Self:
        """Values checked already (an extended table's included), the unset ones left out."""
        made = cls.__new__(cls)
        object.__setattr__(made, "values", MappingProxyType({k: v for k, v in values.items() if v is not None}))
        return made

    def __getattr__(self, name: str) -> Any:
        values = object.__getattribute__(self, "values")
        if name in values:
            return values[name]
        if name in BY_NAME:
            return None
        raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"{type(self).__name__} is frozen")

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and dict(self.values) == dict(other.values)

    def __hash__(self) -> int:
        return hash(tuple(sorted((k, repr(v)) for k, v in self.values.items())))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in self.values.items())})"

    def replace(self, **changes: Any) -> Self:
        """These values with ``changes`` (None: unset)."""
        return self.of({**self.values, **changes})


# -- the pydantic model ----------------------------------------------------------------------------------


def options_model(options: Sequence[Option] = OPTIONS, *, name: str = "LoadOptions") -> type[BaseModel]:
    """The pydantic model of ``options``: each an optional field with its type, bounds and help, unknown ones
    refused. The API's body and the config file's tables are validated through it."""
    return _model(tuple(options), name)


_MODELS: dict[tuple[tuple[Option, ...], str], type[Any]] = {}


def _model(options: tuple[Option, ...], name: str) -> type[BaseModel]:
    if (options, name) not in _MODELS:
        from pydantic import ConfigDict, Field, create_model

        fields: dict[str, Any] = {
            o.name: (_type(o, name) | None, Field(default=None, description=o.described, **_bounds(o))) for o in options
        }
        _MODELS[options, name] = create_model(name, __config__=ConfigDict(extra="forbid"), **fields)
    return _MODELS[options, name]


def _type(option: Option, parent: str) -> Any:
    if option.kind == "choice":
        return Literal[option.allowed()]
    if option.kind in ("table", "tables"):
        table = _model(option.table, f"{parent}_{option.name}")
        return table if option.kind == "table" else dict[str, table]  # type: ignore[valid-type]
    if option.floors:  # the fraction is floored by ``_check``
        return int | float
    return {
        "int": int,
        "number": float,
        "bool": bool,
        "text": str,
        "texts": tuple[str, ...],
        "port": int | str | bool,  # false: none, as the file has always taken it
        "size": int | float | str,
        "sizes": int | float | str | dict[str, int | float | str],
        "map": dict[str, str],
    }[option.kind]


def _bounds(option: Option) -> dict[str, Any]:
    out: dict[str, Any] = {}
    whole = int if option.kind == "int" else float
    if option.least is not None:
        out["ge"] = whole(option.least)
    if option.most is not None:
        out["le"] = whole(option.most)
    if option.max_length is not None:
        out["max_length"] = option.max_length
    return out


def config_problems(table: Mapping[str, Any], options: Sequence[Option] = OPTIONS) -> tuple[dict[str, Any], list[str]]:
    """A config file's table read through the pydantic model of ``options`` (its sub-tables too): its values
    as kept (lists as tuples, checked values normalized), and what is wrong with it, each naming its table
    (e.g. ``[models.'m']``), its key and what to write. A key of the wrong type is left out of the values; one
    its check refuses keeps the value given, for the checks across keys that follow."""
    from pydantic import ValidationError

    given = _tuples(table)
    problems: list[str] = []
    # the model of the rows the table names: it refuses and takes what the whole one would, and a file without
    # [models] tables builds no load option's choices (which import the launcher's planning modules)
    model = options_model([o for o in options if o.name in given], name="ConfigTable")
    for _ in range(8):  # each round leaves out what the last refused; a table nests at most two deep
        try:
            values = model.model_validate(given, strict=True).model_dump(exclude_unset=True)
            break
        except ValidationError as exc:
            wrong: dict[tuple[Any, ...], str] = {}
            for error in exc.errors():
                path, problem = _explain(tuple(error["loc"]), tuple(options), given, "")
                wrong.setdefault(path, problem)  # once each, in the table's order
            problems += wrong.values()
            for path in wrong:
                _drop(given, path)
    else:  # pragma: no cover - each round drops at least one key
        raise AssertionError("config_problems did not settle")
    _check(values, tuple(options), "", problems)
    return values, problems


def _tuples(value: Any) -> Any:
    """TOML's lists as tuples, through every table (the strict model takes tuples)."""
    if isinstance(value, Mapping):
        return {k: _tuples(v) for k, v in value.items()}
    if isinstance(value, list):
        return tuple(_tuples(v) for v in value)
    return value


def _inside(where: str, name: str) -> str:
    """The name of table ``name`` within the table called ``where`` ("" at the top)."""
    return f"[{name}]" if not where else f"{where[:-1]}.{name}]"


def _explain(
    loc: tuple[Any, ...], options: tuple[Option, ...], given: Mapping[str, Any], where: str
) -> tuple[tuple[Any, ...], str]:
    """The key a pydantic error at ``loc`` is about (its path in the table) and what the file is told."""
    key = str(loc[0])
    rows = {o.name: o for o in options}
    row = rows.get(key)
    if row is None:
        return (key,), _unknown(key, rows, where)
    if row.kind == "table" and len(loc) > 1 and isinstance(given[key], Mapping):
        inner = _inside(where, key)
        if str(loc[1]) not in {o.name for o in row.table} and row.unknown:
            return (key, loc[1]), joined(inner, row.unknown)
        path, problem = _explain(loc[1:], row.table, given[key], inner)
        return (key, *path), problem
    if row.kind == "tables" and len(loc) > 1 and isinstance(given[key], Mapping):
        inner = f"{_inside(where, key)[:-1]}.{loc[1]!r}]"
        if len(loc) == 2:
            return (key, loc[1]), f"{inner} must be a table"
        path, problem = _explain(loc[2:], row.table, given[key][loc[1]], inner)
        return (key, loc[1], *path), problem
    problem = row.must(given[key])
    return (key,), joined(where, problem) if where and not problem.startswith("[") else problem


def _unknown(key: str, rows: Mapping[str, Option], where: str) -> str:
    import difflib

    near = difflib.get_close_matches(key, rows, n=1)
    hint = f"did you mean {near[0]!r}?" if near else f"known: {', '.join(sorted(rows))}"
    problem = f"unknown key {key!r} ({hint})"
    return f"{where}: {problem}" if where else problem


def _drop(table: dict[str, Any], path: tuple[Any, ...]) -> None:
    for step in path[:-1]:
        table = table[step]
    table.pop(path[-1], None)


def _check(values: dict[str, Any], options: tuple[Option, ...], where: str, problems: list[str]) -> None:
    """Each checked key's value as kept, or what is wrong with it (the check's own words); sub-tables too."""
    rows = {o.name: o for o in options}
    for key, value in list(values.items()):
        row = rows[key]
        if row.kind == "table" and value is not None:
            _check(value, row.table, _inside(where, key), problems)
        elif row.kind == "tables" and value is not None:
            for name, inner in value.items():
                _check(inner, row.table, f"{_inside(where, key)[:-1]}.{name!r}]", problems)
        if row.floors and isinstance(value, float):
            values[key] = value = math.floor(value)
        if row.check is None or value is None:
            continue
        try:
            values[key] = row.check(value)
        except ValueError as exc:
            problem = joined(key, str(exc))
            problems.append(joined(where, problem) if where else problem)  # the value stays for checks across keys


def describe(options: Sequence[Option] = OPTIONS) -> list[dict[str, Any]]:
    """Each option a load request may carry, for ``/api/load-options``: name, kind, bounds, values, help."""
    return [
        {
            "name": o.name,
            "kind": o.kind,
            "help": o.help,
            "default": o.default,
            **({"least": o.least, "most": o.most} if o.least is not None else {}),
            **({"values": list(o.allowed())} if o.choices else {}),
            **({"flag": o.flag} if o.flag else {}),
        }
        for o in api_options(options)
    ]
