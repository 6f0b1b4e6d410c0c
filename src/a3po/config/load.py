"""Turn a YAML file plus `key=value` overrides into a validated `Config`, strictly.

    cfg = load_config("my.yaml", ["actor.prox_logp_method=recompute", "gconfig.n_samples=4"])

Anything wrong raises `ConfigError` whose message is one line naming the key, the value
and what is allowed (with a "did you mean" for a misspelt key or choice); the CLI prints
it and exits with code 2. Override values are parsed by the type the schema declares
for that key, so `actor.optimizer.lr=1e-5` is a float and `experiment_name=007` a string.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
import types
import typing
from pathlib import Path
from typing import Any

import yaml

from a3po.config.schema import Config, check_consistency


class ConfigError(ValueError):
    """A one-line, user-facing description of a bad configuration."""


def _is_section(tp: Any) -> bool:
    return dataclasses.is_dataclass(tp)


def _fields(cls: type) -> dict[str, dataclasses.Field]:
    hints = typing.get_type_hints(cls)
    out = {}
    for f in dataclasses.fields(cls):
        f.type = hints[f.name]
        out[f.name] = f
    return out


def all_keys(cls: type = Config, prefix: str = "") -> dict[str, dataclasses.Field]:
    """Every leaf key of the schema, dotted, in declaration order."""
    out = {}
    for name, f in _fields(cls).items():
        if _is_section(f.type):
            out.update(all_keys(f.type, f"{prefix}{name}."))
        else:
            out[f"{prefix}{name}"] = f
    return out


def default_of(f: dataclasses.Field) -> Any:
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


def closest(word: str, options: Any) -> str | None:
    """The option closest to a misspelt word, or None when none is close enough to be meant."""
    close = difflib.get_close_matches(str(word), [str(o) for o in options], n=1, cutoff=0.6)
    return close[0] if close else None


def suggest(word: str, options: Any, spell: Any = str) -> str:
    """' (did you mean 'x'?)' for the option closest to a misspelt word, or '' when none is close: the one
    helper every name a user types goes through (config keys and choices, tasks, rewards, environments,
    agents). `spell` writes the close option as the user would type it (e.g. inside its module:attribute)."""
    close = closest(word, options)
    return f" (did you mean '{spell(close)}'?)" if close is not None else ""


def _unknown_key(key: str, prefix: str, cls: type) -> ConfigError:
    leaves = list(all_keys())
    dotted = f"{prefix}{key}"
    hint = suggest(dotted, leaves) or suggest(key, [k.rsplit(".", 1)[-1] for k in leaves])
    section = prefix.rstrip(".") or "the top level"
    known = ", ".join(_fields(cls))
    return ConfigError(f"unknown key '{dotted}'{hint}; keys in {section}: {known}")


def type_name(tp: Any) -> str:
    args = typing.get_args(tp)
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        return f"{type_name(inner[0])} or null"
    return getattr(tp, "__name__", str(tp))


def _parse_text(text: str, tp: Any, key: str) -> Any:
    """An override's text read as the schema's type for `key`."""
    base, optional = _unwrap(tp)
    if optional and text.strip().lower() in ("null", "none", "~"):
        return None
    if base is str:
        return text
    if base is bool:
        low = text.strip().lower()
        if low in ("true", "yes", "1", "on"):
            return True
        if low in ("false", "no", "0", "off"):
            return False
        raise ConfigError(f"{key}={text!r} is not a boolean; use true or false")
    if base in (int, float):
        try:
            return base(text)
        except ValueError:
            raise ConfigError(f"{key}={text!r} is not {'an integer' if base is int else 'a number'}") from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        raise ConfigError(f"{key}={text!r} is not a valid {type_name(tp)} "
                          "(write lists as [a, b], mappings as {k: v})") from None


def _unwrap(tp: Any) -> tuple[Any, bool]:
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        inner = [a for a in typing.get_args(tp) if a is not type(None)]
        return inner[0], True
    return tp, False


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Check a YAML value against the declared type; accept only lossless conversions."""
    base, optional = _unwrap(tp)
    if value is None:
        if optional:
            return None
        raise ConfigError(f"{key}=null is not allowed; it needs a {type_name(tp)}")
    origin = typing.get_origin(base) or base
    if origin is bool:
        ok = isinstance(value, bool)
    elif origin is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif origin is float:
        if isinstance(value, str):  # PyYAML reads 1e-5 (no dot) as a string
            try:
                value = float(value)
            except ValueError:
                pass
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        value = float(value) if ok else value
    else:
        ok = isinstance(value, origin)
    if not ok:
        raise ConfigError(f"{key}={value!r} has type {type(value).__name__}; expected {type_name(tp)}")
    return value


