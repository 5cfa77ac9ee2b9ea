"""Build a JobConfig from a TOML file and `--section.key value` overrides.

argparse can't give us what users of torchtitan-style configs expect here:
dotted keys layered over a TOML file, `--section.no_key` negation, errors that
suggest the nearest valid key, and type checks shared by TOML and CLI values.
So this is a small hand-written parser over the dataclass schema.
"""

from __future__ import annotations

import dataclasses
import difflib
import sys
import types
import typing
from typing import Any, Sequence

from titanlike.config.schema import JobConfig

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


class ConfigError(ValueError):
    """A bad configuration; its message is one sentence meant for the user."""


class HelpRequested(Exception):
    """`--help` was given; the message is the help text."""


_TRUE = {"true", "1", "yes", "on"}
_FALSE = {"false", "0", "no", "off"}


def _sections() -> dict[str, type]:
    hints = typing.get_type_hints(JobConfig)
    return {f.name: hints[f.name] for f in dataclasses.fields(JobConfig)}


def _fields(section_cls: type) -> dict[str, tuple[dataclasses.Field, Any]]:
    hints = typing.get_type_hints(section_cls)
    return {f.name: (f, hints[f.name]) for f in dataclasses.fields(section_cls)}


def _nearest(name: str, candidates: Sequence[str]) -> str:
    close = difflib.get_close_matches(name, list(candidates), n=1, cutoff=0.5)
    return f"; did you mean '{close[0]}'?" if close else ""


def _unwrap_optional(tp: Any) -> tuple[Any, bool]:
    args = typing.get_args(tp)
    if typing.get_origin(tp) in (typing.Union, types.UnionType) and type(None) in args:
        rest = [a for a in args if a is not type(None)]
        return rest[0], True
    return tp, False


def _type_name(tp: Any) -> str:
    base, optional = _unwrap_optional(tp)
    name = "list" if typing.get_origin(base) is list else getattr(base, "__name__", str(base))
    return name + ("?" if optional else "")


