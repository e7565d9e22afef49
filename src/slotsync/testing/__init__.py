"""Support shared by the tests, the benchmarks and the demo (shipped in the wheel, so that
``slotsync bench`` and ``slotsync demo`` work from an installed package; issue 16).

* ``processes``: ``slotsyncd`` as a subprocess (``DaemonProcess``) and ``die_with_parent``;
* ``ports``: free loopback TCP ports;
* ``procfs``: ``/proc`` and ``/dev/shm`` readers (RSS, open fds, child pids, segments);
* ``ranks``: the ``Publisher`` of a test, benchmark or demo rank;
* ``tensors``: synthetic weights the test ranks publish;
* ``vllm_notices``: vLLM's Triton notice once per demo or engine, not once per process.

Nothing here imports pytest, and this package imports none of its modules itself: each is
imported on its own (``processes`` and ``ports`` need only the standard library; ``ranks``
and ``tensors`` need torch). The layer just above ``slotsync.protocol``: it may import that,
and the daemon, the engines, the benchmarks and the demo may import it, never the reverse.
"""
