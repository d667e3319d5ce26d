"""Progress bars for long benchmarks and conversions (tqdm), on stderr and only on a terminal."""

from __future__ import annotations

from tqdm import tqdm


def progress_bar(total: int, unit: str, *, desc: str | None = None, quiet: bool = False) -> tqdm:
    """A tqdm bar over `total` steps of `unit` on stderr; silent when `quiet` (e.g. under --json)
    or when stderr is not a terminal (logs and pipes get no carriage-return noise)."""
    return tqdm(total=total, unit=unit, desc=desc, disable=True if quiet else None, leave=False, dynamic_ncols=True)
