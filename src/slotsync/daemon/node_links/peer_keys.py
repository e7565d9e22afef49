"""CURVE keys of the peer link: making a node's key pair, reading the allow-list.

The files are pyzmq's certificates (``zmq.auth.create_certificates``): ``<node>.key`` holds
the public key, ``<node>.key_secret`` both keys. A daemon reads its own pair from
``curve_secret_key`` and the public keys it accepts from the folder ``peer_public_keys``,
one ``<node>.key`` per peer: the file's name is the node that key may speak for, so a node
cannot pass itself off as another (``owner_links``: its ``Hello`` must name its key's node).
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path

import zmq.auth

from slotsync.daemon.node_links.spans import check_node_name


class PeerKeyError(ValueError):
    """A key file or folder that cannot be used; the message names it and why."""


@dataclass(frozen=True)
class PeerKeys:
    """This daemon's key pair and the public keys it accepts (40-character z85 bytes), read
    from folder ``folder`` (``peer_public_keys``)."""

    public: bytes
    secret: bytes
    peers: dict[bytes, str]  # public key -> the node it speaks for
    folder: str = ""

    def key_file(self, node: str) -> str:
        """The file that holds ``node``'s public key: ``<folder>/<node>.key``."""
        return os.path.join(self.folder, f"{node}.key")

    def key_of(self, node: str) -> bytes | None:
        """The public key of ``node``, or None when the folder has none."""
        for key, name in self.peers.items():
            if name == node:
                return key
        return None


def make_keys(node: str, folder: str | os.PathLike) -> tuple[Path, Path]:
    """Write ``<node>.key`` and ``<node>.key_secret`` into ``folder`` (made if missing; the
    secret file readable by its owner only). Returns both paths.

    Raises:
        ValueError: ``node`` is not a node name.
        FileExistsError: a key file of that node is already there (never overwritten).
    """
    check_node_name(node, "node")
    folder = Path(folder)
    public, secret = folder / f"{node}.key", folder / f"{node}.key_secret"
    for p in (public, secret):
        if p.exists():
            raise FileExistsError(f"{p} exists already; remove it to make a new key pair")
    folder.mkdir(parents=True, exist_ok=True)
    old = os.umask(0o077)
    try:
        made_public, made_secret = zmq.auth.create_certificates(str(folder), node)
    finally:
        os.umask(old)
    os.chmod(made_public, 0o644)
    return Path(made_public), Path(made_secret)


def check_keys(node: str, secret_file: str, public_folder: str, owners: dict) -> PeerKeys:
    """``load_keys``, and that the pair is this node's (where the folder holds ``<node>.key``,
    its public key must be the pair's) and that the folder holds every owner's key
    (``owners``: owner node -> anything). Used at configuration time (``--check-config``).

    Raises:
        PeerKeyError: naming the file and what is wrong with it.
    """
    keys = load_keys(secret_file, public_folder)
    named = keys.peers.get(keys.public)
    if named is not None and named != node:
        raise PeerKeyError(f"curve_secret_key {secret_file!r} holds node {named}'s key pair "
                           f"(its public key is {named}.key's), not node {node}'s: the owner "
                           f"would take this daemon for node {named}")
    own = keys.key_of(node)
    if own is not None and own != keys.public:
        raise PeerKeyError(f"curve_secret_key {secret_file!r} does not match {node}.key in "
                           f"peer_public_keys {public_folder!r}: copy this node's own .key "
                           "there, or use its own .key_secret")
    missing = [o for o in sorted(owners) if keys.key_of(o) is None]
    if missing:
        raise PeerKeyError(f"peer_public_keys {public_folder!r} has no key of owner node(s) "
                           f"{', '.join(missing)} ({missing[0]}.key)")
    return keys


def too_open(secret_file: str) -> str:
    """Why the secret key file is readable by more than the daemon that owns it, or ''.

    As OpenSSH refuses a private key (``sshkey_perm_ok``: "UNPROTECTED PRIVATE KEY FILE"): a
    file of this user's must have no group or other permission bits (mode 0600 or 0400); any
    file must not be readable or writable by others. A file of another user with group bits
    only passes: that is a mounted secret the daemon reads through its group (Kubernetes'
    ``fsGroup`` with ``defaultMode: 0440``, deploy/kubernetes/daemonset.yaml). Whoever reads
    the file can speak as this node on the peer link.
    """
    try:
        st = os.stat(secret_file)
    except OSError:
        return ""  # (load_certificate has said why it cannot be read)
    mode = stat.S_IMODE(st.st_mode)
    mine = st.st_uid == os.getuid()
    if mode & 0o007 or (mine and mode & 0o070):
        who = "others" if mode & 0o007 else "its group"
        return (f"curve_secret_key {secret_file!r} is accessible by {who} (mode {mode:04o}): "
                "whoever reads it can speak as this node on the peer link, so it is refused, "
                f"as ssh refuses such a private key; run `chmod 600 {secret_file}` (owned by "
                "the daemon's user)")
    return ""


def load_keys(secret_file: str, public_folder: str) -> PeerKeys:
    """Read this daemon's pair and the allowed peers' public keys.

    Raises:
        PeerKeyError: the secret file holds no secret key, is readable by others
            (``too_open``), a file cannot be read, or the folder holds no ``<node>.key``
            file.
    """
    try:
        public, secret = zmq.auth.load_certificate(secret_file)
    except (OSError, ValueError, IndexError) as e:
        raise PeerKeyError(f"curve_secret_key {secret_file!r}: {e} (not a key file of "
                           "`slotsync keys NODE`, which makes NODE.key_secret)") from None
    if not secret:
        raise PeerKeyError(f"curve_secret_key {secret_file!r} holds no secret key (it is the "
                        "public half: use the .key_secret file)")
    open_to = too_open(secret_file)
    if open_to:
        raise PeerKeyError(open_to)
    peers: dict[bytes, str] = {}
    try:
        names = sorted(os.listdir(public_folder))
    except OSError as e:
        raise PeerKeyError(f"peer_public_keys {public_folder!r}: {e.strerror}") from None
    for name in names:
        if not name.endswith(".key"):
            continue
        node = name[:-len(".key")]
        try:
            check_node_name(node, "key file")
        except ValueError as e:
            raise PeerKeyError(f"peer_public_keys {public_folder!r}: {name}: {e}") from None
        try:
            key, _ = zmq.auth.load_certificate(os.path.join(public_folder, name))
        except (OSError, ValueError) as e:
            raise PeerKeyError(f"peer_public_keys {public_folder!r}: {name}: {e} (copy the "
                               f"{name} that `slotsync keys {node}` made there)") from None
        peers[key] = node
    if not peers:
        raise PeerKeyError(f"peer_public_keys {public_folder!r} holds no <node>.key file "
                        "(slotsync keys NODE makes one per node)")
    return PeerKeys(public, secret, peers, public_folder)
