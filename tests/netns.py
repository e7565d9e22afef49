"""Real hosts for tests: "nodes" as Linux network namespaces joined by a switch (issue 25 G).

:class:`Nodes` makes ``n`` network namespaces, ``sst-<token>-<set>-n<k>`` (``token``: the
test run's, ``$SLOTSYNC_TEST_RUN``, so that the end-of-run leak check finds any left behind;
``set``: this process's id and a counter, so that xdist's workers and several sets in one
process never collide), each with loopback up and one veth, ``eth0``, at
``10.231.<x>.<k+1>/24``. The other ends of the veths sit on a bridge inside a separate
"switch" namespace (``sst-<token>-<set>-sw``): the root namespace gets no new interface and
no route, and traffic between nodes never leaves the namespaces the test made.

::

    with Nodes(2) as net:                   # (pytest.skip when not root / not permitted)
        net.address(0)                      # "10.231.7.1"
        p = net.popen(1, ["python", "-m", "http.server", "--bind", net.address(1), "80"])
        net.http_get(0, f"http://{net.address(1)}/")   # from the test process, inside node 0
        net.link_down(1)                    # a partition: node 1's cable pulled
        net.link_up(1)

The partition takes the switch's end of node ``k``'s veth down: node ``k`` keeps its address
and route, its packets are dropped at the veth (carrier lost), and the others' to it too, so
TCP connections across the cut go silent rather than being refused, as a real cable pull or
a switch failure does.

Cleanup (``__exit__``, also after a failed test, and ``close``) kills every process left in
the namespaces (``ip netns pids``), then deletes them (their veths and the bridge go with
them).
"""

from __future__ import annotations

import itertools
import json
import os
import secrets
import subprocess
from types import TracebackType
from typing import Any

import pytest
from leak_check import namespaces_of, remove_namespace  # noqa: F401 - (re-exported)

from slotsync.testing.processes import http_get, run_in_netns

RUN_ENV = "SLOTSYNC_TEST_RUN"  # (leak_check.py's)
PREFIX = "sst-"
SUBNET = "10.231"
_sets = itertools.count()
_own_token = secrets.token_hex(4)  # (outside a test run: this process's own)


def run_token() -> str:
    """The test run's token (``$SLOTSYNC_TEST_RUN``, set by ``leak_check.py``), else a random
    one for this process."""
    return os.environ.get(RUN_ENV) or _own_token


def _ip(*args: str) -> None:
    r = subprocess.run(["ip", *args], capture_output=True, text=True, check=False)
    if r.returncode != 0:
        raise OSError(f"ip {' '.join(args)}: {r.stderr.strip() or r.returncode}")


def why_not_available() -> str:
    """'' when this process may make network namespaces, else why not (for a skip)."""
    if os.geteuid() != 0:
        return f"network-namespace tests need root (uid {os.geteuid()}): ip netns add"
    name = f"{PREFIX}{run_token()}-probe{os.getpid()}"
    r = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True,
                       check=False)
    if r.returncode != 0:
        return f"ip netns add is not permitted here: {r.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", name], capture_output=True, check=False)
    return ""


class Nodes:
    """``n`` nodes as network namespaces on one switch (see the module docstring).

    Args:
        n: how many nodes.
        start: make them now (else call :meth:`start`).

    Attributes:
        names: node ``k``'s namespace name.
        switch: the switch namespace's name.
        subnet: ``10.231.<x>``, the nodes' /24.

    Raises:
        pytest.skip.Exception: not root, or ``ip netns add`` is not permitted here.
    """

    def __init__(self, n: int, start: bool = True) -> None:
        why = why_not_available()
        if why:
            pytest.skip(why)
        seq = next(_sets)
        base = f"{PREFIX}{run_token()}-{os.getpid()}{chr(ord('a') + seq % 26)}"
        self.names = [f"{base}-n{k}" for k in range(n)]
        self.switch = f"{base}-sw"
        self.subnet = f"{SUBNET}.{(os.getpid() + seq) % 250 + 1}"
        self._made: list[str] = []
        if start:
            self.start()

    def address(self, k: int) -> str:
        """Node ``k``'s address, ``10.231.<x>.<k+1>``."""
        return f"{self.subnet}.{k + 1}"

    def start(self) -> None:
        """Make the switch and the nodes; on any failure, remove what was made and raise."""
        try:
            self._add(self.switch)
            _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.switch, "link", "set", "br0", "up")
            for k, name in enumerate(self.names):
                self._add(name)
                _ip("-n", self.switch, "link", "add", f"v{k}", "type", "veth", "peer", "name",
                    "eth0", "netns", name)
                _ip("-n", self.switch, "link", "set", f"v{k}", "master", "br0")
                _ip("-n", self.switch, "link", "set", f"v{k}", "up")
                _ip("-n", name, "addr", "add", f"{self.address(k)}/24", "dev", "eth0")
                _ip("-n", name, "link", "set", "eth0", "up")
        except BaseException:
            self.close()
            raise

    def _add(self, name: str) -> None:
        _ip("netns", "add", name)
        self._made.append(name)
        _ip("-n", name, "link", "set", "lo", "up")

    # ------------------------------------------------------------------ faults

    def link_down(self, k: int) -> None:
        """Cut node ``k`` off: the switch's end of its veth goes down (a partition)."""
        _ip("-n", self.switch, "link", "set", f"v{k}", "down")

    def link_up(self, k: int) -> None:
        """Plug node ``k`` back in."""
        _ip("-n", self.switch, "link", "set", f"v{k}", "up")

    # ------------------------------------------------------------------ processes

    def exec_argv(self, k: int, argv: list[str]) -> list[str]:
        """``argv`` run inside node ``k`` (``ip netns exec``, which execs it: same pid)."""
        return ["ip", "netns", "exec", self.names[k], *argv]

    def popen(self, k: int, argv: list[str], **kw: Any) -> subprocess.Popen:
        """``subprocess.Popen`` of ``argv`` inside node ``k``."""
        return subprocess.Popen(self.exec_argv(k, argv), **kw)

    def run(self, k: int, argv: list[str], **kw: Any) -> subprocess.CompletedProcess:
        """``subprocess.run`` of ``argv`` inside node ``k``."""
        return subprocess.run(self.exec_argv(k, argv), **kw)

    def call(self, k: int, fn: Any, *args: Any, timeout_s: float = 60.0) -> Any:
        """``fn(*args)`` in a thread of this process that entered node ``k``'s namespace
        (``slotsync.testing.processes.run_in_netns``)."""
        return run_in_netns(self.names[k], fn, *args, timeout_s=timeout_s)

    def http_get(self, k: int, url: str, timeout_s: float = 10.0) -> bytes:
        """``GET url`` from inside node ``k`` (reaches a server bound there, loopback
        included); the body. Raises ``urllib.error.HTTPError`` for an error status."""
        return http_get(url, self.names[k], timeout_s)

    def http_json(self, k: int, url: str, timeout_s: float = 10.0) -> Any:
        """:meth:`http_get`, decoded as JSON."""
        return json.loads(self.http_get(k, url, timeout_s))

    # ------------------------------------------------------------------ cleanup

    def close(self) -> list[tuple[int, str]]:
        """Kill what runs in the namespaces and delete them (idempotent). Returns the
        processes that were still running."""
        left = []
        for name in reversed(self._made):
            left += remove_namespace(name)
        self._made.clear()
        return left

    def __enter__(self) -> Nodes:
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
