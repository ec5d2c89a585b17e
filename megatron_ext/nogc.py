"""Python's cyclic garbage collector paused while layouts are built, a refit plans and builds its staging.

Building layouts and planning create thousands of small objects (boxes, runs, transfers, views), which trigger the
collector's full passes over every object of the process; in a training process that heap is large.
With a heap of a million small objects (CPU, the 3b preset, colocated TP4 -> TP1xDP4, 4740
transfers), the plan took 42-50 ms, and 307-325 ms when a full pass fell inside it; with the
collector paused, 42-44 ms every time. Nothing planned here forms a reference cycle, so pausing only
defers the collector's work to after the plan.
"""

from __future__ import annotations

import contextlib
import gc

__all__ = ["paused_gc"]


@contextlib.contextmanager
def paused_gc():
    """Pause the cyclic garbage collector inside (a context manager or a decorator); restored after,
    also on an error, and left alone when it was already off."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()
