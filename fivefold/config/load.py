"""The configuration from its layers: field defaults < `model.preset` < the TOML file < `--table.key=value`.

`read_config()` parses and reports unknown keys, moved keys and values not of their field's declared
type (each skipped, so no code ever sees a wrongly typed value); `validate()` (fivefold/validate/)
checks ranges and the arithmetic between tables. Both collect every problem before anything starts,
so a user fixes a config in one round. Tables nest as TOML nests them: `[model.rope]` in a file,
`--model.rope.theta=1e6` on the command line.
"""

from __future__ import annotations

import dataclasses
import difflib
import sys
import tomllib
from pathlib import Path
from typing import Any

from fivefold.config.moved import MOVED, moved_error
from fivefold.config.schema import FIELD_TYPES, SECTIONS, SUBTABLES, TABLES, Config
from fivefold.config.types import type_error
from fivefold.model.presets import PRESETS

RUN_CONFIG = "config.toml"  # a run directory's resolved config (train/loop.py writes it at the start)
SEED_CONFIG = "fivefold.toml"  # beside a seed checkpoint's weights: the config it was made with


class ConfigError(ValueError):
    """All problems found in a configuration, one per line (one problem: one line)."""

    def __init__(self, errors: list[str]):
        self.errors = errors
        listed = errors[0] if len(errors) == 1 else "\n" + "\n".join(f"  - {e}" for e in errors)
        super().__init__(f"invalid configuration: {listed}")


def _suggest(word: str, options: list[str]) -> str:
    close = difflib.get_close_matches(word, options, n=1, cutoff=0.6)
    return f"did you mean '{close[0]}'?" if close else f"valid keys: {', '.join(options)}"


def _frozen(value: Any) -> Any:
    """TOML arrays as tuples, at every depth (the dataclasses are frozen, their values hashable)."""
    return tuple(_frozen(v) for v in value) if isinstance(value, list) else value


def parse_value(text: str) -> Any:
    """A CLI value read as TOML (42, 1e-3, true, ["a", "b"]); anything else is a plain string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def _string_value(text: str) -> str:
    """A string field's CLI value: the text as written (`--run.name=2024` names the run "2024"), or the
    string a quoted TOML string stands for (`"x"`, as fivefold/config/deepspeed.py writes strings)."""
    value = parse_value(text)
    return value if isinstance(value, str) else text


def parse_overrides(args: list[str]) -> tuple[dict[str, Any], list[str]]:
    """`--table.key=value` or `--table.key value` pairs -> nested dict, plus errors. A value is read as
    TOML, except for a string field's, which is taken as written."""
    out: dict[str, Any] = {}
    errors: list[str] = []
    i = 0
    while i < len(args):
        arg = args[i]
        i += 1
        if not arg.startswith("--") or "." not in arg.split("=", 1)[0]:
            errors.append(f"override '{arg}': expected --section.key=value (e.g. --train.steps=200)")
            continue
        key, sep, value = arg[2:].partition("=")
        if not sep:
            if i >= len(args):
                errors.append(f"override '{arg}' has no value: write --{key}=VALUE")
                continue
            value = args[i]
            i += 1
        *tables, name = key.split(".")
        node = out
        for table in tables:
            node = node.setdefault(table, {})
            if not isinstance(node, dict):
                errors.append(f"override '--{key}': {'.'.join(tables)} was given a value; it is a table of keys")
                break
        else:
            is_string = FIELD_TYPES.get(".".join(tables), {}).get(name) is str
            node[name] = _string_value(value) if is_string else parse_value(value)
    return out, errors


def _merge(path: str, base: dict[str, Any], raw: Any, errors: list[str]) -> None:
    """raw's keys into base (table `path`), each one unknown, moved or not of its declared type reported
    and skipped."""
    types, subtables = FIELD_TYPES[path], SUBTABLES[path]
    if not isinstance(raw, dict):
        errors.append(f"[{path}] must be a table of keys, got {raw!r}")
        return
    for key, value in raw.items():
        name = f"{path}.{key}"
        if key in subtables:
            _merge(name, base.setdefault(key, {}), value, errors)
        elif name in MOVED:
            errors.append(moved_error(name))
        elif key not in types:
            errors.append(f"unknown key '{name}': {_suggest(key, [*types, *subtables])}")
        elif error := type_error(name, _frozen(value), types[key]):
            errors.append(error)
        else:
            base[key] = _frozen(value)


def _deep_merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in over.items():
        out[key] = _deep_merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def _build(path: str, values: dict[str, Any]) -> Any:
    """The dataclass of table `path` from its (already checked) values, nested tables included."""
    nested = {sub: _build(f"{path}.{sub}", values.get(sub, {})) for sub in SUBTABLES[path]}
    return TABLES[path](**{**values, **nested})


