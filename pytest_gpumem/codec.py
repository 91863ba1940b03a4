"""One codec for the package's dataclasses: :func:`to_data` makes JSON-ready data of one, :func:`from_data`
reads it back. Both follow the fields' type hints; :func:`coded` fields say where they differ (a renamed or
nested key, a value left out when it is the default, a custom form, keys derived from the object)."""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from enum import Enum
from functools import cache
from typing import Any, ClassVar, TypeVar

__all__ = ["Coded", "coded", "from_data", "to_data"]

T = TypeVar("T")
_UNSET: Any = object()


@dataclasses.dataclass(frozen=True)
class _Coding:
    key: str | None = None  #: the data's key (``"rest.peak"``: key ``peak`` of the object under ``rest``)
    omit: bool = False  #: left out when it equals the field's default
    missing: Any = _UNSET  #: the value when the key is absent or null (else the field's default)
    write: Callable[[Any], Any] | None = None
    read: Callable[[Any], Any] | None = None
    then: Mapping[str, Callable[[Any], Any]] = dataclasses.field(default_factory=dict)  #: keys derived after it
    skip: bool = False  #: never written (read when present)
    flat: bool = False  #: its object's keys are written into the parent's, and read from there


_PLAIN = _Coding()


def coded(
    *,
    key: str | None = None,
    omit: bool = False,
    missing: Any = _UNSET,
    write: Callable[[Any], Any] | None = None,
    read: Callable[[Any], Any] | None = None,
    then: Mapping[str, Callable[[Any], Any]] | None = None,
    skip: bool = False,
    flat: bool = False,
) -> dict[str, Any]:
    """A field's coding, as its metadata: ``field(default=None, metadata=coded(omit=True))``."""
    return {"codec": _Coding(key, omit, missing, write, read, then or {}, skip, flat)}


class Coded:
    """A dataclass that serialises through the codec: ``to_dict()`` and ``from_dict(data)``."""

    #: the keys written first, in this order (the others follow in the fields' order)
    _codec_order: ClassVar[tuple[str, ...]] = ()
    #: reading refuses keys that are not the fields'
    _codec_strict: ClassVar[bool] = False

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = to_data(self)
        return data

    @classmethod
    def from_dict(cls: type[T], data: Mapping[str, Any]) -> T:
        return from_data(cls, data)


@cache
def _fields(cls: type) -> tuple[tuple[dataclasses.Field[Any], _Coding, Any], ...]:
    hints = typing.get_type_hints(cls)
    return tuple((f, f.metadata.get("codec", _PLAIN), hints[f.name]) for f in dataclasses.fields(cls))


def _default(f: dataclasses.Field[Any]) -> Any:
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return f.default


def to_data(value: Any) -> Any:
    """``value`` as JSON-ready data: a dataclass as an object of its fields in their order, a mapping as an
    object, a tuple, list or set as an array (a set sorted), an enum as its value."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        out: dict[str, Any] = {}
        for f, coding, _hint in _fields(type(value)):
            item = getattr(value, f.name)
            if not coding.skip and not (coding.omit and item == _default(f)):
                encoded = coding.write(item) if coding.write else to_data(item)
                *path, last = (coding.key or f.name).split(".")
                node = out
                for part in path:
                    node = node.setdefault(part, {})
                if coding.flat:
                    node.update(encoded)
                else:
                    node[last] = encoded
            for name, derive in coding.then.items():
                out[name] = derive(value)
        first = getattr(value, "_codec_order", ())
        return {**{key: out.pop(key) for key in first if key in out}, **out} if first else out
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, Mapping):
        return {key: to_data(item) for key, item in value.items()}
    if isinstance(value, (set, frozenset)):
        return sorted(to_data(item) for item in value)
    if isinstance(value, (list, tuple)):
        return [to_data(item) for item in value]
    return value


def from_data(cls: type[T], data: Any, where: str = "") -> T:
    """The ``cls`` dataclass that :func:`to_data` wrote as ``data``; keys it does not know are ignored.
    Raises ``ValueError`` naming the key (``where`` leads it) for a value of the wrong type or a missing one."""
    if not isinstance(data, Mapping):
        raise ValueError(f"{where or cls.__name__}: expected an object, found {type(data).__name__}")
    if getattr(cls, "_codec_strict", False):
        known = {(c.key or f.name).split(".")[0] for f, c, _ in _fields(typing.cast(type, cls))}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"{where or cls.__name__}: unknown key(s) {', '.join(unknown)}")
    values: dict[str, Any] = {}
    for f, coding, hint in _fields(typing.cast(type, cls)):
        if not f.init:
            continue
        key = coding.key or f.name
        raw: Any = data
        for part in () if coding.flat else key.split("."):
            raw = raw.get(part) if isinstance(raw, Mapping) else None
        if raw is None and not (_nullable(hint) and _has(data, key)):
            if coding.missing is not _UNSET:
                values[f.name] = coding.missing
            elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                if not _nullable(hint):
                    raise ValueError(f"{where}.{key}: missing" if where else f"missing {key!r}")
                values[f.name] = None
            continue
        here = f"{where}.{key}" if where else key
        values[f.name] = coding.read(raw) if coding.read else _read(hint, raw, here)
    return cls(**values)


def _has(data: Mapping[str, Any], key: str) -> bool:
    *path, last = key.split(".")
    for part in path:
        data = data.get(part) or {}
    return last in data


def _nullable(hint: Any) -> bool:
    return hint is Any or type(None) in typing.get_args(hint)


def _read(hint: Any, value: Any, where: str) -> Any:
    """``value`` read as the type ``hint`` says."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None:
            return None
        kinds = [a for a in args if a is not type(None)]
        return _read(kinds[0], value, where) if len(kinds) == 1 else value
    if dataclasses.is_dataclass(hint):
        return from_data(typing.cast(type, hint), value, where)
    if isinstance(hint, type) and issubclass(hint, Enum):
        return hint(value)
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_read(args[0], item, f"{where}[{i}]") for i, item in enumerate(value))
        return tuple(_read(a, item, f"{where}[{i}]") for i, (a, item) in enumerate(zip(args, value, strict=True)))
    if origin in (list, Sequence):
        return [_read(args[0], item, f"{where}[{i}]") for i, item in enumerate(value)]
    if origin in (set, frozenset):
        return frozenset(_read(args[0], item, where) for item in value)
    if origin in (dict, Mapping):
        return {str(k): _read(args[1], item, f"{where}.{k}") for k, item in value.items()}
    if hint in (int, float, str, bool):
        try:
            return hint(value)
        except (TypeError, ValueError):
            raise ValueError(f"{where}: expected {hint.__name__}, found {value!r}") from None
    return value
