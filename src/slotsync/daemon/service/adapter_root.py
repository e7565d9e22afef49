"""Where the daemon writes the LoRA adapter folders vLLM engines load (issue 36):
``adapter_dir``, and its default.

The default is on ``/dev/shm``'s filesystem, because an adapter one rank holds whole is
hard-linked from that rank's sealed shared-memory segment into the version's folder
(``adapter_io.PartReader.take``) and a hard link cannot cross filesystems: the runtime dir
(``/run/slotsync`` under systemd's ``RuntimeDirectory``, ``$XDG_RUNTIME_DIR``) is another
tmpfs, where every round is copied and hashed instead. The default (:func:`resolve`) is

    ``/dev/shm/slotsyncd-<uid>/adapters-<key>``

* ``slotsyncd-<uid>`` (:data:`PRIVATE_PREFIX`; the daemon's effective uid): the daemon's own
  folder in a world-writable sticky directory, so the name can be taken first by anyone:
  it is made mode 0700 without following a link (``mkdir`` never follows one; it is then
  opened ``O_NOFOLLOW | O_DIRECTORY`` and checked on its descriptor), and an existing one
  must be a real folder owned by the daemon's uid that its group and others cannot write
  (:func:`private_problem`), or the daemon refuses to start, naming the path, what is wrong
  and the fix. In a sticky directory no other user can remove or rename it once made.
  ``slotsyncd-``, not the ranks' ``slotsync-<pid>-*`` segment names, which tools (the demo's
  clean-up, the tests' leak check) remove as segments.
* ``adapters-<key>``: ``key`` the first 12 hex digits of the sha256 of the daemon's
  endpoint (its socket): one folder per daemon, the same across its restarts. Two daemons
  of one user on one host (a two-node demo on loopback, tests) must not share one, since a
  daemon removes at start and stop the temp folders it finds in its own.

When ``/dev/shm`` is not there, not a tmpfs or not writable by the daemon, the default falls
back to ``adapters`` in the runtime dir, as before issue 36's fix, and the start logs why
(``AdapterRoot.fallback``).

At the daemon's stop, ``adapter_io.AdapterIO.close`` removes what no engine can still need,
then ``adapters-<key>`` and ``slotsyncd-<uid>`` if they are empty (:func:`remove_if_empty`):
the folders of the versions engines still hold stay, as with any ``adapter_dir``.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import stat
from collections.abc import Callable
from dataclasses import dataclass

from slotsync.daemon.service.folders import filesystem_type

SHM_DIR = "/dev/shm"
"""The ranks' shared-memory segments' folder, where the default ``adapter_dir`` goes."""

PRIVATE_PREFIX = "slotsyncd-"
"""The daemon's own folder in :data:`SHM_DIR`: ``slotsyncd-<uid>``."""

KEY_HEX = 12
"""Hex digits of the endpoint's sha256 in ``adapters-<key>``."""


class AdapterDirError(ValueError):
    """The default ``adapter_dir``'s private folder is not safe to use (the message names the
    path, what is wrong and the fix), or could not be made."""


@dataclass(frozen=True)
class AdapterRoot:
    """The resolved ``adapter_dir``.

    Attributes:
        path: the folder the slot folders go in.
        private: the daemon's own folder above ``path`` in ``/dev/shm``
            (``/dev/shm/slotsyncd-<uid>``), made mode 0700 and checked at start; '' when
            ``adapter_dir`` was set, or the default fell back to the runtime dir.
        fallback: why the default is not on ``/dev/shm`` ('' when it is, or when
            ``adapter_dir`` was set): logged at start.
    """

    path: str
    private: str = ""
    fallback: str = ""


def endpoint_key(endpoint: str) -> str:
    """The ``key`` of ``adapters-<key>``: the first :data:`KEY_HEX` hex digits of the sha256
    of the daemon's ``endpoint`` (``ipc:///run/slotsync/slotsyncd.sock``)."""
    return hashlib.sha256(endpoint.encode()).hexdigest()[:KEY_HEX]


def shm_unusable(shm_dir: str, fstype: Callable[[str], str] = filesystem_type) -> str:
    """Why ``shm_dir`` cannot hold the default ``adapter_dir``, or '': not a folder, not a
    tmpfs (``fstype``: the filesystem's type, ``folders.filesystem_type``), or not writable
    and searchable by this uid."""
    if not os.path.isdir(shm_dir):
        return f"{shm_dir} is not there"
    kind = fstype(shm_dir)
    if kind != "tmpfs":
        return f"{shm_dir} is not a tmpfs ({kind or 'its filesystem is not known'})"
    if not os.access(shm_dir, os.W_OK | os.X_OK):
        return f"{shm_dir} is not writable by uid {os.geteuid()}"
    return ""


