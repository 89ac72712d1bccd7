"""Typed readers for configuration values. Every failure is an ``InvalidConfig`` whose message
names the key, the value and the file it came from, so an operator can fix it without a debugger.
"""

from __future__ import annotations

from typing import Any

from frontend.errors import InvalidConfig

_TRUE = frozenset({"true", "yes", "1", "on"})
_FALSE = frozenset({"false", "no", "0", "off"})


def fail(key: str, value: Any, source: str, rule: str) -> InvalidConfig:
    return InvalidConfig(f"invalid value {value!r} for '{key}' in {source}: {rule}")


def as_int(key: str, value: Any, source: str, minimum: int | None = None, maximum: int | None = None) -> int:
    """Integers from YAML ints or property strings; booleans are refused (YAML `true` is not 1)."""
    if isinstance(value, bool):
        raise fail(key, value, source, "must be an integer")
    if isinstance(value, int):
        number = value
    elif isinstance(value, str) and value.strip().lstrip("+-").isdigit():
        number = int(value.strip())
    else:
        raise fail(key, value, source, "must be an integer")
    if minimum is not None and number < minimum:
        raise fail(key, value, source, f"must be >= {minimum}")
    if maximum is not None and number > maximum:
        raise fail(key, value, source, f"must be <= {maximum}")
    return number


def as_bool(key: str, value: Any, source: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
        return value.strip().lower() in _TRUE
    raise fail(key, value, source, "must be true or false")


def as_str(key: str, value: Any, source: str) -> str:
    if not isinstance(value, str):
        raise fail(key, value, source, "must be a string")
    return value.strip()


def as_dict(key: str, value: Any, source: str) -> dict:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise fail(key, value, source, "must be a mapping")
    return value
