"""Human-readable quantities for messages and printed summaries: ``1.05 MB``, ``32.8 kFLOP``.

>>> human(1_050_000, "B"), human(32_768, "B"), human(512, "B")
('1.05 MB', '32.8 kB', '512 B')

A leaf: imports nothing.
"""

from __future__ import annotations


def human(n: int, unit: str) -> str:
    """``1.05 MB``, ``32.8 kB``, ``512 B``: three significant digits, SI prefixes."""
    if abs(n) < 1000:
        return f"{n} {unit}"
    v = float(n)
    for prefix in "kMGTPE":
        v /= 1000
        if abs(v) < 999.5:
            break
    return f"{v:#.3g}".rstrip(".") + f" {prefix}{unit}"
