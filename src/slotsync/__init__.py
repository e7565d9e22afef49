"""slotsync: per-node weight-sync daemon for colocated RL post-training.

Packages (docs/architecture.md has the map; pyproject.toml's import-linter contracts check it):
``slotsync.protocol`` (the wire schema, engine-slot topology, and in ``protocol.rank`` the
trainer-side publisher), ``slotsync.daemon`` (the ``slotsyncd`` service), ``slotsync.engine``
(the reference engine and the engines that run vLLM's and SGLang's own code),
``slotsync.integrations`` (vLLM's trainer API and FSDP2 sources), ``slotsync.bench`` (the
benchmarks), ``slotsync.testing`` (what tests, benchmarks and the demo share) and the
``slotsync`` commands (``cli``, the demo). Imports go down that list's layers: the commands
above the benchmarks, above the daemon, the engines and the integrations, above
``testing``, above ``protocol``.
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
