"""``@dataclass`` for the package's own classes, made at a fraction of the standard one's start-up cost.

The standard decorator compiles five or six methods per class from source and
imports :mod:`inspect` (with :mod:`ast` and :mod:`dis`): for the two dozen
classes a tree sync loads, about 20 ms of every run, a fifth of a small sync.
This one compiles only ``__init__`` (the one whose speed matters: some
classes are made per file), when a class is first made, and builds
``__repr__``, ``__eq__``, ``__hash__`` and a frozen class's ``__setattr__``
from :func:`operator.attrgetter`.

The subset the package uses: ``frozen``, ``eq``, ``repr``, defaults,
``field(default=..., default_factory=...)``, ``__post_init__``, inheritance
between such classes, and :func:`replace`. :func:`dataclasses.fields`,
:func:`dataclasses.replace` and :func:`dataclasses.is_dataclass` work on them
too: ``__dataclass_fields__`` is made, with the standard module, when first asked for.
"""

from __future__ import annotations

from operator import attrgetter

#: "No default" (for a field, and for :func:`field`'s arguments).
MISSING = type("MISSING", (), {"__repr__": lambda self: "MISSING"})()


class FrozenInstanceError(AttributeError):
    """Assigning to a field of a frozen record (as :class:`dataclasses.FrozenInstanceError`)."""


class Field:
    """A field: its name, annotation and default (or factory of defaults)."""

    __slots__ = ("name", "type", "default", "default_factory")

    def __init__(self, default=MISSING, default_factory=MISSING) -> None:
        if default is not MISSING and default_factory is not MISSING:
            raise ValueError("cannot specify both default and default_factory")
        self.name = ""
        self.type = None
        self.default = default
        self.default_factory = default_factory

    def __repr__(self) -> str:
        return f"Field(name={self.name!r}, default={self.default!r}, default_factory={self.default_factory!r})"


def field(*, default=MISSING, default_factory=MISSING) -> Field:
    """A field's default, or a factory of defaults (``field(default_factory=list)``)."""
    return Field(default, default_factory)


def dataclass(cls=None, *, frozen: bool = False, eq: bool = True, repr: bool = True):
    """Make ``cls`` a record, as :func:`dataclasses.dataclass` would (``@dataclass`` or ``@dataclass(...)``)."""

    def wrap(cls):
        return _make(cls, frozen, eq, repr)

    return wrap if cls is None else wrap(cls)


def fields(record) -> tuple:
    """The :class:`Field` objects of a record class or instance, in order."""
    return tuple(record.__record_fields__.values())


def replace(record, **changes):
    """A copy of ``record`` with ``changes`` (made through ``__init__``, so ``__post_init__`` runs)."""
    for name in record.__record_fields__:
        if name not in changes:
            changes[name] = getattr(record, name)
    return record.__class__(**changes)


class _StandardFields:
    """``__dataclass_fields__``, for :mod:`dataclasses`' functions: made when asked for, then kept."""

    def __get__(self, instance, owner):
        import dataclasses

        made = {}
        for name, own in owner.__record_fields__.items():
            standard = dataclasses.field(
                default=dataclasses.MISSING if own.default is MISSING else own.default,
                default_factory=dataclasses.MISSING if own.default_factory is MISSING else own.default_factory)
            standard.name, standard.type = name, own.type
            standard._field_type = dataclasses._FIELD  # what fields() and replace() look for
            made[name] = standard
        owner.__dataclass_fields__ = made
        return made


def _is_class_variable(annotation) -> bool:
    text = annotation if isinstance(annotation, str) else getattr(annotation, "__name__", repr(annotation))
    return text.startswith(("ClassVar", "typing.ClassVar")) or "ClassVar[" in text[:20]


