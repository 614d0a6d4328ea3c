"""The machinery every config model is built on: a frozen base model that refuses unknown
keys, the value kinds a key can hold (sizes, seconds, bounded integers, choices), and the
translation of pydantic's errors into one ConfigError that names the dotted field.

A config is written by hand and read by a service that fails at start-up, so every
reason is worded for the person who wrote the file, not in pydantic's vocabulary.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError, model_validator
from pydantic_core import core_schema

from kvstore.format.errors import ConfigError
from kvstore.format.units import drive_writes, format_size, parse_size

_NO_VALUE = object()


class Refused(ValueError):
    """Raised by a model's validators about one of its keys (`loc`, relative to the model),
    or about the model itself (`loc` empty)."""

    def __init__(self, reason: str, *loc: str | int, value: Any = _NO_VALUE) -> None:
        super().__init__(reason)
        self.reason = reason
        self.loc = loc
        self.value = value


@dataclass(frozen=True)
class Kind:
    """What a key holds: `check` returns the value (normalised) or raises ValueError with
    the reason; `text` names the kind in the docs; `show` writes a default there."""

    text: str
    check: Callable[[Any], Any]
    show: Callable[[Any], str] = str

    def __get_pydantic_core_schema__(self, source: Any, handler: Any) -> core_schema.CoreSchema:
        return core_schema.no_info_before_validator_function(self.check, handler(source))


def integer(minimum: int, maximum: int) -> Kind:
    def check(value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError("must be an integer")
        if not minimum <= value <= maximum:
            raise ValueError(f"must be between {minimum} and {maximum}")
        return value

    return Kind(f"integer, {minimum} to {maximum}", check)


def size(minimum: int = 1) -> Kind:
    def check(value: Any) -> int:
        nbytes = parse_size(value)  # its ValueError names the bad text
        if nbytes < minimum:
            raise ValueError(f"must be at least {minimum} bytes")
        return nbytes

    text = f"size, at least {format_size(minimum)}" if minimum > 1 else "size"
    return Kind(text, check, lambda nbytes: format_size(nbytes) if nbytes else "0")


def seconds(*, zero: bool = False) -> Kind:
    """A number of seconds: above 0, or at least 0 with `zero`."""

    def check(value: Any) -> float:
        if (isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value)
                or value < 0 or (value == 0 and not zero)):
            raise ValueError("must be a number of seconds " + ("of at least 0" if zero else "above 0"))
        return float(value)

    return Kind("seconds, " + ("at least 0" if zero else "above 0"), check, lambda value: f"{value:g}")


def fraction() -> Kind:
    """A number from 0 to 1 (a rate, a share)."""

    def check(value: Any) -> float:
        if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= 1:
            raise ValueError("must be a number from 0 to 1")
        return float(value)

    return Kind("number, 0 to 1", check, lambda value: f"{value:g}")


def write_rate() -> Kind:
    """Bytes a day: a size, or drive writes per day (`0.5 dwpd`) of a tier's capacity."""

    def check(value: Any) -> int | str:
        per_drive = drive_writes(value)
        if per_drive is not None:
            return f"{per_drive:g} dwpd"
        try:
            return parse_size(value)
        except ValueError:
            raise ValueError(f"not a size a day or drive writes per day: {value!r} (e.g. 2TiB, "
                             "0.5 dwpd)") from None

    return Kind("size a day, or `N dwpd`", check,
                lambda value: format_size(value) if isinstance(value, int) else f"`{value}`")


def choice(*allowed: str) -> Kind:
    def check(value: Any) -> str:
        if value not in allowed:
            raise ValueError(f"must be one of {', '.join(allowed)}")
        return value

    return Kind(", ".join(f"`{name}`" for name in allowed), check, lambda value: f"`{value}`")


_CPUS = 4096  # Linux's CPU numbers on the machines kvstore knows stay below this


