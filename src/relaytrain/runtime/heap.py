"""The controller's heap kept out of Python's garbage collector while the run trains.

At 1,024 workers the controller turns every worker's result of every step into objects that
die a step later; their allocations start the collector's passes, and each full pass walks every
object the process holds (torch's and the run's set-up: ~180,000 here), tens of milliseconds a
pass under load, a few milliseconds a step on average (bench control-plane). Freezing what
exists when the loop starts (`gc.freeze`) leaves those passes only the objects made since.
Reference counting still frees everything as before; only cycles among the frozen objects wait
for the unfreeze at the end."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def frozen_heap() -> Iterator[None]:
    """The objects alive on entry are left out of garbage-collection passes until exit (then
    collected as usual again). Process-wide: not for two runs at once in one process."""
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
