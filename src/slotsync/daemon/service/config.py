"""Daemon configuration.

Precedence, lowest first: built-in defaults < TOML file (``--config FILE`` or
``SLOTSYNC_CONFIG``) < ``SLOTSYNC_<OPTION>`` environment variables < command-line flags.
Every option is a field of ``Config``; ``slotsyncd --help`` lists them with their defaults.
Invalid configuration is refused at start with the option (and its source) named.

The optional engine table (TOML ``[[engines]]`` with ``url``, ``slot_start``, ``slot_size``)
declares each engine slot ahead of registration: ranks must then register with the declared
slot and URL, ``/status`` shows slots with no rank yet, and SIGHUP re-reads the table.
"""

from __future__ import annotations

import argparse
import difflib
import math
import os
import socket
import tomllib
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path

from slotsync import __version__
from slotsync.daemon.core.coordinator import OMITTED_NAMES_POLICIES
from slotsync.daemon.node_links import spans
from slotsync.daemon.node_links.peer_wire import SpanPart
from slotsync.daemon.service.adapter_root import AdapterRoot, private_problem
from slotsync.daemon.service.adapter_root import resolve as resolve_adapter_root
from slotsync.daemon.service.folders import filesystem_type as filesystem_type  # (kept here)
from slotsync.daemon.service.folders import unusable_folder
from slotsync.daemon.sglang.routes import PAUSE_MODES
from slotsync.protocol.endpoint import SOCKET_NAME, default_runtime_dir
from slotsync.protocol.endpoint import default_endpoint as default_endpoint  # (kept here)
from slotsync.protocol.endpoint import default_runtime_dir_and_origin as _default_runtime_dir
from slotsync.protocol.wire import MAX_MESSAGE_BYTES_DEFAULT, check_engine_url, normalize_gpu_uuid

ENV_PREFIX = "SLOTSYNC_"

KEY_FILES = ("api_key_file", "admin_api_key_file")
"""An engine table entry's API key files (issue 35; ``engine_keys.py``)."""

ENGINE_KINDS = ("", "vllm", "sglang")
"""An engine table entry's ``kind``: "" (not declared: the first begin asks the engine,
``daemon/families.py``), ``vllm`` or ``sglang`` (issue 26)."""


@dataclass(frozen=True)
class EngineEntry:
    """One declared engine: its slot ``[slot_start, slot_start + slot_size)``, URL and,
    optionally, its workers' GPU UUIDs (torch format, any order; normalised: a ``GPU-`` prefix
    and upper case are accepted), which the daemon checks as a set against the ranks' before
    each pause (vLLM's ``/get_world_size`` reports only their count)."""

    url: str
    slot_start: int
    slot_size: int
    gpu_uuids: tuple[str, ...] = ()
    # An engine over several nodes (issue 25; ``spans.py``): the node whose daemon drives it,
    # that daemon's peer_listen address as the other nodes reach it, and each node's ranks.
    owner: str = ""
    owner_address: str = ""
    parts: tuple[SpanPart, ...] = ()
    # issue 26: the engine's kind ("vllm" or "sglang"; "" detects it at the first begin) and,
    # for SGLang, the mode of its /pause_generation (daemon/sglang/routes.py's PAUSE_MODES)
    kind: str = ""
    pause_mode: str = "in_place"
    # issue 35: files holding the API keys the engine was started with (--api-key, SGLang's
    # --admin-api-key); read by engine_keys.py, never printed
    api_key_file: str = ""
    admin_api_key_file: str = ""

    @property
    def spans_nodes(self) -> bool:
        """Whether the engine's workers lie on several nodes (``parts`` declared)."""
        return bool(self.parts)

    @property
    def slot(self) -> tuple[int, int]:
        return (self.slot_start, self.slot_start + self.slot_size)


