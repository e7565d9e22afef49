"""The folders the daemon makes files in: whether this user could create files and a Unix
socket in one (``unusable_folder``, checked at start without creating anything) and which
filesystem holds a path (``filesystem_type``: the adapter folder should be a tmpfs, issue 36).
Moved out of ``config.py``, which re-exports both.
"""

from __future__ import annotations

import os
import re

# Kernel filesystems that hold only the kernel's own entries: no folder, file or Unix socket
# can be made there, even by root (for whom os.access() says yes: /proc is "writable").
_KERNEL_FILESYSTEMS = frozenset({
    "proc", "sysfs", "devpts", "securityfs", "debugfs", "tracefs", "pstore", "efivarfs",
    "cgroup", "cgroup2", "configfs", "fusectl", "binfmt_misc", "mqueue", "selinuxfs", "nsfs",
})


def unusable_folder(folder: str) -> str:
    """Why this user could not create files and a Unix socket in ``folder`` (creating it and
    its missing parents first), or '' if it could. Creates nothing: the nearest existing
    ancestor must be a folder this uid may write and enter, on a filesystem that takes files,
    and the missing names must fit that filesystem."""
    target = os.path.abspath(folder)
    probe = target
    while not os.path.lexists(probe):
        probe = os.path.dirname(probe)
    lead = f"cannot create {target}: " if probe != target else ""
    if not os.path.isdir(probe):
        return f"{lead}{probe} is not a folder"
    fstype = filesystem_type(probe)
    if fstype in _KERNEL_FILESYSTEMS:
        return f"{lead}{probe} is on a {fstype} filesystem, where only the kernel makes entries"
    if not os.access(probe, os.W_OK | os.X_OK):
        return f"{lead}{probe} is not writable by uid {os.getuid()}"
    if lead:
        try:
            name_max = os.pathconf(probe, "PC_NAME_MAX")
        except (OSError, ValueError):
            name_max = 255
        for part in os.path.relpath(target, probe).split(os.sep):
            if len(os.fsencode(part)) > name_max:
                return (f"{lead}the name {part[:24]!r}... has {len(os.fsencode(part))} bytes, "
                        f"more than the {name_max} a file name may have there")
    return ""


def filesystem_type(path: str, mountinfo: str = "/proc/self/mountinfo") -> str:
    """The type (``ext4``, ``tmpfs``, ``proc``...) of the filesystem holding ``path``, from
    the mount table; '' where there is none to read (non-Linux)."""
    try:
        with open(mountinfo, encoding="utf-8", errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return ""
    real = os.path.realpath(path)
    best, best_len = "", -1
    for line in lines:
        left, sep, right = line.partition(" - ")
        fields_ = left.split()
        if not sep or len(fields_) < 5 or not right.split():
            continue
        # mount points escape space, tab, newline and backslash as \ooo octal
        mnt = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), fields_[4])
        inside = real == mnt or real.startswith(mnt.rstrip("/") + "/")
        if inside and len(mnt) >= best_len:  # the deepest mount; the last one stacked there
            best, best_len = right.split()[0], len(mnt)
    return best
