"""The samplers' surface: every parameter documented (docstring and docs), wrong types refused by name,
and combinations that do nothing warned about."""

from __future__ import annotations

import inspect
import pathlib
import re
import warnings
from typing import Any

import pytest

from croupier.client import DistributedBatchSampler, DistributedSampler, shards

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _documented(obj: Any) -> set[str]:
    """The names of the docstring's Args lines (``name:`` or ``name, other:``)."""
    doc = inspect.getdoc(obj) or ""
    return {n for pair in re.findall(r"^ {4}(\w+)(?:, (\w+))?: ", doc, flags=re.M) for n in pair if n}


@pytest.mark.parametrize("obj", [DistributedSampler, DistributedBatchSampler, shards], ids=lambda o: o.__name__)
def test_every_parameter_is_documented(obj: Any) -> None:
    params = set(inspect.signature(obj).parameters) - {"self"}
    doc = _documented(obj)
    if "the other arguments are" in (inspect.getdoc(obj) or "").lower():  # the rest: the samplers' docstrings
        doc |= _documented(DistributedSampler) | _documented(DistributedBatchSampler)
    assert params - doc == set(), f"{obj.__name__}: parameters without a line in the docstring"
    table = (ROOT / "docs" / "samplers.md").read_text()
    named = set(re.findall(r"`(\w+)`", "".join(line.split("|")[1] for line in table.splitlines() if line.startswith("| `"))))
    assert params - named == set(), f"{obj.__name__}: parameters missing from docs/samplers.md"


@pytest.mark.parametrize("kw", [{"shuffle": "yes"}, {"drop_last": 1}, {"lockstep": None}, {"seed": 1.5}])
def test_wrong_types_are_refused_by_name(kw: dict[str, Any]) -> None:
    (name, value), = kw.items()
    with pytest.raises(TypeError, match=rf"{name} must be .*\(got {name}={value!r}\)"):
        DistributedSampler(100, num_replicas=1, rank=0, **kw)


@pytest.mark.parametrize("make, says", [
    (lambda: DistributedSampler(100, num_replicas=1, rank=0, lockstep=False), "lockstep=False has no effect"),
    (lambda: DistributedBatchSampler(100, 4, num_replicas=1, rank=0, buffer_size=8), "buffer_size=8 has no effect"),
    (lambda: DistributedSampler(100, num_replicas=1, rank=0, permutation="window", buffer_size=5, pack_size=3),
     "pack_size=3 has no effect"),
    (lambda: DistributedSampler(100, num_replicas=1, rank=0, drop_last=True, tail="pad"), "drop_last=True has no effect"),
    (lambda: shards(100, 2, buffer_size=4), "buffer_size=4 has no effect"),
])
def test_what_does_nothing_warns(make: Any, says: str) -> None:
    with pytest.warns(UserWarning, match=re.escape(says)) as rec:
        s = make()
    assert rec[0].filename == __file__, "the warning points at the caller's line"
    if hasattr(s, "close"):
        s.close()


def test_what_does_something_is_quiet() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for s in (DistributedSampler(100, num_replicas=1, rank=0, lockstep=False, dealing="dynamic"),
                  DistributedSampler(100, num_replicas=1, rank=0, permutation="window", buffer_size=5),
                  DistributedSampler(100, num_replicas=1, rank=0, drop_last=True, tail="drop"),
                  DistributedSampler(100, num_replicas=1, rank=0, shuffle=False, seed=7),  # as torch's: quiet
                  DistributedBatchSampler(100, 4, num_replicas=1, rank=0, drop_last=True, tail="pad")):
            s.close()


def test_worker_options_start_workers_safely_for_this_python() -> None:
    import sys

    from croupier.client import worker_options
    from croupier.client._workers import FIXED_IN

    assert worker_options(0) == {"num_workers": 0}
    expected = {"num_workers": 2} if sys.version_info >= FIXED_IN else {
        "num_workers": 2, "multiprocessing_context": "spawn", "persistent_workers": True}
    assert worker_options(2) == expected
    with pytest.raises(ValueError, match=r"num_workers must be >= 0 \(got num_workers=-1\)"):
        worker_options(-1)
    for bad in (1.5, True):
        with pytest.raises(TypeError, match=f"num_workers must be an int \\(got num_workers={bad!r}\\)"):
            worker_options(bad)  # type: ignore[arg-type]
