"""`NativeField`: a read-only attribute forwarded to the object a planner class wraps.

The planner's Python classes (:class:`~harts_planner.RolloutBatch`, :class:`~harts_planner.StepPlan`,
:class:`~harts_planner.CallPlan` and its parts) wrap a C++ object, or for a plan received from a
sidecar a namespace of arrays decoded from the wire, in ``self._native``. Each of their arrays and
scalars is one line::

    class CallLayout:
        segment_start = NativeField("int32 [V]: s_v.")

``plan.segment_start`` is ``plan._native.segment_start`` (the same read-only numpy view: no copy),
assigning or deleting it raises ``AttributeError``, and ``help()``, ``inspect.getdoc`` and Sphinx show
the docstring under the attribute's name. O(1) per access.
"""

from __future__ import annotations

from typing import Any, overload


class NativeField:
    """A read-only data descriptor: ``owner.<name>`` reads ``owner._native.<name>``.

    Parameters
    ----------
    doc : str
        The attribute's docstring (dtype, shape and meaning).
    """

    def __init__(self, doc: str):
        self.__doc__ = doc
        self.name = ""

    def __set_name__(self, owner, name: str) -> None:
        self.name = name

    @overload
    def __get__(self, obj: None, objtype: type | None = None) -> NativeField: ...
    @overload
    def __get__(self, obj: object, objtype: type | None = None) -> Any: ...
    def __get__(self, obj: Any, objtype: type | None = None) -> Any:
        if obj is None:  # class access (help(), Sphinx): the descriptor itself, with its docstring
            return self
        return getattr(obj._native, self.name)

    def __set__(self, obj, value) -> None:
        raise AttributeError(f"{self.name} is read-only")

    def __delete__(self, obj) -> None:
        raise AttributeError(f"{self.name} is read-only")

    def __repr__(self) -> str:
        return f"NativeField({self.name!r})"


__all__ = ["NativeField"]
