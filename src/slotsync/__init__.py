"""slotsync: per-node weight-sync daemon for colocated RL post-training.

Packages: ``slotsync.protocol`` (wire schema, topology, trainer-side publisher),
``slotsync.daemon`` (the ``slotsyncd`` service), ``slotsync.engine`` (a reference engine that
speaks vLLM's weight-transfer HTTP contract).
"""

from importlib import metadata as _metadata

UNKNOWN_VERSION = "0+unknown"
"""The version reported when slotsync runs from a source tree that was never installed (no
package metadata): PEP 440's local form, so nothing mistakes it for a release."""


def package_version() -> str:
    """slotsync's version from the installed package's metadata (``pyproject.toml``'s
    ``version``, e.g. ``"0.1.0"``); ``UNKNOWN_VERSION`` when slotsync is not installed (run
    from a source tree on ``PYTHONPATH``)."""
    try:
        return _metadata.version("slotsync")
    except _metadata.PackageNotFoundError:
        return UNKNOWN_VERSION


__version__ = package_version()
