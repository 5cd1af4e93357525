"""Progress bars for the long commands (`dspark bench`, `dspark calibrate`): tqdm on stderr
when it is installed (it is not a runtime dependency), else a silent stand-in."""
from __future__ import annotations

import sys


class _Silent:
    def update(self, n: int = 1) -> None:
        pass

    def close(self) -> None:
        pass


def progress(total: int, desc: str, unit: str):
    """A bar with update(n) and close()."""
    try:
        from tqdm import tqdm
    except ImportError:
        return _Silent()
    return tqdm(total=total, desc=desc, unit=unit, dynamic_ncols=True, file=sys.stderr)
