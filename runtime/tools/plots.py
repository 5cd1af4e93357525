"""matplotlib, imported only by the commands that draw (it is not a runtime dependency)."""
from __future__ import annotations

from ..errors import DSparkError


def pyplot():
    try:
        import matplotlib
    except ImportError as e:
        raise DSparkError(f"plots need matplotlib (pip install matplotlib, or the [export] extra): {e}") from e
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
