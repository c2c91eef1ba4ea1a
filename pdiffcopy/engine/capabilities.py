"""Optional operations in groups, each operation stated once.

An endpoint interface (a file, a tree) keeps the operations every kind has.
What only some kinds can do comes in capabilities: classes of a few
operations implemented together, which the interface inherits. Each
operation is written once, in its capability: the docstring says what a
kind that has the capability does, the body is what the engine gets from
a kind that has not (the portable way, or "unsupported").

A kind names the capabilities it has in ``capabilities`` and implements
every operation of each (:func:`check_declared`, run as the class is made).
The engine still asks by operation, never by kind. :func:`without` makes an
endpoint behave as a kind without one capability, by name, as rclone's
``Features.Disable`` does.
"""

from __future__ import annotations

import types
from typing import FrozenSet, Sequence


class Capability:
    """A few optional operations implemented together; their bodies are the fallbacks."""

    @classmethod
    def operations(cls) -> FrozenSet[str]:
        """The names of the operations this capability states."""
        return frozenset(name for name, value in vars(cls).items() if callable(value) and not name.startswith("_"))


def check_declared(kind: type, known: Sequence[type]) -> None:
    """Refuse a kind that names a capability it does not implement whole, or one that is not its interface's.

    :raises TypeError: Naming the kind, the capability and the operations missing.
    """
    for capability in kind.capabilities:
        if capability not in known:
            raise TypeError(f"{kind.__name__} names {capability.__name__}, which is not a capability of its kind")
        missing = sorted(name for name in capability.operations()
                         if getattr(kind, name) is getattr(capability, name))
        if missing:
            raise TypeError(f"{kind.__name__} has {capability.__name__} but does not implement "
                            f"{', '.join(missing)}")


def without(endpoint: object, name: str) -> None:
    """Make ``endpoint`` behave as a kind without the capability called ``name``: its operations
    become the fallbacks, for every caller (the endpoint's own methods included).

    :raises ValueError: When the endpoint's kind has no capability of that name.
    """
    found = [capability for capability in endpoint.capabilities if capability.__name__ == name]
    if not found:
        raise ValueError(f"{getattr(endpoint, 'location', endpoint)} has no capability {name}")
    capability = found[0]
    for operation in capability.operations():
        setattr(endpoint, operation, types.MethodType(getattr(capability, operation), endpoint))
    endpoint.capabilities = tuple(other for other in endpoint.capabilities if other is not capability)


__all__ = ["Capability", "check_declared", "without"]
