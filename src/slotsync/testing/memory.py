"""This machine's available memory, against which the demo and the control-plane benchmark
check their estimate before starting anything (``slotsync.demo.config.memory_problem``,
``slotsync.bench.control.control_memory_problem``). Moved from ``slotsync.demo.config``
(issue 35) so that both use it. Standard library only.
"""

from __future__ import annotations

import os

MEMORY_MARGIN = 0.8
"""A run is refused when its estimate exceeds this share of MemAvailable."""
MEMINFO_ENV = "SLOTSYNC_DEMO_MEMINFO"
"""Environment variable naming a file read instead of /proc/meminfo (for tests)."""


def mem_available(meminfo: str | None = None) -> int | None:
    """``MemAvailable`` (bytes) from ``meminfo`` (default: ``$SLOTSYNC_DEMO_MEMINFO``, else
    /proc/meminfo); None where there is no such file or line (not Linux)."""
    path = meminfo or os.environ.get(MEMINFO_ENV) or "/proc/meminfo"
    try:
        with open(path, encoding="ascii", errors="replace") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key == "MemAvailable":
                    value, *unit = rest.split()
                    return int(value) * (1024 if unit == ["kB"] else 1)
    except (OSError, ValueError):
        return None
    return None


def fits(need: int, available: int | None) -> bool:
    """Whether ``need`` bytes stay within ``MEMORY_MARGIN`` of ``available`` (True when
    ``available`` is None: unknown, no check)."""
    return available is None or need <= MEMORY_MARGIN * available
