"""Build a JobConfig from a TOML file and `--section.key value` overrides.

argparse can't give us what users of torchtitan-style configs expect here:
dotted keys layered over a TOML file, `--section.no_key` negation, errors that
suggest the nearest valid key, and type checks shared by TOML and CLI values.
So this is a small hand-written parser over the dataclass schema.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import sys
import types
import typing
from typing import Any, Sequence

from titanlike.config.compat import (
    FOREIGN_FLAGS,
    ITEM_ALIASES,
    SECTION_ALIASES,
    TORCHTITAN_KEYS,
    Alias,
    NotHere,
    Renamed,
    foreign_flag_hint,
)
from titanlike.config.schema import JobConfig
from titanlike.config.sections import RENAMED_SINCE, registered_sections, renamed_keys

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


logger = logging.getLogger(__name__)


class ConfigError(ValueError):
    """A bad configuration; its message is one sentence meant for the user."""


class HelpRequested(Exception):
    """`--help` was given; the message is the help text."""


_TRUE = {"true", "1", "yes", "on"}
_FALSE = {"false", "0", "no", "off"}


def _job_sections() -> dict[str, type]:
    """The sections every JobConfig has (its fields)."""
    hints = typing.get_type_hints(JobConfig)
    return {f.name: hints[f.name] for f in dataclasses.fields(JobConfig) if f.name != "registered"}


def config_sections() -> dict[str, type]:
    """Every section the loader reads, name -> its dataclass: JobConfig's, then those objectives and
    model families registered (titanlike/config/sections.py)."""
    return {**_job_sections(), **registered_sections()}


def _renamed(name: str) -> Renamed | None:
    """titanlike's own older spelling `name`, as registered with the section(s) now holding it."""
    targets = renamed_keys().get(name)
    if not targets:
        return None
    return Renamed(targets[0], RENAMED_SINCE, by="titanlike", also=tuple(targets[1:]))


def _fields(section_cls: type) -> dict[str, tuple[dataclasses.Field, Any]]:
    hints = typing.get_type_hints(section_cls)
    return {f.name: (f, hints[f.name]) for f in dataclasses.fields(section_cls)}


def _choices(field_: dataclasses.Field) -> tuple[str, ...] | None:
    """A field's allowed values: its tuple, or those its owners registered (schema.opt)."""
    choices = field_.metadata.get("choices")
    return choices() if callable(choices) else choices


def _edit_distance(a: str, b: str) -> int:
    """Levenshtein distance where swapping two neighbouring characters also counts as one edit."""
    prev2: list[int] = []
    prev = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        cur = [i]
        for j, cb in enumerate(b, 1):
            d = min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (ca != cb))
            if i > 1 and j > 1 and ca == b[j - 2] and a[i - 2] == cb:
                d = min(d, prev2[j - 2] + 1)
            cur.append(d)
        prev2, prev = prev, cur
    return prev[-1]


def near_certain(name: str, candidates: Sequence[str]) -> str | None:
    """The candidate that `name` is almost surely a typo of, or None.

    Only a match that differs by case, or by one edit (two for names of 8 or more characters),
    and is the only candidate that close: a suggestion that is merely similar (enable_checkpoint
    and create_seed_checkpoint share most letters) misleads more than no suggestion.
    """
    same_case = [c for c in candidates if c.lower() == name.lower()]
    if len(same_case) == 1:
        return same_case[0]
    limit = 1 if len(name) < 8 else 2
    scored = sorted((_edit_distance(name, c), c) for c in set(candidates))
    close = [c for d, c in scored if d <= limit and d == scored[0][0]]
    return close[0] if len(close) == 1 else None


def _nearest(name: str, candidates: Sequence[str]) -> str:
    close = near_certain(name, candidates)
    return f"; did you mean '{close}'?" if close else ""


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


MAX_INT = 2**53


