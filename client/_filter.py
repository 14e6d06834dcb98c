"""Filtered samples: the value (`FILTERED`) a dataset returns, or the exception (`Filtered`) it raises, to reject one."""

from __future__ import annotations

from typing import Any


class _FilteredType:
    """The type of :data:`FILTERED`: one value, the same after pickling (a DataLoader's workers send it back)."""

    _one: _FilteredType | None = None

    def __new__(cls) -> _FilteredType:
        if cls._one is None:
            cls._one = super().__new__(cls)
        return cls._one

    def __reduce__(self) -> str:
        return "FILTERED"  # pickled by name: unpickles as this module's FILTERED

    def __repr__(self) -> str:
        return "croupier.client.FILTERED"

    def __bool__(self) -> bool:
        return False


FILTERED = _FilteredType()
"""What a dataset returns in place of a sample it rejects (a quality or length filter): the
packed loader trains none of it, counts it as taken (it is not dealt again, nor missing) and
records it in the audit log's ``filtered`` records. ``Indexed(ds)[i]`` is then ``(i, FILTERED)``."""


class Filtered(Exception):  # noqa: N818  (a sample's fate, as StopIteration names one)
    """Raised by a dataset's ``__getitem__`` to reject a sample: :class:`croupier.client.Indexed` turns it
    into ``(index, FILTERED)``; the message (the reason) is not kept."""


def is_filtered(doc: Any) -> bool:
    """Whether a loaded sample is the rejection :data:`FILTERED`."""
    return doc is FILTERED or isinstance(doc, _FilteredType)
