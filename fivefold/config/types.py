"""Whether a value is of its field's declared type, and what the type asks for in TOML's words.

load.py lets no wrongly typed value through (each is reported and skipped, so no code ever sees one);
validate() checks a Config built in code with `type_errors`.
"""

from __future__ import annotations

import typing
from typing import Any, Literal

from fivefold.config.schema import Config, leaves


def _matches(value: Any, hint: Any) -> bool:
    """Whether a value (tuples for TOML arrays) is of a field's declared type."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is Literal:  # (1 == True: an integer must not pass for a bool choice, nor a bool for an int one)
        return any(value == c and isinstance(value, bool) == isinstance(c, bool) for c in args)
    if origin is tuple:
        if not isinstance(value, tuple):
            return False
        if len(args) == 2 and args[1] is Ellipsis:
            return all(_matches(v, args[0]) for v in value)
        return len(value) == len(args) and all(_matches(v, a) for v, a in zip(value, args, strict=True))
    if hint is float:  # TOML's integers are numbers too; a bool is not
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, hint) and (hint is bool or not isinstance(value, bool))


def _describe(hint: Any) -> str:
    """What a field's declared type asks for, in TOML's words."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is Literal:
        return "one of " + ", ".join(str(c).lower() if isinstance(c, bool) else repr(c) for c in args)
    if origin is tuple and typing.get_origin(args[0]) is tuple:  # data.mixture's [path, weight] pairs
        return f"a list of [{', '.join(_noun(a) for a in typing.get_args(args[0]))}] pairs"
    if origin is tuple:
        return f"a list of {'ints' if args[0] is int else _noun(args[0]) + 's'}"
    return "true or false" if hint is bool else f"{'an' if hint is int else 'a'} {_noun(hint)}"


def _noun(hint: type) -> str:
    return {bool: "bool", int: "integer", float: "number", str: "string"}[hint]


def thawed(value: Any) -> Any:
    """Tuples as the lists a user writes in TOML, for messages."""
    return [thawed(v) for v in value] if isinstance(value, tuple) else value


def type_error(name: str, value: Any, hint: Any) -> str | None:
    """`table.key = value: must be ...` when value is not of the declared type, else None."""
    if _matches(value, hint):
        return None
    return f"{name} = {thawed(value)!r}: must be {_describe(hint)}"


def type_errors(cfg: Config) -> list[str]:
    """Every field of cfg, nested tables' included, not of its declared type."""
    return [e for key, value, hint in leaves(cfg) if (e := type_error(key, value, hint))]