def _shown(value: Any) -> str:
    """A value for a one-line message: its repr, shortened."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _convert(where: str, value: Any, tp: Any, choices: tuple[str, ...] | None) -> Any:
    """Coerce a TOML value or a CLI string to the field's type, or raise ConfigError."""
    base, optional = _unwrap_optional(tp)
    if optional and (value is None or (isinstance(value, str) and value.lower() in ("", "none"))):
        return None
    if base is dict or typing.get_origin(base) is dict:
        return _table(where, value)
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
            raise ConfigError(f"{where} must be an integer, got {_shown(value)}")
        try:
            if isinstance(value, float) and not value.is_integer():
                raise ValueError
            number = int(value)
        except (TypeError, ValueError, OverflowError):
            raise ConfigError(f"{where} must be an integer, got {_shown(value)}") from None
        # Every count, size or seed of a job fits 2^53 (floats hold it exactly): a larger one is a
        # typo or an attack, and would overflow a schedule, an ETA or a seed later.
        if abs(number) > MAX_INT:
            raise ConfigError(f"{where} must be an integer from -{MAX_INT} to {MAX_INT} (2^53), got {_shown(value)}")
        return number
    if base is float:
        if isinstance(value, bool):
            raise ConfigError(f"{where} must be a number, got {_shown(value)}")
        try:
            number = float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{where} must be a number, got {_shown(value)}") from None
        if not math.isfinite(number):  # no option of a job means anything by NaN or infinity
            raise ConfigError(f"{where} must be a finite number, got {_shown(value)}")
        return number
    if base is str:
        if not isinstance(value, (str, int, float)) or isinstance(value, bool):
            raise ConfigError(f"{where} must be a string, got {_shown(value)}")
        value = str(value)
        if "\0" in value:
            raise ConfigError(f"{where} must not contain a NUL character, got {_shown(value)}")
        if choices and value not in choices:
            raise ConfigError(
                f"{where} must be one of {', '.join(choices)}, got {value!r}{_nearest(value, choices)}"
            )
        return value
    raise TypeError(f"unsupported config field type {tp!r} for {where}")  # a schema bug, not user error


def _table(where: str, value: Any) -> dict[str, Any]:
    """A table option's value: a TOML table, or on the command line KEY=VALUE pairs separated by commas
    (`--model.args dim=512,n_layers=4`). Its keys and values are checked by the table's owner (the
    model family reads [model.args]); command-line values stay strings until the owner converts them."""
    if isinstance(value, dict):
        return dict(value)
    if not isinstance(value, str):
        raise ConfigError(f"{where} must be a table of KEY = VALUE settings, got {_shown(value)}")
    if "\0" in value:
        raise ConfigError(f"{where} must not contain a NUL character, got {_shown(value)}")
    table: dict[str, Any] = {}
    for item in (v.strip() for v in value.split(",")):
        key, eq, setting = item.partition("=")
        if not item:
            continue
        if not eq or not key.strip():
            raise ConfigError(f"{where} must be KEY=VALUE pairs separated by commas, got {_shown(value)}")
        table[key.strip()] = setting.strip()
    return table


@dataclasses.dataclass(frozen=True)
class _Option:
    """Where a key the user wrote lands: a schema field, or a torchtitan key titanlike does not hold."""

    spelled: str  # the dotted name as written
    section: str | None  # schema section and key; None for a NotHere key
    key: str | None
    tp: Any  # the value's type
    choices: tuple[str, ...] | None = None
    not_here: NotHere | None = None
    renamed: Renamed | None = None  # the older spelling it was written in, if any
    table_key: str | None = None  # a NotHere key's current torchtitan name
    entry: str | None = None  # one setting of a table option ([model.args] dim: "dim")

    @property
    def name(self) -> str:
        if self.entry is not None:
            return f"{self.section}.{self.key}.{self.entry}"
        return f"{self.section}.{self.key}" if self.section else self.table_key

    @property
    def targets(self) -> list[_Option]:
        """The options a value written here sets: this one, and those an old key also feeds."""
        also = [_resolve(name) for name in self.renamed.also] if self.renamed is not None else []
        return [self, *also]


