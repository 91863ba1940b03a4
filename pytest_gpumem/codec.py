"""One codec for the package's dataclasses, led by the type hints and :func:`coded` field metadata."""

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


def coded(**coding: Any) -> dict[str, Any]:
    """A field's coding (the options of :class:`_Coding`) as its metadata: ``field(metadata=coded(omit=True))``."""
    return {"codec": _Coding(**coding)}


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


class _Field(typing.NamedTuple):
    """How one field is written and read: its coding, its key's path, its default, its reader."""

    name: str
    coding: _Coding
    path: tuple[str, ...]
    default: Any  # _UNSET: none
    nullable: bool
    read: Callable[[Any], Any]
    init: bool
    plain: bool  # written as it is under its own name (no coding)


@cache
def _fields(cls: type) -> tuple[_Field, ...]:
    hints = typing.get_type_hints(cls)
    plan = []
    for f in dataclasses.fields(cls):
        coding: _Coding = f.metadata.get("codec", _PLAIN)
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        default = _UNSET if default is dataclasses.MISSING else default
        hint = hints[f.name]
        nullable = hint is Any or type(None) in typing.get_args(hint)
        read = coding.read or _reader(hint)
        path = () if coding.flat else tuple((coding.key or f.name).split("."))
        plan.append(_Field(f.name, coding, path, default, nullable, read, f.init, coding == _PLAIN))
    return tuple(plan)


_SCALARS = frozenset((int, float, str, bool, type(None)))


def to_data(value: Any) -> Any:
    """``value`` as JSON-ready data (dataclasses as objects in field order, sets sorted, enums as values)."""
    kind: Any = type(value)
    if kind in _SCALARS:
        return value
    if hasattr(kind, "__dataclass_fields__"):
        out: dict[str, Any] = {}
        for f in _fields(kind):
            item = getattr(value, f.name)
            if f.plain:
                out[f.name] = item if type(item) in _SCALARS else to_data(item)
                continue
            coding = f.coding
            if not coding.skip and not (coding.omit and item == f.default):
                encoded = coding.write(item) if coding.write else to_data(item)
                node = out
                for part in f.path[:-1]:
                    node = node.setdefault(part, {})
                if coding.flat:
                    node.update(encoded)
                else:
                    node[f.path[-1]] = encoded
            for name, derive in coding.then.items():
                out[name] = derive(value)
        first = getattr(kind, "_codec_order", ())
        return {**{key: out.pop(key) for key in first if key in out}, **out} if first else out
    if kind is list or kind is tuple:
        return [to_data(item) for item in value]
    if kind is dict or isinstance(value, Mapping):
        return {key: to_data(item) for key, item in value.items()}
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, (set, frozenset)):
        return sorted(to_data(item) for item in value)
    if isinstance(value, (list, tuple)):
        return [to_data(item) for item in value]
    return value


class _Bad(ValueError):
    """A value of the wrong type; ``path`` gathers its keys as the error goes up."""

    def __init__(self, problem: str) -> None:
        super().__init__(problem)
        self.problem = problem
        self.path: list[str] = []


def from_data(cls: type[T], data: Any, where: str = "") -> T:
    """The ``cls`` dataclass :func:`to_data` wrote as ``data``, unknown keys ignored; ``ValueError`` naming the key path
    of a missing or wrong value."""
    try:
        made: T = _from(cls, data)
        return made
    except _Bad as bad:
        path = where + "".join(bad.path).removeprefix("" if where else ".")
        raise ValueError(f"{path}: {bad.problem}" if path else bad.problem) from None


def _from(cls: Any, data: Any) -> Any:
    if type(data) is not dict and not isinstance(data, Mapping):
        raise _Bad(f"expected an object, found {_shown(data)}")
    fields = _fields(cls)
    if getattr(cls, "_codec_strict", False):
        unknown = sorted(set(data) - {f.path[0] for f in fields if f.path})
        if unknown:
            raise _Bad(f"unknown key(s) {', '.join(unknown)}")
    values: dict[str, Any] = {}
    for f in fields:
        if not f.init:
            continue
        raw: Any = data
        for part in f.path:
            raw = raw.get(part, _UNSET) if type(raw) is dict or isinstance(raw, Mapping) else _UNSET
        if raw is _UNSET or (raw is None and not f.nullable):
            if f.coding.missing is not _UNSET:
                values[f.name] = f.coding.missing
            elif f.default is _UNSET:
                if not f.nullable:
                    raise _Bad(f"missing {'.'.join(f.path)!r}")
                values[f.name] = None
        elif raw is None:
            values[f.name] = None
        else:
            try:
                values[f.name] = f.read(raw)
            except _Bad as bad:
                bad.path.insert(0, "." + ".".join(f.path))
                raise
    return cls(**values)


def _shown(value: Any) -> str:
    return "an array" if isinstance(value, list) else "an object" if isinstance(value, dict) else repr(value)


def _same(value: Any) -> Any:
    return value


@cache
def _reader(hint: Any) -> Callable[[Any], Any]:
    """What reads a value of the type ``hint``."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        kinds = [a for a in args if a is not type(None)]
        return _reader(kinds[0]) if len(kinds) == 1 else _same  # null is read before
    if dataclasses.is_dataclass(hint):
        return lambda value: _from(hint, value)
    if isinstance(hint, type) and issubclass(hint, Enum):
        return hint
    if origin in (tuple, list, Sequence, set, frozenset):
        fixed = origin is tuple and not (len(args) == 2 and args[1] is Ellipsis)
        items = [_reader(a) for a in args] if fixed else None
        each = _reader(args[0])
        made: Callable[[Any], Any] = {tuple: tuple, set: frozenset, frozenset: frozenset}.get(origin, list)

        def array(value: Any) -> Any:
            if type(value) is not list:
                raise _Bad(f"expected an array, found {_shown(value)}")
            if items is not None and len(items) != len(value):
                raise _Bad(f"expected {len(items)} items, found {len(value)}")
            out = []
            for i, item in enumerate(value):
                try:
                    out.append(items[i](item) if items is not None else each(item))
                except _Bad as bad:
                    bad.path.insert(0, f"[{i}]")
                    raise
            return made(out)

        return array
    if origin in (dict, Mapping):
        each = _reader(args[1])

        def mapping(value: Any) -> dict[str, Any]:
            if type(value) is not dict:
                raise _Bad(f"expected an object, found {_shown(value)}")
            out = {}
            for key, item in value.items():
                try:
                    out[str(key)] = each(item)
                except _Bad as bad:
                    bad.path.insert(0, f".{key}")
                    raise
            return out

        return mapping
    if hint in (int, float, str, bool):

        def scalar(value: Any) -> Any:
            if type(value) is hint:
                return value
            try:
                return hint(value)
            except (TypeError, ValueError):
                raise _Bad(f"expected {hint.__name__}, found {_shown(value)}") from None

        return scalar
    return _same