@dataclass
class Config:
    """Options of ``slotsyncd``. Times in seconds, sizes in bytes."""

    runtime_dir: str = ""  # folder of the ZeroMQ socket; "" = default_runtime_dir()
    socket: str = ""  # full ipc:// endpoint; overrides runtime_dir when set
    state_dir: str = ""  # durable in-flight record (inflight.json); "" = the runtime dir
    status_host: str = "127.0.0.1"  # status server (/healthz, /status, /metrics) bind address
    status_port: int = 9460  # 0 = pick a free port (printed at start); -1 = no status server
    begin_timeout_s: float = 120.0  # first begin -> every rank of the slot begun
    chunk_timeout_s: float = 120.0  # first copy of chunk k -> every rank sent chunk k
    commit_timeout_s: float = 600.0  # last progress -> next chunk or every commit
    engine_timeout_s: float = 300.0  # one vLLM HTTP request
    shutdown_grace_s: float = 60.0  # SIGTERM: how long an update in flight may still finish
    liveness_s: float = 10.0  # a rank's connection silent this long (heartbeats) is gone
    slot_release_s: float = 60.0  # every rank of a slot gone this long: the slot is released
    max_message_bytes: int = MAX_MESSAGE_BYTES_DEFAULT  # cap on one frame from a rank
    chunks_in_flight: int = 3  # /update_weights calls per engine at once (1: one at a time)
    omitted_names: str = "warn"  # an update leaving out names the last one loaded: warn|refuse
    adapter_dir: str = ""  # LoRA adapters for vLLM (issue 36); "" = adapter_root.resolve
    adapter_load_timeout_s: float = 120.0  # an adapter's folder write, and its load call
    allow_uids: str = ""  # peers allowed by user id (comma list); "" = the daemon's own uid
    allow_gids: str = ""  # peers allowed by group id (comma list); "" = the daemon's own gid
    log_level: str = "info"
    log_format: str = "text"  # "text" (key=value) or "json" (one object per line)
    # engines over several nodes (issue 25, docs/multi-node.md)
    node: str = ""  # this daemon's node name; "" = the hostname
    peer_listen: str = ""  # tcp://HOST:PORT other nodes' daemons connect to ("" = none)
    curve_secret_key: str = ""  # this daemon's CURVE key pair file (slotsync keys)
    peer_public_keys: str = ""  # folder of the peers' public keys, <node>.key each
    engines: list[EngineEntry] = field(default_factory=list)  # TOML [[engines]] only
    config_file: str = ""  # where the options came from (for SIGHUP); set by load_config
    # option -> where its value came from ("--runtime-dir", "environment SLOTSYNC_...",
    # "config file F"); set by load_config, named in errors; absent: the default
    sources: dict[str, str] = field(default_factory=dict, repr=False, compare=False)

    def endpoint(self) -> str:
        """The ZeroMQ ROUTER endpoint to bind."""
        if self.socket:
            return self.socket if "://" in self.socket else f"ipc://{self.socket}"
        return f"ipc://{os.path.join(self.runtime_dir or default_runtime_dir(), SOCKET_NAME)}"

    def state_path(self) -> str:
        """The durable in-flight record's path."""
        base = self.state_dir or self.runtime_dir or default_runtime_dir()
        return os.path.join(base, "inflight.json")

    def adapter_root(self) -> AdapterRoot:
        """The LoRA adapter folder (issue 36): ``adapter_dir``, else the default on
        ``/dev/shm``'s filesystem (``/dev/shm/slotsyncd-<uid>/adapters-<key>``), else, with no
        usable ``/dev/shm``, ``adapters`` in the runtime dir (``adapter_root.resolve``)."""
        return resolve_adapter_root(self.adapter_dir, self.endpoint(),
                                    self.runtime_dir or default_runtime_dir())

    def adapter_path(self) -> str:
        """The folder of the LoRA adapter folders the daemon writes for vLLM engines
        (``adapter_root().path``)."""
        return self.adapter_root().path

    def origin(self, name: str) -> str:
        """Where option ``name``'s value came from: a flag, an environment variable, the
        config file, or the default (for an unset ``runtime_dir``: which default)."""
        if name in self.sources:
            return self.sources[name]
        if name == "runtime_dir" and not self.runtime_dir:
            return _default_runtime_dir()[1]
        return "the default"

    def folders(self) -> list[tuple[str, str, str]]:
        """The folders the daemon creates files in, as ``(folder, option, what goes
        there)``: the socket's, and the in-flight record's when that is another one."""
        sock = os.path.dirname(self.endpoint()[len("ipc://"):]) or "."
        state = os.path.dirname(self.state_path())
        sock_opt = "socket" if self.socket else "runtime_dir"
        state_opt = "state_dir" if self.state_dir else "runtime_dir"
        record = "the in-flight record inflight.json, written before each update's start"
        if os.path.abspath(sock) == os.path.abspath(state):
            return [(sock, sock_opt, f"the daemon's socket and {record}, go there")]
        return [(sock, sock_opt, "the daemon's socket goes there"),
                (state, state_opt, f"{record}, goes there")]

    def folder_error(self, folder: str, option: str, holds: str, why: str) -> str:
        """The message refusing ``folder`` (of ``option``) for reason ``why``."""
        label = f"socket folder {folder!r}" if option == "socket" else f"{option} {folder!r}"
        return f"{label}: {why} ({holds}; {option} from {self.origin(option)})"

    def node_name(self) -> str:
        """This daemon's node name: ``node``, else the hostname."""
        return self.node or socket.gethostname()

    def allowed_ids(self) -> tuple[set[int], set[int]]:
        """The peer allow-list ``(uids, gids)``; root (uid 0) is always allowed, since it can
        read any process's memory anyway."""
        def ids(text: str, default: int) -> set[int]:
            return {int(x) for x in text.split(",") if x.strip()} if text.strip() else {default}

        return ids(self.allow_uids, os.getuid()) | {0}, ids(self.allow_gids, os.getgid())

    def validate(self) -> None:
        """Raises ValueError naming the first invalid option."""
        for name in ("allow_uids", "allow_gids"):
            if any(not x.strip().isdigit() for x in getattr(self, name).split(",")
                   if getattr(self, name).strip()):
                raise ValueError(f"{name} must be a comma-separated list of numeric ids, got "
                                 f"{getattr(self, name)!r}")
        for name in ("begin_timeout_s", "chunk_timeout_s", "commit_timeout_s",
                     "engine_timeout_s", "shutdown_grace_s", "liveness_s", "slot_release_s",
                     "adapter_load_timeout_s"):
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"{name} must be a finite number, got {getattr(self, name)}")
        if not 0.1 <= self.liveness_s <= 3600:
            raise ValueError(f"liveness_s must be 0.1..3600 seconds, got {self.liveness_s}")
        if self.slot_release_s < 0:
            raise ValueError(f"slot_release_s must be >= 0, got {self.slot_release_s}")
        for name in ("begin_timeout_s", "chunk_timeout_s", "commit_timeout_s",
                     "engine_timeout_s", "adapter_load_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.shutdown_grace_s < 0:
            raise ValueError(f"shutdown_grace_s must be >= 0, got {self.shutdown_grace_s}")
        if self.omitted_names not in OMITTED_NAMES_POLICIES:
            raise ValueError(f"omitted_names must be {' or '.join(OMITTED_NAMES_POLICIES)}, got "
                             f"{self.omitted_names!r}")
        if not 1 <= self.chunks_in_flight <= 64:
            raise ValueError(f"chunks_in_flight must be 1..64, got {self.chunks_in_flight}")
        if self.max_message_bytes < 1024:
            raise ValueError(f"max_message_bytes must be >= 1024, got {self.max_message_bytes}")
        if not -1 <= self.status_port <= 65535:
            raise ValueError(f"status_port must be -1..65535, got {self.status_port}")
        if self.status_port != -1:
            try:  # resolve, and bind an ephemeral port there (the status port may be taken)
                family, kind, proto, _, addr = socket.getaddrinfo(
                    self.status_host, 0, type=socket.SOCK_STREAM)[0]
                with socket.socket(family, kind, proto) as s:
                    s.bind(addr)
            except (OSError, UnicodeError) as e:
                raise ValueError(f"status_host {self.status_host!r} is not an address this "
                                 f"machine can bind: {e}") from None
        if self.log_level.lower() not in ("debug", "info", "warning", "error"):
            raise ValueError(f"log_level must be debug|info|warning|error, got {self.log_level!r}")
        if self.log_format not in ("text", "json"):
            raise ValueError(f"log_format must be text|json, got {self.log_format!r}")
        ep = self.endpoint()
        if not ep.startswith("ipc:///"):
            raise ValueError(
                f"socket {ep!r} must be ipc:// with an absolute path: CUDA IPC handles are "
                "node-local and the daemon checks each peer's uid/gid, which only Unix "
                "sockets carry"
            )
        if len(ep) - 6 > 107:
            raise ValueError(f"socket path {self.endpoint()[6:]!r} is longer than the 107 "
                             "bytes a Unix socket path may have")
        check_engine_table(self.engines)
        from slotsync.daemon.service.engine_keys import read_engine_keys

        read_engine_keys(self.engines, spans.roles(self.engines, self.node_name()).relayed)
        spans.check_spanning(self.engines, self.node_name(), self.peer_listen,
                             self.curve_secret_key, self.peer_public_keys)
        if spans.roles(self.engines, self.node_name()).relayed or any(
                e.parts for e in self.engines) or self.peer_listen:
            from slotsync.daemon.node_links.peer_keys import PeerKeyError, check_keys

            try:
                check_keys(self.node_name(), self.curve_secret_key, self.peer_public_keys,
                           spans.roles(self.engines, self.node_name()).owners())
            except PeerKeyError as e:
                raise ValueError(str(e)) from None
        # The socket is bound at start, the in-flight record written before each engine's
        # start: a folder that cannot hold them would stop the daemon with a bare errno, or
        # pause every engine and then fail its update. Checked without creating anything.
        for folder, option, holds in self.folders():
            why = unusable_folder(folder)
            if why:
                raise ValueError(self.folder_error(folder, option, holds, why))
        root = self.adapter_root()  # (made at start, mode 0700)
        why = private_problem(root.private) if root.private else ""
        why = why or unusable_folder(root.path)
        if why:
            raise ValueError(self.folder_error(root.path, "adapter_dir",
                                               "LoRA adapter folders for vLLM go there", why))

    def missing_peer_keys(self) -> str:
        """Why the owner's ``peer_public_keys`` cannot admit a node its engines span ('' when
        it can): ``--check-config`` refuses it. The daemon itself starts (it refuses such a
        peer at connection, logged: the way to shut a node out), so this is not in
        ``validate``. Call after ``validate``."""
        peers = spans.roles(self.engines, self.node_name()).peers_of_owned()
        if not peers:
            return ""
        from slotsync.daemon.node_links.peer_keys import load_keys

        keys = load_keys(self.curve_secret_key, self.peer_public_keys)
        lacking = sorted(n for n in peers if keys.key_of(n) is None)
        if not lacking:
            return ""
        return (f"peer_public_keys {self.peer_public_keys!r} has no key of node(s) "
                f"{', '.join(lacking)} ({lacking[0]}.key missing), whose daemons relay to this "
                f"owner and would be refused: copy their .key files there (`slotsync keys "
                f"{lacking[0]}` makes a pair)")

    def describe(self) -> dict:
        """The effective options as a JSON-able dict (``--check-config`` prints it)."""
        d = {f.name: getattr(self, f.name) for f in fields(self)
             if f.name not in ("engines", "sources")}
        d["runtime_dir"] = self.runtime_dir or default_runtime_dir()  # the folder it resolves to
        d["state_dir"] = os.path.dirname(self.state_path())
        d["endpoint"] = self.endpoint()
        d["state_file"] = self.state_path()
        d["adapter_dir"] = self.adapter_path()
        d["node"] = self.node_name()
        d["engines"] = [{**{k: v for k, v in vars(e).items() if k != "parts"},
                         "gpu_uuids": list(e.gpu_uuids),  # (the TOML's key: nodes)
                         "nodes": [{"node": p.node, "ranks": [p.start, p.end]} for p in e.parts]}
                        for e in self.engines]
        return d


def check_engine_table(engines: list[EngineEntry]) -> None:
    """Raises ValueError for non-positive sizes, overlapping slots or a repeated URL."""
    seen: list[EngineEntry] = []
    for e in engines:
        if e.slot_start < 0 or e.slot_size <= 0:
            raise ValueError(f"engines: slot [{e.slot_start}, {e.slot_start + e.slot_size}) of "
                             f"{e.url!r} is empty or negative")
        try:
            check_engine_url(e.url)
        except ValueError as err:
            raise ValueError(f"engines: url {err}") from None
        for o in seen:
            if o.slot_start < e.slot[1] and e.slot_start < o.slot[1]:
                raise ValueError(f"engines: slot [{e.slot[0]}, {e.slot[1]}) of {e.url!r} "
                                 f"overlaps slot [{o.slot[0]}, {o.slot[1]}) of {o.url!r}")
            if o.url == e.url:
                raise ValueError(f"engines: URL {e.url!r} names two slots")
        if e.gpu_uuids:
            if len(e.gpu_uuids) != e.slot_size:
                raise ValueError(f"engines: {e.url!r} lists {len(e.gpu_uuids)} gpu_uuids for a "
                                 f"slot of {e.slot_size} GPUs")
            if len(set(e.gpu_uuids)) != len(e.gpu_uuids):
                raise ValueError(f"engines: {e.url!r} lists a GPU UUID twice")
        seen.append(e)


# Options that can be set (flags, env, TOML); "engines" is TOML only, "config_file" and
# "sources" are internal.
_SCALARS = [f for f in fields(Config)
            if f.name not in ("engines", "config_file", "sources")]

_HELP = {
    "runtime_dir": "folder for the ZeroMQ socket (default: $SLOTSYNC_RUNTIME_DIR, "
    "$RUNTIME_DIRECTORY, $XDG_RUNTIME_DIR/slotsync or /tmp/slotsync-<uid>)",
    "socket": "full ZeroMQ endpoint to bind, e.g. ipc:///run/slotsync/slotsyncd.sock "
    "(overrides --runtime-dir)",
    "state_dir": "folder of the durable in-flight record inflight.json, which tells a restarted "
    "daemon which engines it left mid-update (default: the runtime dir; under systemd use "
    "StateDirectory, since RuntimeDirectory is emptied on restart)",
    "status_host": "bind address of the status server",
    "status_port": "port of the status server (0: any free port, -1: none)",
    "begin_timeout_s": "seconds from a slot's first begin until every rank must have begun",
    "chunk_timeout_s": "seconds from the first copy of a chunk until every rank must have sent it",
    "commit_timeout_s": "seconds without progress before an update waiting for chunks or "
    "commits fails",
    "engine_timeout_s": "seconds one vLLM HTTP request may take",
    "shutdown_grace_s": "on SIGTERM/SIGINT, seconds an update in flight may take to finish "
    "before it is failed (ranks told, engine left paused)",
    "liveness_s": "seconds within which a rank whose connection went silent (ZeroMQ "
    "heartbeats) counts as gone; a closed connection or an exited process counts at once. An "
    "update that still needs a gone rank fails then, naming it",
    "slot_release_s": "seconds after the last rank of a slot is gone until the slot is "
    "released (its ranks forgotten, so a job with another topology can register; what the "
    "daemon knows of the engine stays)",
    "max_message_bytes": "largest frame accepted from a rank, bytes",
    "chunks_in_flight": "/update_weights calls sent to one engine before the first returned "
    "(vLLM runs them in order, so the next chunks are waiting when one finishes; 1: one at a "
    "time, as vLLM's examples do)",
    "omitted_names": "what a successful update that leaves out tensor names the slot's last "
    "successful update loaded does: warn (log line, metric, PublishStats.omitted_names; vLLM "
    "keeps those tensors' old values) or refuse (fail it before the finish)",
    "adapter_dir": "folder where the daemon writes the LoRA adapters vLLM engines load "
    "(issue 36; created mode 0700; default: /dev/shm/slotsyncd-<uid>/adapters-<key>, key the "
    "first 12 hex digits of the sha256 of the daemon's ipc:// endpoint: on /dev/shm's "
    "filesystem an adapter one rank holds whole is linked, not copied; adapters in the runtime "
    "dir when /dev/shm is not a tmpfs this uid can write)",
    "adapter_load_timeout_s": "seconds an adapter round's folder write, and its load call on "
    "the engine, may take each before the round fails (the previous version stays served)",
    "allow_uids": "user ids whose processes may connect (comma list; default: the daemon's "
    "own; root always)",
    "allow_gids": "group ids whose processes may connect (comma list; default: the daemon's "
    "own primary group)",
    "log_level": "debug, info, warning or error",
    "log_format": "text (key=value) or json (one object per line)",
    "node": "this daemon's node name, as engines over several nodes name it in the engine "
    "table (default: the hostname)",
    "peer_listen": "tcp://HOST:PORT where the daemons of other nodes connect, on the node that "
    "owns an engine over several nodes (default: none)",
    "curve_secret_key": "this daemon's CURVE key pair file, made by `slotsync keys NODE` "
    "(needed for engines over several nodes)",
    "peer_public_keys": "folder of the public keys (<node>.key) of the daemons allowed on the "
    "peer link (needed for engines over several nodes)",
}


def _typ(f) -> type:
    name = f.type if isinstance(f.type, str) else f.type.__name__
    return {"int": int, "float": float, "str": str}[name]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="slotsyncd",
        description="slotsync node daemon: aggregates trainer ranks' CUDA IPC handles per "
        "engine slot and drives each vLLM engine's weight update over HTTP.",
        epilog="Precedence: defaults < TOML file (--config or $SLOTSYNC_CONFIG; flat keys named "
        "like the options with underscores, plus [[engines]] tables with url, slot_start, "
        "slot_size and optionally kind, pause_mode, gpu_uuids, api_key_file and "
        "admin_api_key_file: files holding the API keys the engine was started with, "
        "readable by the daemon's user only, never on a command line; for an engine over "
        "several nodes also owner, owner_address and nodes, see docs/multi-node.md) < "
        "SLOTSYNC_<OPTION> environment variables (e.g. SLOTSYNC_STATUS_PORT) < flags. "
        "Signals: SIGTERM/SIGINT stop (updates in flight get --shutdown-grace-s to finish), "
        "SIGHUP re-reads the engine table and its API key files from the config file.",
    )
    p.add_argument("--version", action="version", version=f"slotsyncd {__version__}")
    p.add_argument("--config", type=Path, help="TOML file with any of the options below")
    p.add_argument("--check-config", action="store_true",
                   help="validate the configuration, print it as JSON and exit")
    defaults = Config()
    for f in _SCALARS:
        p.add_argument(
            "--" + f.name.replace("_", "-"), dest=f.name, type=_typ(f), default=None,
            help=f"{_HELP[f.name]} ("
            + (f"default: {getattr(defaults, f.name)!r}; " if getattr(defaults, f.name) != ""
               else "")
            + f"env {ENV_PREFIX}{f.name.upper()})",
        )
    return p


