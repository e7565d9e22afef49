"""vLLM's Triton notice is hidden in the children of a process that has shown it, and only
that notice (issue 24 E; ``slotsync.testing.vllm_notices``). The whole chain, a demo with
vLLM's code printing it once, is ``test_demo_against_vllms_own_engine_code`` in
``tests/integration/test_demo.py``."""

from __future__ import annotations

import logging

import pytest

from slotsync.testing import vllm_notices as vn

NOTICES = [  # what vllm/triton_utils/importing.py logs at import (vLLM 0.32)
    (logging.WARNING, "Triton is installed, but doesn't include CPU backend. Disabling Triton."),
    (logging.INFO, "Triton is installed but %d active driver(s) found (expected 1). Disabling "
                   "Triton to prevent runtime errors."),
    (logging.INFO, "Triton not installed or not compatible; certain GPU-related functions "
                   "will not be available."),
]


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.seen: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.seen.append(record.getMessage())


@pytest.fixture
def triton_logger():
    """vLLM's Triton logger with a recording handler, restored afterwards."""
    logger = logging.getLogger(vn.TRITON_LOGGER)
    filters, level = list(logger.filters), logger.level
    records = _Records()
    logger.addHandler(records)
    logger.setLevel(logging.DEBUG)
    try:
        yield logger, records
    finally:
        logger.removeHandler(records)
        logger.filters[:] = filters
        logger.setLevel(level)


def _log_all(logger: logging.Logger) -> None:
    for level, text in NOTICES:
        logger.log(level, text, *((0,) if "%d" in text else ()))
    logger.warning("Triton kernel cache at %s", "/tmp/x")  # another message: kept


def test_a_child_asked_by_its_parent_hides_the_notice_and_nothing_else(triton_logger,
                                                                       monkeypatch):
    logger, records = triton_logger
    monkeypatch.setenv(vn.HIDE_ENV, "")  # (restored afterwards, whatever sets it)
    assert vn.hide_triton_notice_if_asked() is False  # not asked: shows it
    _log_all(logger)
    assert len(records.seen) == 4

    records.seen.clear()
    vn.hide_triton_notice_in_children()  # the parent (monkeypatch restores the environment)
    assert vn.hide_triton_notice_if_asked() is True  # in the child
    vn.hide_triton_notice()  # idempotent
    assert logger.filters.count(vn._FILTER) == 1
    _log_all(logger)
    assert records.seen == ["Triton kernel cache at /tmp/x"]
    other = logging.getLogger("vllm.other")  # other vLLM loggers untouched
    assert vn._FILTER not in other.filters
