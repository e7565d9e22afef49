"""Why a trainer rank cannot talk to its node's slotsyncd: the true reason, within a second.

A ZeroMQ ``connect`` to an ``ipc://`` endpoint never fails: libzmq retries in the background,
and the rank sees only a timeout later. ``check_endpoint`` looks at the socket file itself
(a few ``stat`` calls and one plain ``AF_UNIX`` connect) and names what is wrong. Pure
Python, no torch, no ZeroMQ (design.md I6).
"""

from __future__ import annotations

import errno
import grp
import os
import pwd
import socket
import stat

from slotsync.protocol.errors import SlotsyncError

__all__ = ["check_endpoint"]

_PHASE = "connect"
# sockaddr_un.sun_path holds 108 bytes on Linux, the terminating NUL included.
_MAX_UNIX_PATH = 107


def check_endpoint(endpoint: str, *, timeout_s: float = 1.0) -> None:
    """Check that a trainer rank can reach the daemon at ``endpoint``; raise the true reason
    if it cannot.

    For ``ipc://PATH`` (``PATH`` absolute or relative to the working directory), in order:

    1. Each folder above ``PATH``, from ``/`` down: it must exist and be a folder, else
       ``no socket at PATH: is slotsyncd running? (...) ...`` naming the first missing
       component (slotsyncd creates its runtime dir when it starts, so a missing one means
       it never started with this dir). Each must grant this process search (x) permission
       (``os.access(X_OK)``), else ``cannot open PATH as uid U (user): its folder D is
       drwxrwx--- (0770) owner:group; add the user to group G ...`` naming that folder.
    2. ``PATH`` itself: missing: ``no socket at PATH: is slotsyncd running? (`slotsync
       status` says; the daemon's runtime dir is DIR ...)``; not a socket (a regular file, a
       folder, ...): says what it is; not writable (connecting to a unix socket needs write
       permission, ``os.access(W_OK)``): the ``cannot open`` message naming the socket's
       mode and owner.
    3. One plain ``AF_UNIX``/``SOCK_STREAM`` connect, with ``timeout_s``: ``ECONNREFUSED``
       (a socket file left by a killed daemon): ``socket PATH exists but nothing listens on
       it: slotsyncd is not running (...)``; ``EACCES``/``EPERM``: the ``cannot open``
       message; a connection accepted: return ``None``, the probe closed at once. A listener
       whose backlog is full (``EAGAIN``) or that does not answer within ``timeout_s`` is
       alive but busy: also ``None`` (the ZeroMQ connect retries until it gets in).

    Modes are shown as ``drwxrwx--- (0770)``; owner and group by name (``pwd``/``grp``),
    else by number. As root (``os.geteuid() == 0``) the permission checks are skipped: root
    can open any file. ``ipc://@NAME`` (Linux abstract namespace: no file, no permissions)
    gets only the connect probe. A path longer than a unix socket address holds (107 bytes)
    is refused, since neither the daemon nor ZeroMQ can use it.

    The probe never sends a byte: it connects and closes, which the daemon tolerates (its
    own ``runtime_dir.claim_ipc_path`` does the same at start, to tell a live daemon from a
    stale file).

    ``tcp://`` (and any other transport) is not checked: it returns at once. There is no
    file to stat and no permission to read there; an address that refuses or a host that is
    down is the ZeroMQ connect's to report, and a firewall that drops packets cannot be told
    from a slow daemon within a second anyway.

    Args:
        endpoint: the daemon's ZeroMQ endpoint, as given to the publisher.
        timeout_s: the most the connect probe may wait, seconds (> 0).

    Raises:
        SlotsyncError: ``phase="connect"``; ``code`` is ``"no_socket"`` (``PATH`` or a
            folder above it is missing), ``"permission"`` (a folder or the socket that this
            uid cannot open), ``"not_a_socket"`` (something else at ``PATH``),
            ``"not_listening"`` (a stale socket file), ``"bad_path"`` (too long) or
            ``"connect"`` (another ``OSError`` from the probe, its text included).
        ValueError: ``timeout_s`` is not > 0.
    """
    if not timeout_s > 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
    if not endpoint.startswith("ipc://"):
        return  # tcp:// and the rest: nothing on this host to check (see above)
    path = endpoint[len("ipc://"):]
    if path.startswith("@"):
        _probe(path, "\0" + path[1:], timeout_s, None)
        return
    if len(os.fsencode(path)) > _MAX_UNIX_PATH:
        raise _error(
            "bad_path",
            f"socket path {path} is {len(os.fsencode(path))} bytes long; a unix socket "
            f"address holds at most {_MAX_UNIX_PATH}: use a shorter --runtime-dir/--socket",
        )
    root = os.geteuid() == 0
    folder = os.path.dirname(os.path.abspath(path))
    above: tuple[str, os.stat_result] | None = None  # the folder checked last
    for d in _ancestors(folder):
        try:
            st = os.stat(d)
        except FileNotFoundError:
            link = f" (a symlink to {os.readlink(d)}, which does not exist)" \
                if os.path.islink(d) else ""
            raise _missing(path, f"folder {d} does not exist{link}; slotsyncd creates its "
                           "runtime dir when it starts, so none has started with this one "
                           "(is this its --runtime-dir / --socket?)") from None
        except PermissionError:  # os.access said yes, but an ACL or a security module refuses
            raise _denied(path, *above) if above else _error(
                "permission", f"cannot stat {d} as uid {_me()}") from None
        if not stat.S_ISDIR(st.st_mode):
            raise _missing(path, f"{d} is {_kind(st.st_mode)}, not a folder")
        if not root and not _access(d, os.X_OK):
            raise _denied(path, d, st)
        above = (d, st)
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise _missing(path, "") from None
    except PermissionError:
        raise _denied(path, *above) if above else _error(
            "permission", f"cannot stat {path} as uid {_me()}") from None
    if not stat.S_ISSOCK(st.st_mode):
        raise _error(
            "not_a_socket",
            f"{path} is {_kind(st.st_mode)}, not a socket: slotsyncd did not make it (is this "
            "the daemon's --socket? it refuses to start over a file that is not its socket)"
            if not stat.S_ISDIR(st.st_mode) else
            f"{path} is a folder, not a socket: the endpoint names the daemon's runtime dir, "
            f"not its socket (slotsyncd's socket is {os.path.join(path, 'slotsyncd.sock')} "
            "unless --socket says otherwise)",
        )
    if not root and not _access(path, os.W_OK):
        raise _denied(path, path, st)
    _probe(path, path, timeout_s, st)