def resolve(adapter_dir: str, endpoint: str, runtime_dir: str, shm_dir: str | None = None,
            uid: int | None = None,
            fstype: Callable[[str], str] | None = None) -> AdapterRoot:
    """The ``adapter_dir`` of a daemon (module docstring): ``adapter_dir`` when set; else
    ``<shm_dir>/slotsyncd-<uid>/adapters-<key of endpoint>``; else, when ``shm_dir`` cannot
    hold it (:func:`shm_unusable`), ``<runtime_dir>/adapters``. Creates nothing.

    Args:
        shm_dir: the folder standing for ``/dev/shm`` (None: :data:`SHM_DIR`; tests pass
            another).
        uid: the daemon's uid (None: the effective uid).
        fstype: the filesystem type of a path (None: ``folders.filesystem_type``).
    """
    if adapter_dir:
        return AdapterRoot(adapter_dir)
    shm = shm_dir or SHM_DIR
    why = shm_unusable(shm, fstype or filesystem_type)
    if why:
        return AdapterRoot(os.path.join(runtime_dir, "adapters"), fallback=why)
    private = os.path.join(shm, f"{PRIVATE_PREFIX}{os.geteuid() if uid is None else uid}")
    return AdapterRoot(os.path.join(private, f"adapters-{endpoint_key(endpoint)}"), private)


_TAKEN = ("anyone who could make it there can read or replace the adapter files the daemon "
          "writes")


def _problem(folder: str, st: os.stat_result | None, uid: int, link: str = "") -> str:
    if st is None:
        return ""
    if stat.S_ISLNK(st.st_mode):
        return (f"{folder} is a symbolic link (to {link!r}), not a folder of the daemon's: "
                f"remove it (rm {folder}; {_TAKEN}) or set adapter_dir to another folder")
    if not stat.S_ISDIR(st.st_mode):
        return (f"{folder} is not a folder: remove it (rm {folder}) or set adapter_dir to "
                "another folder")
    if st.st_uid != uid:
        return (f"{folder} is owned by uid {st.st_uid}, not by the daemon's uid {uid}: remove "
                f"it (as root: rm -r {folder}; {_TAKEN}) or set adapter_dir to another folder")
    if st.st_mode & 0o022:
        return (f"{folder} is writable by its group or others (mode "
                f"{stat.S_IMODE(st.st_mode):04o}): run chmod go-w {folder}")
    return ""


def private_problem(private: str, uid: int | None = None) -> str:
    """What is wrong with the daemon's private folder ``private`` (``slotsyncd-<uid>``), or
    '' when it is fine or not there yet: a symbolic link, not a folder, owned by another uid
    than ``uid`` (None: the effective uid), or writable by its group or others. The text
    names the path, what is wrong and the fix. Follows no link; creates nothing."""
    uid = os.geteuid() if uid is None else uid
    try:
        st = os.lstat(private)
    except FileNotFoundError:
        return ""
    link = os.readlink(private) if stat.S_ISLNK(st.st_mode) else ""
    return _problem(private, st, uid, link)


def make_private(root: AdapterRoot, uid: int | None = None, tries: int = 3) -> None:
    """Make ``root.private`` (mode 0700; an existing one is kept when
    :func:`private_problem` finds nothing wrong) and ``root.path`` in it (mode 0700), without
    following a link: ``mkdir`` makes the private folder or finds a name there, which is then
    opened ``O_NOFOLLOW | O_DIRECTORY`` and checked on its descriptor (owner, mode), and
    ``root.path`` is made and checked relative to that descriptor. Another daemon of the
    same uid removing the empty private folder meanwhile (its stop) is retried ``tries``
    times. Nothing to do when ``root.private`` is ''.

    Raises:
        AdapterDirError: the private folder is not safe (the text names the path, what is
            wrong and the fix), or cannot be made.
    """
    if not root.private:
        return
    uid = os.geteuid() if uid is None else uid
    name = os.path.basename(root.path)
    for _ in range(tries):
        try:
            os.mkdir(root.private, 0o700)
        except FileExistsError:
            pass
        except OSError as e:
            raise AdapterDirError(f"cannot create {root.private}: {e.strerror}") from None
        try:
            fd = os.open(root.private, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW
                         | os.O_CLOEXEC)
        except FileNotFoundError:
            continue  # (removed meanwhile)
        except OSError as e:
            raise AdapterDirError(private_problem(root.private, uid)
                                  or f"{root.private} cannot be opened: {e.strerror}") from None
        try:
            why = _problem(root.private, os.fstat(fd), uid)
            if why:
                raise AdapterDirError(why)
            try:
                os.mkdir(name, 0o700, dir_fd=fd)
            except FileExistsError:
                pass
            except FileNotFoundError:
                continue  # (the private folder was removed after it was opened)
            try:
                sub = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC,
                              dir_fd=fd)
            except OSError as e:
                raise AdapterDirError(f"{root.path} cannot be opened ({e.strerror}): remove it "
                                      "or set adapter_dir to another folder") from None
            try:
                why = _problem(root.path, os.fstat(sub), uid)
            finally:
                os.close(sub)
            if why:
                raise AdapterDirError(why)
            return
        finally:
            os.close(fd)
    raise AdapterDirError(f"{root.private} was removed {tries} times while the daemon made "
                          "it (other daemons of this uid stopping): start again")


def remove_if_empty(root: AdapterRoot) -> None:
    """At the daemon's stop: remove ``root.path`` and then ``root.private`` when each is
    empty (``rmdir``; a folder an engine still needs keeps both). Nothing to do when
    ``root.private`` is ''."""
    if not root.private:
        return
    for folder in (root.path, root.private):
        with contextlib.suppress(OSError):
            os.rmdir(folder)