def build_config(layers: list[dict[str, Any]]) -> tuple[Config, list[str]]:
    """Merge layers of {table: {key: value or table}} over the defaults (and a model preset)."""
    errors: list[str] = []
    values: dict[str, dict[str, Any]] = {name: {} for name in SECTIONS}
    for layer in layers:
        for section, raw in layer.items():
            if section not in SECTIONS:
                errors.append(f"unknown section '[{section}]': {_suggest(section, list(SECTIONS))}")
                continue
            _merge(section, values[section], raw, errors)
    preset = values["model"].get("preset", "")
    if preset:
        if preset not in PRESETS:
            errors.append(f"model.preset = '{preset}' is unknown: {_suggest(preset, sorted(PRESETS))}")
        else:
            values["model"] = _deep_merge(dataclasses.asdict(PRESETS[preset]), values["model"])
    return Config(**{name: _build(name, vals) for name, vals in values.items()}), errors


def written_by_fivefold(path: Path) -> bool:
    """Whether a TOML file is one fivefold saved: a run directory's config.toml (beside its metrics or
    checkpoints) or a seed directory's fivefold.toml (beside its weights). Only these may hold the keys
    of an earlier version (moved.py): a user's own file is refused a moved key by name."""
    folder = path.parent
    if path.name == RUN_CONFIG:
        return (folder / "metrics.jsonl").is_file() or (folder / "checkpoints").is_dir()
    return path.name == SEED_CONFIG and any(folder.glob("*.safetensors"))


def _translated(layer: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """A saved file's keys of an earlier version moved to their places now, and which ones moved."""
    out = {section: dict(raw) if isinstance(raw, dict) else raw for section, raw in layer.items()}
    moved = []
    for old, new in MOVED.items():
        section, key = old.split(".")
        if isinstance(out.get(section), dict) and key in out[section]:
            node = out
            *tables, name = new.split(".")
            for table in tables:
                node = node.setdefault(table, {})
            node[name] = out[section].pop(key)
            moved.append(old)
    return out, moved


def read_config(path: str | Path | None = None, overrides: list[str] | None = None) -> tuple[Config, list[str]]:
    """Defaults < preset < TOML file < CLI overrides, plus every parse problem (unknown keys and
    values of the wrong type are skipped, so validate() can still report the rest of the mistakes
    in the same round)."""
    layers: list[dict[str, Any]] = []
    name = ""
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError([f"config file '{path}' does not exist (see configs/ for examples)"])
        try:
            layer = tomllib.loads(path.read_text(encoding="utf-8"))
        except tomllib.TOMLDecodeError as e:
            raise ConfigError([f"{path}: not valid TOML: {e}"]) from None
        except UnicodeDecodeError:
            raise ConfigError([f"{path}: not a text file (not UTF-8); give a TOML config such as "
                               f"configs/tiny.toml"]) from None
        if written_by_fivefold(path):
            layer, moved = _translated(layer)
            if moved:
                print(f"fivefold: {path} was saved by an earlier fivefold: its {len(moved)} keys that have moved "
                      f"since are read in their new places ({moved_error(moved[0])}, ...)", file=sys.stderr)
        layers.append(layer)
        name = path.stem
    cli, errors = parse_overrides(overrides or [])
    layers.append(cli)
    cfg, merge_errors = build_config(layers)
    if not cfg.run.name and name:
        cfg = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, name=name))
    return cfg, errors + merge_errors


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """read_config() that raises ConfigError listing every parse problem."""
    cfg, errors = read_config(path, overrides)
    if errors:
        raise ConfigError(errors)
    return cfg


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, (tuple, list)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    return repr(v)


def to_toml(cfg: Config) -> str:
    """The resolved config as TOML that load_config() reads back unchanged: each table's keys, then its
    nested tables ([model], then [model.rope], ...)."""
    lines: list[str] = []

    def table(path: str, obj: Any) -> None:
        lines.append(f"[{path}]")
        lines.extend(f"{key} = {_toml_value(getattr(obj, key))}" for key in FIELD_TYPES[path])
        lines.append("")
        for sub in SUBTABLES[path]:
            table(f"{path}.{sub}", getattr(obj, sub))

    for section in SECTIONS:
        table(section, getattr(cfg, section))
    return "\n".join(lines)


def _replaced(obj: Any, changes: dict[str, Any]) -> Any:
    return dataclasses.replace(obj, **{
        key: _replaced(getattr(obj, key), value) if isinstance(value, dict) and dataclasses.is_dataclass(
            getattr(obj, key)) else value for key, value in changes.items()})


def replace(cfg: Config, **sections: dict[str, Any]) -> Config:
    """A copy of cfg with some keys changed, nested tables as dicts:
    replace(cfg, train={"steps": 5}, model={"rope": {"theta": 1e6}})."""
    return _replaced(cfg, sections)
