"""How slotsync's commands (``slotsync ...``) and the daemon (``slotsyncd``) leave when their
stdout's reader goes away (``slotsync demo | head -3``): the exit status they report and the
quiet end of their output.

A leaf module: it imports nothing of slotsync, so that every command, the demo and the daemon
may import it (the layers contract in ``pyproject.toml`` holds it beside ``protocol``).
"""

from __future__ import annotations

import os
import sys

CLOSED_STDOUT_EXIT = 141
"""Exit status of a command cut short because its stdout's reader went away (``slotsync demo
| head -3``): 128 + SIGPIPE, what a program killed by SIGPIPE reports."""


def discard_stdout() -> None:
    """Point stdout's file descriptor at /dev/null after its reader went away (a
    ``BrokenPipeError`` from a print): Python's flush at exit then writes nowhere, instead of
    printing 'Exception ignored ... BrokenPipeError' on stderr."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, sys.stdout.fileno())
    finally:
        os.close(devnull)