def _value_type(value: Any) -> Any:
    if isinstance(value, list):
        return list[str]
    return str | None if value is None else type(value)


def _resolve(name: str) -> _Option | None:
    """The option a dotted name means: the schema first, then torchtitan's other spellings."""
    section, _, key = name.partition(".")
    sections = config_sections()
    if section in sections:
        fields = _fields(sections[section])
        if key in fields:
            field_, tp = fields[key]
            return _Option(name, section, key, tp, _choices(field_))
        table, _, entry = key.partition(".")
        if entry and table in fields and _unwrap_optional(fields[table][1])[0] is dict:
            # One setting of a table option (--model.args.dim 512, [model.args] dim = 512); the
            # table's owner knows its keys and types, so the value is kept as written.
            return _Option(name, section, table, Any, entry=entry)
    for prefix, ours in SECTION_ALIASES.items():
        if name.startswith(prefix + "."):
            found = _resolve(ours + name[len(prefix):])
            return dataclasses.replace(found, spelled=name) if found else None
    entry = TORCHTITAN_KEYS.get(name) or _renamed(name)
    if isinstance(entry, Alias):
        found = _resolve(entry.target)
        return dataclasses.replace(found, spelled=name) if found else None
    if isinstance(entry, Renamed):
        found = _resolve(entry.target)
        return dataclasses.replace(found, spelled=name, renamed=entry) if found else None
    if isinstance(entry, NotHere):
        return _Option(name, None, None, _value_type(entry.value), not_here=entry, table_key=name)
    return None


def _known_names() -> list[str]:
    """Every dotted name the loader reads: the schema's keys and torchtitan's other spellings."""
    names = [f"{s}.{k}" for s, cls in config_sections().items() for k in _fields(cls)]
    names += [f"{prefix}.{k}" for prefix, ours in SECTION_ALIASES.items() for k in _fields(config_sections()[ours])]
    return names + list(TORCHTITAN_KEYS) + list(renamed_keys())


def _describe_unknown(names: list[str]) -> str:
    """One sentence naming every unknown key (a wholly unknown section once), each with a
    suggestion only when it is near certain."""
    known = _known_names()
    sections = sorted({n.split(".")[0] for n in known})
    items: list[tuple[str, str, str | None]] = []  # (kind, name, suggestion)
    for name in names:
        section, _, key = name.partition(".")
        if section in sections:
            items.append(("key", name, _suggest(section, key, known)))
        elif not any(kind == "section" and n == section for kind, n, _ in items):
            items.append(("section", section, near_certain(section, sections)))
    if len(items) == 1:
        kind, name, hint = items[0]
        return f"unknown config {kind} '{name}'" + (f"; did you mean '{hint}'?" if hint else "")
    listed = [("section " if kind == "section" else "") + f"'{name}'" + (f" (did you mean '{hint}'?)" if hint else "")
              for kind, name, hint in items]
    return f"{len(items)} unknown config keys or sections: " + ", ".join(listed)


def _suggest(section: str, key: str, known: list[str]) -> str | None:
    # The key exists verbatim in exactly one other section: most likely misplaced.
    elsewhere = [n for n in known if n.rpartition(".")[2] == key and not n.startswith(section + ".")]
    if len(elsewhere) == 1:
        target = elsewhere[0]
    else:
        mine = [n[len(section) + 1:] for n in known if n.startswith(section + ".")]
        close = near_certain(key, mine)
        target = f"{section}.{close}" if close else None
    if target is None:
        return None
    option = _resolve(target)
    # An older torchtitan spelling is suggested as the key it became.
    return option.name if option is not None and option.renamed is not None else target