def cpu_list() -> Kind:
    """CPU numbers, as Linux writes a CPU list (`3`, `2-3,6`: taskset -c, cpuset) or as a list
    of integers; sorted, each once."""

    def check(value: Any) -> tuple[int, ...]:
        if isinstance(value, str):
            items: list[Any] = []
            for part in value.split(","):
                first, dash, last = part.strip().partition("-")
                if not (first.isdigit() and (not dash or (last.isdigit() and int(last) >= int(first)))):
                    raise ValueError(f"not a CPU list: {value[:80]!r} (e.g. 3 or 2-3,6)")
                if int(last or first) >= _CPUS:
                    raise ValueError(f"CPU numbers must be integers from 0 to {_CPUS - 1}")
                items += range(int(first), int(last or first) + 1)
        elif isinstance(value, list | tuple):
            items = list(value)
        else:
            raise ValueError("must be a CPU list (e.g. \"2-3,6\") or a list of CPU numbers")
        if any(isinstance(cpu, bool) or not isinstance(cpu, int) or not 0 <= cpu < _CPUS for cpu in items):
            raise ValueError(f"CPU numbers must be integers from 0 to {_CPUS - 1}")
        return tuple(sorted(set(items)))

    return Kind("CPU list (`3`, `2-3,6`)", check, lambda cpus: ",".join(map(str, cpus)) or "none")


def _boolean(value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError("must be true or false")
    return value


def _text(value: Any) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ValueError("must be a non-empty string")
    return value


Bool = Annotated[bool, Kind("true/false", _boolean, lambda value: str(value).lower())]
Text = Annotated[str, Kind("text", _text, lambda value: f"`{value}`")]

Model = TypeVar("Model", bound="Schema")


class Schema(BaseModel):
    """A config section: frozen, compared by value, keys checked before values."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    # Keys an older schema had: each is refused with this reason (what to do instead).
    removed_keys: ClassVar[dict[str, str]] = {}

    @classmethod
    def written_keys(cls) -> set[str]:
        """The keys a config file may give this section."""
        return {field.alias or name for name, field in cls.model_fields.items()}

    @classmethod
    def reshape(cls, data: Any) -> Any:
        """The written form turned into the fields' form (a shorthand expanded, values
        shared by several items handed to each); the written form's keys are checked after."""
        return data

    @model_validator(mode="before")
    @classmethod
    def _check_keys(cls, data: Any) -> Any:
        if isinstance(data, cls):
            return data
        data = cls.reshape(data)
        if not isinstance(data, dict):
            raise Refused("must be a mapping")
        allowed = cls.written_keys()
        for key, value in data.items():
            if key in cls.removed_keys:
                raise Refused(cls.removed_keys[key], key, value=value)
            if key not in allowed:
                raise Refused(f"unknown key (allowed: {', '.join(sorted(allowed))})", key, value=value)
        return data


def validate(model: type[Model], data: Any, where: str = "") -> Model:
    """`data` as a `model`; `where` is the dotted path of `data` in the whole config."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise config_error(exc, data, where) from None


_REASONS = {"missing": "required", "tuple_type": "must be a list", "too_short": "must be a non-empty list"}


def config_error(exc: ValidationError, data: Any, where: str = "") -> ConfigError:
    """The first of pydantic's errors as a ConfigError naming the dotted field."""
    error = exc.errors()[0]
    cause = error.get("ctx", {}).get("error")
    if isinstance(cause, ConfigError):  # raised by a constructor that names the key as written
        return cause
    loc = tuple(error["loc"])
    value = error["input"]
    if isinstance(cause, Refused):
        loc += cause.loc
        if cause.value is not _NO_VALUE:
            value = cause.value
    if error["type"] == "missing":
        value = None
    else:
        loc = _written_at(data, loc)
    reason = str(cause) if isinstance(cause, ValueError) else _REASONS.get(error["type"], error["msg"])
    return ConfigError(_dotted(where, loc), value, reason)


def _written_at(data: Any, loc: tuple[str | int, ...]) -> tuple[str | int, ...]:
    """Where the value at `loc` was written: a key that an item inherits from an enclosing
    mapping (NVMe-oF connection keys) is named at the mapping that holds it."""
    if not loc or not isinstance(loc[-1], str):
        return loc
    *parents, key = loc
    node, holders = data, []
    for depth, part in enumerate(parents):
        if isinstance(node, dict):
            holders.append((depth, node))
            node = node.get(part)
        elif isinstance(node, list) and isinstance(part, int) and part < len(node):
            node = node[part]
        else:
            return loc
    holders.append((len(parents), node))
    for depth, holder in reversed(holders):
        if isinstance(holder, dict) and key in holder:
            return (*loc[:depth], key)
    return loc


def _dotted(where: str, loc: tuple[str | int, ...]) -> str:
    path = where
    for part in loc:
        path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else str(part))
    return path