class ConfigError(ValueError):
    """Invalid configuration; the message names the option and where it came from."""


def read_config_file(path: Path, cfg: Config | None = None) -> Config:
    """Apply a TOML file's options onto ``cfg`` (a new default ``Config`` if None).

    Raises:
        ConfigError: unreadable file, bad TOML, unknown key, wrong type, bad engine entry.
    """
    cfg = cfg or Config()
    known = {f.name: f for f in _SCALARS}
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise ConfigError(f"config file {path}: {e}") from None
    for k, v in data.items():
        if k == "engines":
            cfg.engines = _engine_table(path, v)
            continue
        if k not in known:
            raise ConfigError(f"config file {path}: unknown option "
                              f"{_did_you_mean(k, [*known, 'engines'])}")
        want = _typ(known[k])
        if want is float and isinstance(v, int) and not isinstance(v, bool):
            v = float(v)
        if not isinstance(v, want) or isinstance(v, bool):
            raise ConfigError(f"config file {path}: option {k!r} must be {want.__name__}, "
                              f"got {v!r}")
        setattr(cfg, k, v)
        cfg.sources[k] = f"config file {path}"
    cfg.config_file = str(path)
    return cfg


_ENGINE_KEYS = ("url", "slot_start", "slot_size", "gpu_uuids", "kind", "pause_mode",
                *KEY_FILES, *spans.TOML_KEYS)
