"""The engines' API keys: read from the files the engine table names (issue 35).

An engine started with ``--api-key`` (vLLM, SGLang) or ``--admin-api-key`` (SGLang) wants
``Authorization: Bearer <key>`` (which routes want which key: the families' clients,
``daemon/engine_http.py`` ``EngineHttp.key_for``). Its ``[[engines]]`` entry names a file
holding each key -- ``api_key_file``, ``admin_api_key_file`` -- never the key itself, and no
flag or environment variable takes one, so a key is in no command line, no ``/proc/PID/
environ`` and no log (``describe()`` prints the file names). The files are read at start
(``Config.validate``, so ``--check-config`` checks them) and again at each SIGHUP reload; a
file that cannot serve refuses the start (the reload: keeps the running table and keys).

A key file is refused, as ssh refuses a private key file (``sshkey_perm_ok``; the rule of
the peer link's ``curve_secret_key``, ``node_links/peer_keys.py`` ``too_open``): when others
have any permission on it, or, for a file the daemon's user owns, its group has (a file of
another owner readable through the daemon's group -- ``0640 root:slotsync``, a Kubernetes
secret with ``fsGroup`` and ``defaultMode: 0440`` -- is taken); and when it is not a regular
file, cannot be read, is empty, or holds more than one line, a blank inside the key or a
character that is not printable ASCII (an HTTP header value).
"""

from __future__ import annotations

import os
import stat
from collections.abc import Container, Iterable
from typing import Protocol

from slotsync.daemon.engine_http import EngineKeys

MAX_KEY_BYTES = 4096
"""The longest key file taken, bytes."""


class _Entry(Protocol):
    url: str
    slot: tuple[int, int]
    kind: str
    api_key_file: str
    admin_api_key_file: str


def read_key_file(path: str, option: str, url: str) -> str:
    """The key in ``path`` (surrounding blanks and the final newline stripped), the file of
    ``option`` for engine ``url``.

    Raises:
        ValueError: the file is refused (the module's rules), naming the option, the engine
            and what to do; never the file's content.
    """
    where = f"engines: {option} {path!r} of {url!r}"
    if not os.path.isabs(path):
        raise ValueError(f"{where}: give an absolute path (the daemon's working directory "
                         "is not the config file's)")
    try:
        st = os.stat(path)
    except OSError as e:
        raise ValueError(f"{where}: cannot read it: {e.strerror}") from None
    if not stat.S_ISREG(st.st_mode):
        raise ValueError(f"{where}: not a regular file")
    mode = stat.S_IMODE(st.st_mode)
    if mode & 0o007 or (st.st_uid == os.getuid() and mode & 0o070):
        raise ValueError(
            f"{where}: permissions {mode:04o} are too open: an API key must be readable by "
            f"its owner only (chmod 600 {path}, owned by the daemon's user; ssh refuses a "
            "private key file the same way)")
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_KEY_BYTES + 1)
    except OSError as e:
        raise ValueError(f"{where}: cannot read it: {e.strerror}") from None
    if len(raw) > MAX_KEY_BYTES:
        raise ValueError(f"{where}: longer than {MAX_KEY_BYTES} bytes: is it a key file?")
    key = raw.strip()
    if not key:
        raise ValueError(f"{where}: the file is empty: write the key the engine was "
                         "started with into it")
    if not all(0x21 <= b <= 0x7E for b in key):
        raise ValueError(f"{where}: the key holds a blank, a line break or a character that "
                         "is not printable ASCII: the file must hold the key alone, on one "
                         "line")
    return key.decode("ascii")


def read_engine_keys(engines: Iterable[_Entry],
                     skip: Container[tuple[int, int]] = ()) -> dict[str, EngineKeys]:
    """The keys of every engine of the table that names a key file, by URL (without a
    trailing ``/``); ``skip``: slots of engines another node's daemon drives (their keys
    are that node's).

    Raises:
        ValueError: a key file refused (``read_key_file``), or ``admin_api_key_file`` on an
            engine declared ``kind = "vllm"`` (vLLM has no admin key).
    """
    out: dict[str, EngineKeys] = {}
    for e in engines:
        if e.slot in skip or not (e.api_key_file or e.admin_api_key_file):
            continue
        if e.admin_api_key_file and e.kind == "vllm":
            raise ValueError(f"engines: admin_api_key_file of {e.url!r}: vLLM has no admin "
                             "key (SGLang's --admin-api-key); give its --api-key in "
                             "api_key_file")
        out[e.url.rstrip("/")] = EngineKeys(
            read_key_file(e.api_key_file, "api_key_file", e.url) if e.api_key_file else "",
            read_key_file(e.admin_api_key_file, "admin_api_key_file", e.url)
            if e.admin_api_key_file else "",
            e.api_key_file, e.admin_api_key_file)
    return out