def _make(cls, frozen: bool, eq: bool, want_repr: bool):
    every: dict = {}
    for base in reversed(cls.__mro__[1:]):
        every.update(getattr(base, "__dict__", {}).get("__record_fields__", {}))
    for name, annotation in cls.__dict__.get("__annotations__", {}).items():
        if _is_class_variable(annotation):
            continue
        value = cls.__dict__.get(name, MISSING)
        own = value if isinstance(value, Field) else Field(value)
        own.name, own.type = name, annotation
        if isinstance(own.default, (list, dict, set)):
            raise ValueError(f"mutable default {type(own.default)} for field {name} is not allowed: "
                             f"use default_factory")
        if own.default is MISSING:
            if name in cls.__dict__:
                delattr(cls, name)
        else:
            setattr(cls, name, own.default)
        every[name] = own
    cls.__record_fields__ = every
    cls.__dataclass_fields__ = _StandardFields()
    names = tuple(every)
    if "__init__" not in cls.__dict__:
        _check_order(every)
        cls.__init__ = _compiled_when_first_called(cls, every, frozen)
    values = attrgetter(*names) if len(names) > 1 else \
        (lambda record, name=names[0]: (getattr(record, name),)) if names else (lambda record: ())
    if want_repr and "__repr__" not in cls.__dict__:
        def __repr__(self):
            shown = ", ".join(f"{name}={value!r}" for name, value in zip(names, values(self)))
            return f"{self.__class__.__qualname__}({shown})"

        cls.__repr__ = __repr__
    explicit_hash = "__hash__" in cls.__dict__ and not (cls.__dict__["__hash__"] is None and "__eq__" in cls.__dict__)
    if eq and "__eq__" not in cls.__dict__:
        def __eq__(self, other):
            if other.__class__ is self.__class__:
                return values(self) == values(other)
            return NotImplemented

        cls.__eq__ = __eq__
    if frozen:
        def __setattr__(self, name, value):
            if type(self) is cls or name in every:
                raise FrozenInstanceError(f"cannot assign to field {name!r}")
            super(cls, self).__setattr__(name, value)

        def __delattr__(self, name):
            if type(self) is cls or name in every:
                raise FrozenInstanceError(f"cannot delete field {name!r}")
            super(cls, self).__delattr__(name)

        cls.__setattr__, cls.__delattr__ = __setattr__, __delattr__
    if not explicit_hash and eq:
        if frozen:
            cls.__hash__ = lambda self: hash(values(self))
        else:
            cls.__hash__ = None  # mutable and compared by value: unhashable, as dataclasses make it
    return cls


def _check_order(every: dict) -> None:
    seen_default = False
    for name, own in every.items():
        if own.default is not MISSING or own.default_factory is not MISSING:
            seen_default = True
        elif seen_default:
            raise TypeError(f"non-default argument {name!r} follows default argument")


def _compiled_when_first_called(cls, every: dict, frozen: bool):
    """An ``__init__`` that compiles the real one and puts it in its place: about half the
    records a run loads are never made, and each compile costs ~0.2 ms."""

    def __init__(self, *args, **kwargs):
        compiled = _init(cls, every, frozen)
        cls.__init__ = compiled
        compiled(self, *args, **kwargs)

    __init__.__qualname__ = f"{cls.__qualname__}.__init__"
    return __init__


def _init(cls, every: dict, frozen: bool):
    """``__init__``, compiled from source as the standard module writes it (keyword and positional)."""
    namespace = {"MISSING": MISSING, "__object_setattr": object.__setattr__}
    parameters, lines = [], []
    for name, own in every.items():  # in an order _check_order allowed
        if own.default_factory is not MISSING:
            namespace[f"__factory_{name}"] = own.default_factory
            parameters.append(f"{name}=MISSING")
            value = f"__factory_{name}() if {name} is MISSING else {name}"
        elif own.default is not MISSING:
            namespace[f"__default_{name}"] = own.default
            parameters.append(f"{name}=__default_{name}")
            value = name
        else:
            parameters.append(name)
            value = name
        lines.append(f"__object_setattr(self, {name!r}, {value})" if frozen else f"self.{name} = {value}")
    if hasattr(cls, "__post_init__"):
        lines.append("self.__post_init__()")
    source = f"def __init__(self, {', '.join(parameters)}):\n    " + "\n    ".join(lines or ["pass"]) + "\n"
    exec(compile(source, f"<record {cls.__qualname__}>", "exec"), namespace)
    function = namespace["__init__"]
    function.__qualname__ = f"{cls.__qualname__}.__init__"
    return function


__all__ = ["MISSING", "Field", "FrozenInstanceError", "dataclass", "field", "fields", "replace"]