def _probe(path: str, address: str, timeout_s: float, st: os.stat_result | None) -> None:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.settimeout(timeout_s)
        s.connect(address)
    except (TimeoutError, BlockingIOError):
        return  # alive, its backlog full: the ZeroMQ connect gets in once it accepts
    except OSError as e:
        if e.errno == errno.ECONNREFUSED:
            where = f"socket {path} exists" if st is not None else f"abstract socket {path}:"
            raise _error(
                "not_listening",
                f"{where} but nothing listens on it: slotsyncd is not running (a killed daemon "
                "leaves its socket file; start slotsyncd, it removes the stale file)"
                if st is not None else
                f"{where} nothing listens on it: slotsyncd is not running (`slotsync status` "
                "says)",
            ) from None
        if e.errno in (errno.EACCES, errno.EPERM) and st is not None:
            raise _denied(path, path, st) from None
        if e.errno == errno.ENOENT:
            raise _missing(path, "" if st is not None else "no such abstract socket") from None
        if e.errno == errno.EPROTOTYPE:
            raise _error("not_a_socket", f"{path} is a unix socket but not a stream socket: "
                         "not slotsyncd's (is this the daemon's --socket?)") from None
        raise _error("connect", f"cannot connect to {path}: {e.strerror or e}") from None
    finally:
        s.close()


def _ancestors(folder: str) -> list[str]:
    """``/``, ``/a``, ``/a/b`` for ``/a/b``."""
    out = [folder]
    while True:
        parent = os.path.dirname(out[-1])
        if parent == out[-1]:
            return out[::-1]
        out.append(parent)


def _access(p: str, mode: int) -> bool:
    return os.access(p, mode, effective_ids=os.access in os.supports_effective_ids)


def _error(code: str, message: str) -> SlotsyncError:
    return SlotsyncError(_PHASE, message, code=code)


def _missing(path: str, why: str) -> SlotsyncError:
    folder = os.path.dirname(os.path.abspath(path))
    return _error(
        "no_socket",
        f"no socket at {path}: is slotsyncd running? (`slotsync status` says; the daemon's "
        f"runtime dir is {folder} if this is its socket: its --runtime-dir, or "
        "$SLOTSYNC_RUNTIME_DIR)" + (f"; {why}" if why else ""),
    )


def _denied(path: str, blocker: str, st: os.stat_result) -> SlotsyncError:
    """The ``cannot open`` message for ``blocker`` (``path`` itself or a folder above it)."""
    is_dir = stat.S_ISDIR(st.st_mode)
    need, bit = ("search (x)", stat.S_IXGRP) if is_dir else ("write (w)", stat.S_IWGRP)
    what = f"its folder {blocker}" if blocker != path else "it"
    group = _group(st.st_gid)
    groups = {os.getegid(), *os.getgroups()}
    if st.st_mode & bit and st.st_gid not in groups:
        fix = f"add the user to group {group} (a new login picks it up)"
    elif st.st_mode & bit:  # in the group already: an ACL or a security module refuses
        fix = f"this process is in group {group}, which may open it: see `getfacl {blocker}`"
    else:
        fix = (f"its group has no {need} permission: have the daemon's admin run `chmod "
               f"g+{'x' if is_dir else 'w'} {blocker}`, and add the user to group {group}")
    return _error(
        "permission",
        f"cannot open {path} as uid {_me()}: {what} is {stat.filemode(st.st_mode)} "
        f"({stat.S_IMODE(st.st_mode):04o}) {_user(st.st_uid)}:{group}; {fix}; and, unless "
        "allowed already, add the user to the daemon's `allow_uids` (its `allow_gids` sees "
        f"only a process's primary group, here {_group(os.getegid())})",
    )


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISREG, "a regular file"), (stat.S_ISDIR, "a folder"),
                       (stat.S_ISFIFO, "a named pipe"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a regular file"


def _me() -> str:
    uid = os.geteuid()
    name = _user(uid)
    return f"{uid} ({name})" if name != str(uid) else str(uid)


def _user(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def _group(gid: int) -> str:
    try:
        return grp.getgrgid(gid).gr_name
    except KeyError:
        return str(gid)
