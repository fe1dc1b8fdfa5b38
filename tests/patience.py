"""How long a test waits for something that should happen, on a machine that may be busy.

A correctness test waits on a condition and returns as soon as it holds; its deadline is
only how long to wait before calling the test failed. On a loaded two-core machine
(another suite beside this one, CPU burners) a process start, an agent registering or a
broker coming back takes ten times longer than on a quiet one, so a deadline tuned on a
quiet machine fails there for no fault of the code. Every waiting helper therefore
waits at least :data:`PATIENCE_S` (``DXPOOL_TEST_PATIENCE_S``, 120 s by default): a
passing test is as fast as before, a failing one takes longer to say so. How fast
things are is measured in ``bench/``, not asserted here.

A test that must show something does *not* happen for a while (a lease that outlives
its TTL, a compose that must not place yet) keeps its own short interval: that is a
wait for nothing, not a deadline.
"""

from __future__ import annotations

import os

PATIENCE_S = float(os.environ.get("DXPOOL_TEST_PATIENCE_S", "120"))


def patient(timeout_s: float) -> float:
    """``timeout_s``, or :data:`PATIENCE_S` when that is longer."""
    return max(timeout_s, PATIENCE_S)


__all__ = ["PATIENCE_S", "patient"]