def _check_rules(key: str, value: Any, meta: dict) -> None:
    if value is None:
        return
    choices = meta.get("choices")
    if choices is not None and value not in choices:
        hint = suggest(str(value), list(choices))
        raise ConfigError(f"{key}={value!r} is not allowed; choose one of {', '.join(choices)}{hint}")
    pattern = meta.get("pattern")
    if pattern is not None and not re.fullmatch(pattern, str(value)):
        raise ConfigError(f"{key}={value!r} is not allowed; {meta['pattern_help']}")
    bounds = (("ge", lambda v, b: v >= b, ">="), ("gt", lambda v, b: v > b, ">"),
              ("le", lambda v, b: v <= b, "<="), ("lt", lambda v, b: v < b, "<"))
    for name, holds, sign in bounds:
        if name in meta and not holds(value, meta[name]):
            raise ConfigError(f"{key}={value!r} is out of range; it must be {sign} {meta[name]}")


def _build(cls: type, data: dict, prefix: str = "") -> Any:
    if not isinstance(data, dict):
        raise ConfigError(f"'{prefix.rstrip('.')}' must be a mapping of keys, got {type(data).__name__}")
    fields = _fields(cls)
    kwargs = {}
    for key, value in data.items():
        if key not in fields:
            raise _unknown_key(str(key), prefix, cls)
        f = fields[key]
        dotted = f"{prefix}{key}"
        if _is_section(f.type):
            kwargs[key] = _build(f.type, value if value is not None else {}, dotted + ".")
        else:
            kwargs[key] = _coerce(value, f.type, dotted)
            _check_rules(dotted, kwargs[key], f.metadata)
    return cls(**kwargs)


def _set_dotted(tree: dict, dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = tree
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"'{dotted}' goes inside '{part}', which is not a section")
        node = child
    node[parts[-1]] = value


def read_yaml(path: str | Path) -> dict:
    p = Path(path)
    if p.is_dir():
        raise ConfigError(f"config file '{p}' is a directory; pass a YAML file to --config")
    if not p.is_file():
        raise ConfigError(f"config file '{p}' does not exist; pass an existing YAML file to --config")
    try:
        data = yaml.safe_load(p.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as e:
        line = e.object[:e.start].count(b"\n") + 1
        raise ConfigError(f"config file '{p}' is not UTF-8 text (byte 0x{e.object[e.start]:02x} on line {line}); "
                          "save it as UTF-8") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(e, "problem", None) or "invalid YAML"
        raise ConfigError(f"config file '{p}' is not valid YAML{where}: {problem}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file '{p}' must hold a mapping of keys at the top level, got {type(data).__name__}")
    return data


def apply_overrides(tree: dict, overrides: list[str]) -> dict:
    leaves = all_keys()
    for item in overrides:
        key, sep, text = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ConfigError(f"override '{item}' must look like key=value, e.g. actor.prox_logp_method=loglinear")
        if key not in leaves:
            if any(k.startswith(key + ".") for k in leaves):
                raise ConfigError(f"'{key}' is a section; set one of its keys, "
                                  f"e.g. {next(k for k in leaves if k.startswith(key + '.'))}=...")
            hint = (suggest(key, list(leaves))
                    or suggest(key.rsplit(".", 1)[-1], [k.rsplit(".", 1)[-1] for k in leaves]))
            raise ConfigError(f"unknown key '{key}'{hint}; `a3po train --help` lists every key")
        _set_dotted(tree, key, _parse_text(text, leaves[key].type, key))
    return tree


PRESETS = Path(__file__).resolve().parent.parent / "presets"


def presets() -> list[str]:
    return sorted(p.stem for p in PRESETS.glob("*.yaml"))


def _merge(base: dict, top: dict) -> dict:
    out = dict(base)
    for k, v in top.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def load_config(
    path: str | Path | None = None, overrides: list[str] | None = None, preset: str | None = None
) -> Config:
    """Schema defaults, then a preset, then the YAML file, then the overrides; validated throughout."""
    tree = {}
    if preset is not None:
        if preset not in presets():
            raise ConfigError(f"unknown preset '{preset}'{suggest(preset, presets())}; "
                              f"available: {', '.join(presets())}")
        tree = read_yaml(PRESETS / f"{preset}.yaml")
    if path is not None:
        tree = _merge(tree, read_yaml(path))
    tree = apply_overrides(tree, list(overrides or []))
    cfg = _build(Config, tree)
    problems = check_consistency(cfg)
    if problems:
        key, value, allowed = problems[0]
        raise ConfigError(f"{key}={value!r} conflicts: {allowed}")
    return cfg


def to_dict(cfg: Any) -> dict:
    return dataclasses.asdict(cfg)


def dump_yaml(cfg: Config) -> str:
    """The resolved configuration, loadable again with `load_config`."""
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)
