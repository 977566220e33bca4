"""JSON for numpy values: the ``default=`` hook every JSON writer in k2edge uses."""

from __future__ import annotations


def json_default(obj):
    """numpy scalars as Python numbers, tuples and sets as lists; anything else is an error."""
    import numpy as np

    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, (tuple, set)):
        return list(obj)
    raise TypeError(f"not JSON serialisable: {type(obj).__name__}")
