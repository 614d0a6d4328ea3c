"""Field validators shared by the config parsers: each error names the dotted field."""

from __future__ import annotations

from typing import Any

from kvstore.errors import ConfigError
from kvstore.units import parse_size


def check_keys(where: str, data: dict[str, Any], allowed: set[str]) -> None:
    for key in data:
        if key not in allowed:
            name = f"{where}.{key}" if where else str(key)
            raise ConfigError(name, data[key], f"unknown key (allowed: {', '.join(sorted(allowed))})")


def size_field(where: str, value: Any, minimum: int = 1) -> int:
    try:
        size = parse_size(value)
    except ValueError as exc:
        raise ConfigError(where, value, str(exc)) from None
    if size < minimum:
        raise ConfigError(where, value, f"must be at least {minimum} bytes")
    return size


def int_field(where: str, value: Any, minimum: int, maximum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(where, value, "must be an integer")
    if not minimum <= value <= maximum:
        raise ConfigError(where, value, f"must be between {minimum} and {maximum}")
    return value


def seconds_field(where: str, value: Any, minimum: float = 0.0) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= minimum:
        raise ConfigError(where, value, f"must be a number of seconds above {minimum:g}")
    return float(value)


def choice_field(where: str, value: Any, allowed: tuple[str, ...]) -> str:
    if value not in allowed:
        raise ConfigError(where, value, f"must be one of {', '.join(allowed)}")
    return value


def mapping_field(where: str, value: Any) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ConfigError(where, value, "must be a mapping")
    return value


def text_field(where: str, value: Any) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(where, value, "must be a non-empty string")
    return value
