"""One spawn of gloo ranks for every case of a parametrized multi-process test of one world size.

A spawned rank imports torch and the runtime before it runs anything: seconds of CPU per process,
most of what a small case costs. :class:`SharedSpawns` runs all the selected cases of a world size in
one :func:`run_distributed` call, each rank calling ``worker(rank, world, *args)`` case after case
on the same default process group (each case still builds its own mesh and model), and hands each
parametrized test its case's per-rank results, to be checked as before.

A case that raises on a rank ends that spawn, with an error naming the case (its peers then fail
with "Connection closed by peer"); every test of that world size then fails with that error.
"""

from __future__ import annotations

import gc

import pytest

from harts_runtime.parallel import run_distributed
from harts_runtime.parallel.launch import DistributedRunError

__all__ = ["SharedSpawns", "selected_cases"]


def _run_cases(rank, world, cases):
    """In each rank: ``worker(rank, world, *args)`` for each ``(name, worker, args)`` of ``cases`` in
    turn."""
    out = {}
    for name, worker, args in cases:
        try:
            out[name] = worker(rank, world, *args)
        except BaseException as e:
            raise RuntimeError(f"case {name!r} failed on rank {rank}") from e
        gc.collect()
    return out


def selected_cases(request, *test_names: str, param: str = "case") -> list[str]:
    """The cases of the collected (not deselected) items of ``test_names`` in the requesting module,
    in their order: an item's ``param`` where it is parametrized by it, else its name (with its
    parameters' ids: ``request.node.name`` in the test)."""
    out = []
    for item in request.session.items:
        if item.module is not request.module or item.originalname not in test_names:
            continue
        spec = getattr(item, "callspec", None)
        case = spec.params[param] if spec is not None and param in spec.params else item.name
        if case not in out:
            out.append(case)
    return out


class SharedSpawns:
    """Each case's per-rank results (:meth:`results`); the first case of a world size asked for runs
    every selected case of that world size, in one spawn.

    ``cases``: name -> ``(world, worker, args)``, ``worker(rank, world, *args)`` being the case on
    one rank (a module-level function); ``selected``: the names to run (:func:`selected_cases`; a
    name asked for outside it runs too); ``timeout``: seconds per case (the spawn's limit is that
    times its case count)."""

    def __init__(self, cases: dict[str, tuple], selected, timeout: float = 300.0):
        self.cases, self.timeout = cases, timeout
        self.selected = list(selected)
        self._done: dict[str, list | Exception] = {}  # case -> its per-rank results or its spawn's error

    def results(self, case: str) -> list:
        if case not in self._done:
            world = self.cases[case][0]
            names = [case] + [
                n for n in self.selected if self.cases[n][0] == world and n != case and n not in self._done
            ]
            try:
                per_rank = run_distributed(
                    _run_cases,
                    world,
                    [(n, *self.cases[n][1:]) for n in names],
                    timeout=self.timeout * len(names),
                )
                self._done.update({n: [r[n] for r in per_rank] for n in names})
            except DistributedRunError as e:
                self._done.update(dict.fromkeys(names, e))
        got = self._done[case]
        if isinstance(got, Exception):
            names = ", ".join(n for n, r in self._done.items() if r is got)
            pytest.fail(f"the spawn of cases {names} failed; {case!r} not checked:\n{got}", pytrace=False)
        return got