def _split_cli(argv: Sequence[str]) -> tuple[list[tuple[str, Any]], list[str], list[str]]:
    """argv as (dotted name, raw value) pairs in order, the dotted names no option answers to, and the
    arguments that are no --section.key option at all (another trainer's flags, stray words)."""
    out: list[tuple[str, Any]] = []
    unknown: list[str] = []
    bare: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        name, eq, inline = arg[2:].partition("=")
        if not arg.startswith("--") or "." not in name:
            bare.append(arg)
            # A flag's value is not reported on its own: the word after a flag that takes one (Megatron's
            # --lr 3e-4, or any flag the table does not know) is skipped, and after a switch a true/false
            # (Hugging Face's --bf16 True).
            foreign = FOREIGN_FLAGS.get(arg.partition("=")[0])
            nxt = argv[i + 1] if i + 1 < len(argv) and not argv[i + 1].startswith("-") else None
            switch = foreign is not None and foreign.switch
            value = nxt is not None and arg.startswith("-") and not eq and (not switch or nxt.lower() in _TRUE | _FALSE)
            i += 2 if value else 1
            while value and foreign is not None and foreign.many and i < len(argv) and not argv[i].startswith("-"):
                i += 1
            continue
        option, negated = _resolve(name), False
        head, _, last = name.rpartition(".")
        if option is None and last.startswith("no_"):
            option, negated = _resolve(f"{head}.{last[3:]}"), True
            if option is not None:
                name = f"{head}.{last[3:]}"
        if option is None:
            unknown.append(name)
            # Its type is unknown: a following word that is not an option is taken as its value.
            i += 1 if eq or i + 1 >= len(argv) or argv[i + 1].startswith("--") else 2
            continue
        raw, i = _take_value(argv, i, name, option.tp, negated=negated, eq=eq, inline=inline)
        out.append((name, raw))
    return out, unknown, bare


_OPTIONS_LOOK = "options look like --section.key value"


def _describe_bare(bare: list[str]) -> str:
    """One sentence naming every argument that is no --section.key option, another trainer's flag with
    the option it is here (titanlike/config/compat.py FOREIGN_FLAGS)."""
    if len(bare) == 1:
        hint = foreign_flag_hint(bare[0])
        if hint:
            return f"unexpected argument {bare[0]!r}: {hint} ({_OPTIONS_LOOK}; see --help)"
        return f"unexpected argument {bare[0]!r}; {_OPTIONS_LOOK} (see --help)"
    listed = [f"{arg!r}" + (f" ({hint})" if (hint := foreign_flag_hint(arg)) else "") for arg in bare]
    return f"{len(bare)} unexpected arguments: {', '.join(listed)}; {_OPTIONS_LOOK} (see --help)"


def _take_value(argv: Sequence[str], i: int, name: str, tp: Any, *, negated: bool, eq: str,
                inline: str) -> tuple[Any, int]:
    """The raw value of the option at argv[i] and the index after it (None-free: a bare flag is True)."""
    is_bool = _unwrap_optional(tp)[0] is bool
    head, _, last = name.rpartition(".")
    if negated:
        if not is_bool:
            raise ConfigError(f"--{head}.no_{last} only applies to true/false options")
        if eq:
            raise ConfigError(f"--{head}.no_{last} takes no value")
        return False, i + 1
    if eq:
        return inline, i + 1
    if is_bool:
        nxt = argv[i + 1] if i + 1 < len(argv) else None
        if nxt is not None and nxt.lower() in _TRUE | _FALSE:
            return nxt, i + 2
        return True, i + 1
    if i + 1 >= len(argv) or (argv[i + 1].startswith("--") and "." in argv[i + 1]):
        raise ConfigError(f"--{name} needs a value")
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
        raw, i = _take_value(argv, i, f"{section}.{key}", tp, negated=negated, eq=eq, inline=inline)
        values[key] = _convert(f"{section}.{key}", raw, tp, _choices(field_))
    return section_cls(**values), rest


def _read_toml(path: str) -> dict[str, Any]:
    if os.path.exists(path) and not os.path.isdir(path) and not os.path.isfile(path):
        raise ConfigError(f"config file {path} is not a regular file")  # a device, a pipe: never read
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except IsADirectoryError:
        raise ConfigError(f"config file {path} is a folder, not a TOML file") from None
    except OSError as e:
        raise ConfigError(f"config file {path} cannot be read ({os.strerror(e.errno) if e.errno else e})") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {path} is not valid TOML: {e}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"config file {path} is not UTF-8 text, so it is not TOML (byte {e.start}: "
                          f"{e.object[e.start:e.start + 1]!r})") from None


