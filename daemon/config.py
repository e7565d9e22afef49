"""Daemon configuration: defaults < TOML file (``--config``) < command-line flags.

Every option is a field of ``Config``; ``slotsyncd --help`` lists them with their defaults.
"""

from __future__ import annotations

import argparse
import os
import tomllib
from dataclasses import dataclass, fields
from pathlib import Path

from slotsync.protocol.wire import MAX_MESSAGE_BYTES_DEFAULT


def default_runtime_dir() -> str:
    """``$SLOTSYNC_RUNTIME_DIR``, else ``$RUNTIME_DIRECTORY`` (systemd), else
    ``$XDG_RUNTIME_DIR/slotsync``, else ``/tmp/slotsync-<uid>``."""
    for var in ("SLOTSYNC_RUNTIME_DIR", "RUNTIME_DIRECTORY"):
        if os.environ.get(var):
            return os.environ[var]
    if os.environ.get("XDG_RUNTIME_DIR"):
        return os.path.join(os.environ["XDG_RUNTIME_DIR"], "slotsync")
    return f"/tmp/slotsync-{os.getuid()}"


SOCKET_NAME = "slotsyncd.sock"


def default_endpoint() -> str:
    """The ZeroMQ endpoint a publisher connects to by default: ``ipc://<runtime_dir>/slotsyncd.sock``."""
    return f"ipc://{os.path.join(default_runtime_dir(), SOCKET_NAME)}"


@dataclass
class Config:
    """Options of ``slotsyncd``. Times in seconds, sizes in bytes."""

    runtime_dir: str = ""  # folder of the ZeroMQ socket; "" = default_runtime_dir()
    socket: str = ""  # full ipc:// endpoint; overrides runtime_dir when set
    status_host: str = "127.0.0.1"  # status server (/healthz, /status, /metrics) bind address
    status_port: int = 9460  # 0 = pick a free port (printed at start); -1 = no status server
    begin_timeout_s: float = 120.0  # first begin -> every rank of the slot begun
    chunk_timeout_s: float = 120.0  # first copy of chunk k -> every rank sent chunk k
    commit_timeout_s: float = 600.0  # last progress -> next chunk or every commit
    engine_timeout_s: float = 300.0  # one vLLM HTTP request
    max_message_bytes: int = MAX_MESSAGE_BYTES_DEFAULT  # cap on one frame from a rank
    log_level: str = "info"

    def endpoint(self) -> str:
        """The ZeroMQ ROUTER endpoint to bind."""
        if self.socket:
            return self.socket if "://" in self.socket else f"ipc://{self.socket}"
        return f"ipc://{os.path.join(self.runtime_dir or default_runtime_dir(), SOCKET_NAME)}"

    def validate(self) -> None:
        """Raises ValueError naming the first invalid option."""
        for name in ("begin_timeout_s", "chunk_timeout_s", "commit_timeout_s", "engine_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.max_message_bytes < 1024:
            raise ValueError(f"max_message_bytes must be >= 1024, got {self.max_message_bytes}")
        if not -1 <= self.status_port <= 65535:
            raise ValueError(f"status_port must be -1..65535, got {self.status_port}")
        if self.log_level.lower() not in ("debug", "info", "warning", "error"):
            raise ValueError(f"log_level must be debug|info|warning|error, got {self.log_level!r}")


_HELP = {
    "runtime_dir": "folder for the ZeroMQ socket (default: $SLOTSYNC_RUNTIME_DIR, "
    "$RUNTIME_DIRECTORY, $XDG_RUNTIME_DIR/slotsync or /tmp/slotsync-<uid>)",
    "socket": "full ZeroMQ endpoint to bind, e.g. ipc:///run/slotsync/slotsyncd.sock "
    "(overrides --runtime-dir)",
    "status_host": "bind address of the status server",
    "status_port": "port of the status server (0: any free port, -1: none)",
    "begin_timeout_s": "seconds from a slot's first begin until every rank must have begun",
    "chunk_timeout_s": "seconds from the first copy of a chunk until every rank must have sent it",
    "commit_timeout_s": "seconds without progress before an update waiting for chunks or "
    "commits fails",
    "engine_timeout_s": "seconds one vLLM HTTP request may take",
    "max_message_bytes": "largest frame accepted from a rank, bytes",
    "log_level": "debug, info, warning or error",
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="slotsyncd",
        description="slotsync node daemon: aggregates trainer ranks' CUDA IPC handles per "
        "engine slot and drives each vLLM engine's weight update over HTTP.",
        epilog="Precedence: defaults < --config TOML file (flat keys named like the options, "
        "with underscores) < flags.",
    )
    p.add_argument("--config", type=Path, help="TOML file with any of the options below")
    defaults = Config()
    for f in fields(Config):
        typ = {"int": int, "float": float, "str": str}[
            f.type if isinstance(f.type, str) else f.type.__name__
        ]
        p.add_argument(
            "--" + f.name.replace("_", "-"),
            dest=f.name,
            type=typ,
            default=None,
            help=f"{_HELP[f.name]} (default: {getattr(defaults, f.name)!r})",
        )
    return p


def load_config(argv: list[str] | None = None) -> Config:
    """Parse flags and the optional TOML file into a validated ``Config``.

    Raises:
        SystemExit: via argparse, with the option named, for unknown keys, bad types or
            invalid values.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    cfg = Config()
    known = {f.name: f for f in fields(Config)}
    if args.config is not None:
        try:
            data = tomllib.loads(args.config.read_text())
        except (OSError, tomllib.TOMLDecodeError) as e:
            parser.error(f"--config {args.config}: {e}")
        for k, v in data.items():
            if k not in known:
                parser.error(f"--config {args.config}: unknown option {k!r}")
            want = type(getattr(cfg, k))
            if want is float and isinstance(v, int) and not isinstance(v, bool):
                v = float(v)
            if not isinstance(v, want) or isinstance(v, bool):
                parser.error(f"--config {args.config}: option {k!r} must be {want.__name__}")
            setattr(cfg, k, v)
    for k in known:
        v = getattr(args, k)
        if v is not None:
            setattr(cfg, k, v)
    try:
        cfg.validate()
    except ValueError as e:
        parser.error(str(e))
    return cfg
