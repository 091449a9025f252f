"""Summary statistics shared by the trainer checks (train_check.py, verl_check.py; trainer venv).

Its own module so that the two checks each import it and neither imports the other's internals:
train_check.py loads verl_check.py for ``--trainer verl``, and verl_check.py needs only this.
numpy only.
"""

from __future__ import annotations

import numpy as np


def stats(values: list[float] | np.ndarray) -> dict[str, float]:
    """n, mean, p50, p99 and max of ``values`` (``{"n": 0}`` when there are none)."""
    a = np.asarray(values, dtype=np.float64)
    if a.size == 0:
        return {"n": 0}
    return {
        "n": int(a.size),
        "mean": float(a.mean()),
        "p50": float(np.quantile(a, 0.5)),
        "p99": float(np.quantile(a, 0.99)),
        "max": float(a.max()),
    }
