"""Torch's CPU threads against the cores other work leaves free.

torch starts one thread per core. When other processes keep some of those cores busy, its
threads wait on each other at every matrix product, and a sweep on the CPU runs many times
slower than with fewer threads (two cores shared with one busy process: every sweep 8–13×
slower with torch's default two threads than with one, the grids equal). pipatch cannot see
that from inside a run, so the engine asks :func:`warn_if_oversubscribed` before each sweep
on a backend that computes on this process's threads, and the first time torch's threads
outnumber the free cores it says so in one :class:`~pipatch.PipatchWarning` line with the fix.

The free cores are ``os.cpu_count()`` less the 1-minute load average (:func:`os.getloadavg`)
of the *other* processes: this process's own share of it (its CPU time over the wall time
since it was last asked) is taken out, so a notebook that has just run sweeps on every core
is not told that its own threads are the load.
"""

from __future__ import annotations

import os
import time

import torch

from .errors import warn

__all__ = ["cpu_load", "free_cores", "thread_advice", "warn_if_oversubscribed"]

#: (wall, CPU) seconds of this process when the load was last read: its own share of the load since.
_last_seen = (time.monotonic(), time.process_time())
_warned = False


def _own_load() -> float:
    """This process's busy threads, on average, since the load was last read (or pipatch imported)."""
    global _last_seen
    wall, cpu = time.monotonic(), time.process_time()
    (wall_before, cpu_before), _last_seen = _last_seen, (wall, cpu)
    return (cpu - cpu_before) / (wall - wall_before) if wall > wall_before else 0.0


def cpu_load() -> float:
    """The busy threads of the other processes on this machine, about: the 1-minute load
    average (:func:`os.getloadavg`; 0 where the system has none, Windows) less this process's
    own share of it. The one place the engine reads the load."""
    try:
        system = os.getloadavg()[0]
    except (AttributeError, OSError):
        system = 0.0
    return max(0.0, system - _own_load())


def free_cores(load: float | None = None) -> float:
    """The cores other work leaves free: ``os.cpu_count()`` less ``load`` (``None``:
    :func:`cpu_load`), never below 0."""
    return max(0.0, (os.cpu_count() or 1) - (cpu_load() if load is None else load))


def thread_advice(threads: int, free: float) -> str | None:
    """The line saying that ``threads`` torch threads outnumber ``free`` cores, with the fix;
    ``None`` when they do not (``free`` rounded, and at least one core: one thread is never
    too many)."""
    fits = max(1, int(free + 0.5))
    if threads <= fits:
        return None
    return (f"pipatch: torch computes on {threads} threads but about {free:.1f} of this machine's "
            f"{os.cpu_count() or 1} cores are free (the rest busy with other work), so each sweep may run several "
            f"times slower: call torch.set_num_threads({fits}) before running (or start Python with "
            f"OMP_NUM_THREADS={fits})")


def warn_if_oversubscribed(load: float | None = None) -> bool:
    """Warn once per process (:class:`~pipatch.PipatchWarning`, one line) when torch's threads
    (:func:`torch.get_num_threads`) outnumber the free cores (:func:`free_cores` of ``load``);
    True when it warned now."""
    global _warned
    if _warned:
        return False
    line = thread_advice(torch.get_num_threads(), free_cores(load))
    if line is None:
        return False
    _warned = True
    warn(line)
    return True