def _flatten_toml(toml: dict[str, Any], path: str) -> list[tuple[str, Any]]:
    """A TOML file's settings as (dotted name, value), nested tables ([quantize.linear.float8]) included."""
    out: list[tuple[str, Any]] = []

    def walk(prefix: str, table: dict[str, Any]) -> None:
        for key, value in table.items():
            if isinstance(value, dict):
                walk(f"{prefix}.{key}", value)
            else:
                out.append((f"{prefix}.{key}", value))

    for section, table in toml.items():
        if not isinstance(table, dict):
            raise ConfigError(f"top-level key '{section}' in {path} must be a [section] table")
        walk(section, table)
    return out


def _show(value: Any) -> str:
    """A value as it is written in TOML, for messages."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"'
    if isinstance(value, list):
        return "[" + ", ".join(_show(v) for v in value) + "]"
    return repr(value)


def _deprecated(option: _Option) -> str:
    r = option.renamed
    return (f"{option.spelled} is deprecated ({r.by} {r.release}'s spelling); read as "
            + " and ".join(target.name for target in option.targets))


def _not_here(option: _Option, value: Any, notes: dict[str, str]) -> None:
    """A torchtitan key titanlike has no counterpart for: note it, or accept only what titanlike does."""
    entry, name = option.not_here, option.spelled
    if entry.value is None:
        ok = value is None or (isinstance(value, str) and value.lower() in ("", "none"))
    else:
        try:
            value = _convert(option.name, value, option.tp, None)
        except ConfigError:  # a value of another shape (a list of lists): not what titanlike does either
            ok = False
        else:
            ok = value == entry.value
    if ok:
        if option.renamed:
            notes[name] = _deprecated(option)
        return
    if entry.note:
        was = (f"{name} is torchtitan {option.renamed.release}'s spelling of {option.name}, which"
               if option.renamed else name)
        notes[name] = f"{was} has no effect in titanlike: {entry.why}"
        return
    if not ok:
        keep = "remove it" if entry.value is None else f"remove it or set it to {_show(entry.value)}"
        raise ConfigError(f"{option.name} = {_show(value)} is not supported: {entry.why}; {keep}")


def load_job_config(argv: Sequence[str] | None = None, *, notes: list[str] | None = None) -> JobConfig:
    """Parse argv (default sys.argv[1:]): TOML file first, then CLI overrides in order.

    torchtitan's spellings are read too (titanlike/config/compat.py). Each older spelling, and
    each torchtitan key that has no effect here, gives one line: appended to `notes` when given
    (train.py prints them on rank 0), else logged as a warning.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if "-h" in argv or "--help" in argv:
        raise HelpRequested(help_text())
    overrides, unknown_in_argv, bare = _split_cli(argv)
    settings: list[tuple[str, Any, str]] = []  # (dotted name, raw value, where)
    unknown: list[str] = []
    config_file = [v for name, v in overrides if name == "job.config_file"]
    if config_file:
        path = _convert("job.config_file", config_file[-1], str, None)
        for name, value in _flatten_toml(_read_toml(path), path):
            if _resolve(name) is None:
                unknown.append(name)
            settings.append((name, value, path))
    unknown += unknown_in_argv
    if bare or unknown:
        # Every argument the command cannot take, in one message: fixing one at a time is slow.
        problems = [_describe_bare(bare)] if bare else []
        problems += [_describe_unknown(list(dict.fromkeys(unknown)))] if unknown else []
        raise ConfigError("; and ".join(problems))
    settings += [(name, value, "") for name, value in overrides]

    values: dict[str, dict[str, Any]] = {}
    in_file: dict[str, tuple[str, Any]] = {}  # option -> (the spelling the config file set it with, value)
    found: dict[str, str] = {}
    for name, value, where in settings:
        option = _resolve(name)
        for target in option.targets:
            seen = in_file.get(target.name)
            if where and seen is not None and seen[0] != name and seen[1] != value:
                raise ConfigError(f"{where} sets {target.name} twice, as {seen[0]} and as {name}, to different "
                                  f"values; keep {target.name}")
            if where:
                in_file[target.name] = (name, value)
        if option.not_here is not None:
            _not_here(option, value, found)
            continue
        if option.renamed is not None:
            found[name] = _deprecated(option)
        for target in option.targets:
            if target.entry is not None:
                _check_entry(target.name, value)
                values.setdefault(target.section, {}).setdefault(target.key, {})[target.entry] = value
                continue
            converted = _convert(target.name, value, target.tp, target.choices)
            if target.entry is None and isinstance(converted, dict):
                # A whole table after some of its settings: the later setting wins, key by key.
                converted = {**values.get(target.section, {}).get(target.key, {}), **converted}
            if target.name in ITEM_ALIASES:
                converted = _aliased_items(converted, ITEM_ALIASES[target.name])
            values.setdefault(target.section, {})[target.key] = converted

    if notes is not None:
        notes.extend(found.values())
    else:
        for line in found.values():
            logger.warning(line)
    return JobConfig(**{section: cls(**values.get(section, {})) for section, cls in _job_sections().items()},
                     registered={section: cls(**values.get(section, {}))
                                 for section, cls in registered_sections().items()})