"""The keys of one ``[[engines]]`` table."""


def _did_you_mean(key: str, known: Sequence[str]) -> str:
    """``'owner_adress' (did you mean 'owner_address'?)``, or the key alone when nothing
    known is close (difflib's ratio >= 0.75)."""
    close = difflib.get_close_matches(key, known, n=1, cutoff=0.75)
    return f"{key!r} (did you mean {close[0]!r}?)" if close else repr(key)


def _engine_table(path: Path, v: object) -> list[EngineEntry]:
    if not isinstance(v, list):
        raise ConfigError(f"config file {path}: 'engines' must be an array of tables "
                          "([[engines]])")
    out = []
    for i, e in enumerate(v):
        unknown = sorted(set(e) - set(_ENGINE_KEYS)) if isinstance(e, dict) else []
        if unknown:
            raise ConfigError(f"config file {path}: engines[{i}]: unknown key(s) "
                              + ", ".join(_did_you_mean(k, _ENGINE_KEYS) for k in unknown)
                              + "; an engine has url, slot_start, slot_size and optionally "
                              "gpu_uuids, kind, pause_mode, api_key_file, admin_api_key_file, "
                              "owner, owner_address and nodes")
        if not isinstance(e, dict) or not {"url", "slot_start", "slot_size"} <= set(e):
            raise ConfigError(f"config file {path}: engines[{i}] must have url, slot_start, "
                              f"slot_size and optionally gpu_uuids, kind, pause_mode, "
                              f"api_key_file, admin_api_key_file, owner, owner_address and "
                              f"nodes; got {e!r}")
        for k, want in (("url", str), ("slot_start", int), ("slot_size", int)):
            if not isinstance(e[k], want) or isinstance(e[k], bool):
                raise ConfigError(f"config file {path}: engines[{i}]: {k} must be "
                                  f"{'a string' if want is str else 'an integer'}, got "
                                  f"{e[k]!r} ({type(e[k]).__name__})")
        uuids = e.get("gpu_uuids", [])
        if not isinstance(uuids, list) or not all(isinstance(u, str) for u in uuids):
            raise ConfigError(f"config file {path}: engines[{i}]: gpu_uuids must be a list of "
                              "strings")
        try:
            norm = tuple(normalize_gpu_uuid(u) for u in uuids)
        except ValueError as err:
            raise ConfigError(f"config file {path}: engines[{i}]: gpu_uuids: {err}") from None
        try:
            owner, address, parts = spans.parse_toml(e)
        except ValueError as err:
            raise ConfigError(f"config file {path}: engines[{i}]: {err}") from None
        kind, pause_mode = e.get("kind", ""), e.get("pause_mode", "in_place")
        if kind not in ENGINE_KINDS:
            raise ConfigError(f"config file {path}: engines[{i}]: kind {kind!r}: use one of "
                              f"{', '.join(repr(k) for k in ENGINE_KINDS[1:])} (or leave it "
                              "out: the daemon asks the engine)")
        if pause_mode not in PAUSE_MODES:
            raise ConfigError(f"config file {path}: engines[{i}]: pause_mode {pause_mode!r}: "
                              f"use one of {', '.join(repr(m) for m in PAUSE_MODES)} (SGLang's "
                              "/pause_generation modes)")
        if "pause_mode" in e and kind != "sglang":
            raise ConfigError(f"config file {path}: engines[{i}]: pause_mode is SGLang's; "
                              "declare kind = \"sglang\" with it")
        if not all(isinstance(e.get(k, ""), str) for k in KEY_FILES):
            raise ConfigError(f"config file {path}: engines[{i}]: api_key_file and "
                              "admin_api_key_file are paths (strings)")
        out.append(EngineEntry(e["url"], e["slot_start"], e["slot_size"], norm, owner, address,
                               parts, kind, pause_mode, *(e.get(k, "") for k in KEY_FILES)))
    return out


