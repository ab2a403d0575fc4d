"""Command-line flags generated from config dataclass fields.

Each option is declared once, as a field of a config dataclass with its help text
(``config.opt``). Here a field becomes the flag ``--field-name``: a boolean as
``--x/--no-x``, ``int | None`` as an int flag whose absence means None, choices from the
field's ``choices`` metadata (the validation constants), extra option strings from its
``short`` / ``aliases`` metadata. ``detserve generate``, ``detserve serve`` and
``benchmarks/bench_offline.py`` build their engine flags with ``add_engine_flags``, so the
three agree on names and defaults.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from collections.abc import Iterable, Mapping
from dataclasses import MISSING, dataclass
from typing import Any

from detserve.config import CacheConfig, EngineConfig, SamplerConfig, SchedulerConfig

# the engine's options, as ``EngineConfig.create`` takes them flat (the nested configs'
# fields by their own names; the scheduler's mode is the engine's)
ENGINE_CONFIGS: tuple[type, ...] = (EngineConfig, SchedulerConfig, CacheConfig, SamplerConfig)
# ``EngineConfig.create`` chooses these when given None (the flag's default)
_CREATE_DEFAULTS: Mapping[str, Any] = {"num_blocks": None, "max_model_len": None}


@dataclass(frozen=True)
class Option:
    """One config field as a command-line option."""

    name: str
    type: type             # bool, int, float or str
    optional: bool         # None is a value (absent from the command line: None)
    default: Any
    help: str
    choices: tuple[Any, ...] | None = None
    aliases: tuple[str, ...] = ()

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    def check(self, value: Any) -> None:
        """Raise ValueError naming the option unless ``value`` has its type (None never:
        an absent option is its default)."""
        t = self.type
        ok = (isinstance(value, bool) if t is bool
              else isinstance(value, (int, float)) and not isinstance(value, bool) if t is float
              else isinstance(value, t) and not isinstance(value, bool))
        if not ok:
            raise ValueError(f"{self.name} must be a {t.__name__}, got {value!r}")
        if self.choices is not None and value not in self.choices:
            raise ValueError(f"{self.name} must be one of {', '.join(map(str, self.choices))}; "
                             f"got {value!r}")


def options(cls: type, skip: Iterable[str] = ()) -> dict[str, Option]:
    """The options of ``cls``'s fields that carry help text, by name (nested configs and
    ``skip`` left out). Raises TypeError for a field type no flag can take."""
    hints = typing.get_type_hints(cls)
    skipped = set(skip)
    out: dict[str, Option] = {}
    for f in dataclasses.fields(cls):
        if f.name in skipped or "help" not in f.metadata:
            continue
        base, optional = _base_type(hints[f.name])
        # ``cli_default``: the flag's default where it differs from the field's (a value
        # that ``EngineConfig.create`` resolves, such as dtype "auto")
        default = (f.metadata["cli_default"] if "cli_default" in f.metadata
                   else None if f.default is MISSING else f.default)
        aliases = tuple(a for a in (f.metadata.get("short"), *f.metadata.get("aliases", ()))
                        if a)
        out[f.name] = Option(f.name, base, optional, default, f.metadata["help"],
                             f.metadata.get("choices"), aliases)
    return out


def engine_options(skip: Iterable[str] = ()) -> dict[str, Option]:
    """Every engine option, as ``EngineConfig.create`` takes them (``max_model_len`` None:
    the model's; ``num_blocks`` None: chosen from ``max_model_len``)."""
    out: dict[str, Option] = {}
    for cls in ENGINE_CONFIGS:
        for name, o in options(cls, skip).items():
            if name in _CREATE_DEFAULTS:
                o = dataclasses.replace(o, default=_CREATE_DEFAULTS[name], optional=True)
            out.setdefault(name, o)  # (the scheduler's mode: the engine's)
    return out


def add_flags(parser: argparse.ArgumentParser | argparse._ArgumentGroup,
              opts: Mapping[str, Option], defaults: Mapping[str, Any] | None = None) -> None:
    """One flag per option; ``defaults`` replaces some defaults (a command's own)."""
    for name, o in opts.items():
        default = (defaults or {}).get(name, o.default)
        help_text = o.help.replace("%", "%%") + " (default: %(default)s)"
        names = (o.flag, *o.aliases)
        if o.type is bool:
            parser.add_argument(*names, dest=name, default=default, help=help_text,
                                action=argparse.BooleanOptionalAction)
        else:
            parser.add_argument(*names, dest=name, default=default, help=help_text,
                                type=o.type, choices=o.choices)


def add_engine_flags(parser: argparse.ArgumentParser, skip: Iterable[str] = (),
                     defaults: Mapping[str, Any] | None = None) -> None:
    """The engine's flags, in a group of their own."""
    group = parser.add_argument_group("engine options (EngineConfig)")
    add_flags(group, engine_options(skip), defaults)


def engine_kwargs(ns: argparse.Namespace | Mapping[str, Any],
                  skip: Iterable[str] = ("model",)) -> dict[str, Any]:
    """The engine options in ``ns`` (parsed flags or app args), for ``EngineConfig.create``
    (the model, by default, left out: it is positional there)."""
    values = vars(ns) if isinstance(ns, argparse.Namespace) else ns
    names = set(engine_options()) - set(skip)
    return {k: v for k, v in values.items() if k in names}


def _base_type(hint: Any) -> tuple[type, bool]:
    """(the flag's value type, whether None is allowed) of a field's type hint."""
    args = typing.get_args(hint)
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        rest = [a for a in args if a is not type(None)]
        if len(rest) != 1 or len(rest) == len(args):
            raise TypeError(f"unsupported option type {hint!r}")
        return _base_type(rest[0])[0], True
    if hint not in (bool, int, float, str):
        raise TypeError(f"unsupported option type {hint!r}")
    return hint, False