def _aliased_items(items: list, aliases: dict[str, str]) -> list:
    """items with torchtitan's names replaced by ours; several of its items that are one of ours
    (quantize.linear.mx and quantize.grouped_mm.mx are mx) give it once."""
    out: list = []
    for item in items:
        if item not in aliases or aliases[item] not in out:
            out.append(aliases.get(item, item))
    return out


def _check_entry(where: str, value: Any) -> None:
    """A table setting holds one plain value (the owner converts it to its type)."""
    plain = (str, int, float, bool)
    if not (isinstance(value, plain) or (isinstance(value, list) and all(isinstance(v, plain) for v in value))):
        raise ConfigError(f"{where} must be a number, a string, true/false or a list of those, got {_shown(value)}")
    if isinstance(value, str) and "\0" in value:
        raise ConfigError(f"{where} must not contain a NUL character, got {_shown(value)}")


def help_text() -> str:
    lines = [
        "usage: train.py [--job.config_file FILE] [--section.key VALUE ...]",
        "",
        "Options come from a TOML file (--job.config_file) and are overridden by the command line.",
        "Booleans: --section.key, --section.key=false or --section.no_key. Lists: comma-separated.",
        "torchtitan's keys are read too: v0.2.2's ([quantize.linear.float8] is [float8], [quantize.linear.mx]",
        "and [quantize.grouped_mm.mx] fill [mx]) and older spellings",
        "(training.compile, checkpoint.enable_checkpoint, ...); see titanlike/config/compat.py.",
    ]
    for section, cls in config_sections().items():
        lines += ["", section_help(section, cls)]
    return "\n".join(lines)


def section_help(section: str, section_cls: type, *, title: str = "") -> str:
    """The help lines of one section: each option, its type, default and doc."""
    lines = [f"[{section}]" + (f"  {title}" if title else "")]
    for key, (field_, tp) in _fields(section_cls).items():
        default = field_.default if field_.default is not dataclasses.MISSING else field_.default_factory()
        choices = _choices(field_)
        doc = field_.metadata.get("doc", "")
        if choices:
            doc += f" ({' | '.join(choices)})"
        lines.append(f"  --{section}.{key} ({_type_name(tp)}, default {default!r})")
        lines.append(f"      {doc}")
    return "\n".join(lines)


def config_to_dict(cfg: JobConfig) -> dict[str, Any]:
    """Every section as a dict of its values: JobConfig's, then the registered ones (defaults included)."""
    return {section: dataclasses.asdict(getattr(cfg, section)) for section in config_sections()}