def _convert(where: str, value: Any, tp: Any, choices: tuple[str, ...] | None) -> Any:
    """Coerce a TOML value or a CLI string to the field's type, or raise ConfigError."""
    base, optional = _unwrap_optional(tp)
    if optional and (value is None or (isinstance(value, str) and value.lower() in ("", "none"))):
        return None
    if typing.get_origin(base) is list:
        if isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]
        if not isinstance(value, list):
            raise ConfigError(f"{where} must be a list, got {value!r}")
        return [_convert(where, v, typing.get_args(base)[0], choices) for v in value]
    if base is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in _TRUE | _FALSE:
            return value.lower() in _TRUE
        raise ConfigError(f"{where} must be true or false, got {value!r}")
    if base is int:
        if isinstance(value, bool):
            raise ConfigError(f"{where} must be an integer, got {value!r}")
        try:
            if isinstance(value, float) and not value.is_integer():
                raise ValueError
            return int(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{where} must be an integer, got {value!r}") from None
    if base is float:
        if isinstance(value, bool):
            raise ConfigError(f"{where} must be a number, got {value!r}")
        try:
            return float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{where} must be a number, got {value!r}") from None
    if base is str:
        if not isinstance(value, (str, int, float)) or isinstance(value, bool):
            raise ConfigError(f"{where} must be a string, got {value!r}")
        value = str(value)
        if choices and value not in choices:
            raise ConfigError(
                f"{where} must be one of {', '.join(choices)}, got {value!r}{_nearest(value, choices)}"
            )
        return value
    raise TypeError(f"unsupported config field type {tp!r} for {where}")  # a schema bug, not user error


def _lookup(section: str, key: str) -> tuple[dataclasses.Field, Any]:
    sections = _sections()
    if section not in sections:
        raise ConfigError(f"unknown config section '{section}'{_nearest(section, list(sections))}")
    fields = _fields(sections[section])
    if key not in fields:
        # A key that exists verbatim in another section was most likely misplaced.
        misplaced = [s for s, cls in sections.items() if key in _fields(cls)]
        if misplaced:
            hint = f"; did you mean '{misplaced[0]}.{key}'?"
        else:
            hint = _nearest(key, list(fields))
            hint = hint.replace("'", f"'{section}.", 1) if hint else ""
        raise ConfigError(f"unknown config key '{section}.{key}'{hint}")
    return fields[key]


def _split_cli(argv: Sequence[str]) -> list[tuple[str, str, Any]]:
    """Turn argv into (section, key, raw value) triples; raw value None marks a bare flag."""
    out: list[tuple[str, str, Any]] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--") or "." not in arg:
            raise ConfigError(
                f"unexpected argument {arg!r}; options look like --section.key value (see --help)"
            )
        name, eq, inline = arg[2:].partition("=")
        section, _, key = name.partition(".")
        negated = False
        if key.startswith("no_") and section in _sections():
            real = key[3:]
            if real in _fields(_sections()[section]) and key not in _fields(_sections()[section]):
                key, negated = real, True
        _, tp = _lookup(section, key)
        raw, i = _take_value(argv, i, section, key, tp, negated=negated, eq=eq, inline=inline)
        out.append((section, key, raw))
    return out


def _take_value(argv: Sequence[str], i: int, section: str, key: str, tp: Any, *, negated: bool, eq: str,
                inline: str) -> tuple[Any, int]:
    """The raw value of the option at argv[i] and the index after it (None-free: a bare flag is True)."""
    is_bool = _unwrap_optional(tp)[0] is bool
    if negated:
        if not is_bool:
            raise ConfigError(f"--{section}.no_{key} only applies to true/false options")
        if eq:
            raise ConfigError(f"--{section}.no_{key} takes no value")
        return False, i + 1
    if eq:
        return inline, i + 1
    if is_bool:
        nxt = argv[i + 1] if i + 1 < len(argv) else None
        if nxt is not None and nxt.lower() in _TRUE | _FALSE:
            return nxt, i + 2
        return True, i + 1
    if i + 1 >= len(argv) or (argv[i + 1].startswith("--") and "." in argv[i + 1]):
        raise ConfigError(f"--{section}.{key} needs a value")
    return argv[i + 1], i + 2


def parse_section_options(argv: Sequence[str], section: str, section_cls: type) -> tuple[Any, list[str]]:
    """Take the `--<section>.key` options of a tool's own section (a dataclass outside JobConfig,
    e.g. the estimator's [estimate]) out of argv, with the job options' conventions; returns the
    section and the remaining arguments (for load_job_config)."""
    fields = _fields(section_cls)
    prefix = f"--{section}."
    values: dict[str, Any] = {}
    rest: list[str] = []
    argv = list(argv)
    i = 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith(prefix):
            rest.append(arg)
            i += 1
            continue
        name, eq, inline = arg[len(prefix):].partition("=")
        negated = name.startswith("no_") and name[3:] in fields and name not in fields
        key = name[3:] if negated else name
        if key not in fields:
            hint = _nearest(key, list(fields)).replace("'", f"'{section}.", 1)
            raise ConfigError(f"unknown option --{section}.{key}{hint}")
        field_, tp = fields[key]
        raw, i = _take_value(argv, i, section, key, tp, negated=negated, eq=eq, inline=inline)
        values[key] = _convert(f"{section}.{key}", raw, tp, field_.metadata.get("choices"))
    return section_cls(**values), rest


def _read_toml(path: str) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {path} is not valid TOML: {e}") from None


def load_job_config(argv: Sequence[str] | None = None) -> JobConfig:
    """Parse argv (default sys.argv[1:]): TOML file first, then CLI overrides in order."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "-h" in argv or "--help" in argv:
        raise HelpRequested(help_text())
    overrides = _split_cli(argv)
    values: dict[str, dict[str, Any]] = {}
    config_file = [v for s, k, v in overrides if (s, k) == ("job", "config_file")]
    if config_file:
        toml = _read_toml(config_file[-1])
        for section, table in toml.items():
            if not isinstance(table, dict):
                raise ConfigError(
                    f"top-level key '{section}' in {config_file[-1]} must be a [section] table"
                )
            for key, value in table.items():
                _lookup(section, key)
                values.setdefault(section, {})[key] = value
    for section, key, value in overrides:
        values.setdefault(section, {})[key] = value

    sections = _sections()
    built = {}
    for section, cls in sections.items():
        kwargs = {}
        for key, value in values.get(section, {}).items():
            field_, tp = _lookup(section, key)
            kwargs[key] = _convert(f"{section}.{key}", value, tp, field_.metadata.get("choices"))
        built[section] = cls(**kwargs)
    return JobConfig(**built)


def help_text() -> str:
    lines = [
        "usage: train.py [--job.config_file FILE] [--section.key VALUE ...]",
        "",
        "Options come from a TOML file (--job.config_file) and are overridden by the command line.",
        "Booleans: --section.key, --section.key=false or --section.no_key. Lists: comma-separated.",
    ]
    for section, cls in _sections().items():
        lines += ["", section_help(section, cls)]
    return "\n".join(lines)


def section_help(section: str, section_cls: type, *, title: str = "") -> str:
    """The help lines of one section: each option, its type, default and doc."""
    lines = [f"[{section}]" + (f"  {title}" if title else "")]
    for key, (field_, tp) in _fields(section_cls).items():
        default = field_.default if field_.default is not dataclasses.MISSING else field_.default_factory()
        choices = field_.metadata.get("choices")
        doc = field_.metadata.get("doc", "")
        if choices:
            doc += f" ({' | '.join(choices)})"
        lines.append(f"  --{section}.{key} ({_type_name(tp)}, default {default!r})")
        lines.append(f"      {doc}")
    return "\n".join(lines)


def config_to_dict(cfg: JobConfig) -> dict[str, Any]:
    return dataclasses.asdict(cfg)