def load_config(argv: list[str] | None = None,
                environ: dict[str, str] | None = None) -> tuple[Config, bool]:
    """Parse defaults, file, environment and flags into a validated ``Config``.

    Returns:
        ``(config, check_only)``: ``check_only`` is True for ``--check-config``.

    Raises:
        SystemExit: via argparse (status 2), naming the option, for unknown keys, bad types or
            invalid values.
    """
    env = os.environ if environ is None else environ
    parser = build_parser()
    args = parser.parse_args(argv)
    cfg = Config()
    path = args.config or (Path(env[ENV_PREFIX + "CONFIG"]) if env.get(ENV_PREFIX + "CONFIG")
                           else None)
    try:
        if path is not None:
            read_config_file(path, cfg)
        for f in _SCALARS:
            raw = env.get(ENV_PREFIX + f.name.upper())
            if raw is None:
                continue
            try:
                setattr(cfg, f.name, _typ(f)(raw))
            except ValueError:
                raise ConfigError(f"environment {ENV_PREFIX}{f.name.upper()}={raw!r}: not "
                                  f"a valid {_typ(f).__name__}") from None
            cfg.sources[f.name] = f"environment {ENV_PREFIX}{f.name.upper()}"
    except ConfigError as e:
        parser.exit(2, f"slotsyncd: error: {e}\n")
    for f in _SCALARS:
        v = getattr(args, f.name)
        if v is not None:
            setattr(cfg, f.name, v)
            cfg.sources[f.name] = "--" + f.name.replace("_", "-")
    try:
        cfg.validate()
    except ValueError as e:
        name = str(e).split(" ", 1)[0]  # (validate names the option first)
        where = f" (set by {cfg.sources[name]})" if name in cfg.sources else ""
        parser.exit(2, f"slotsyncd: error: {e}{where}\n")
    missing = cfg.missing_peer_keys() if args.check_config else ""
    if missing:
        parser.exit(2, f"slotsyncd: error: {missing}\n")
    return cfg, bool(args.check_config)
