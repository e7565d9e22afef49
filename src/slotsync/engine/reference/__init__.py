"""The reference engine (``python -m slotsync.engine --impl reference``, the default): vLLM's
weight-transfer routes, per-worker state machine and error texts where vLLM cannot run.

Modules: ``server`` (the aiohttp front: vLLM's routes, the fan-out, the test-only
``/_slotsync/`` routes), ``engine_state`` (its engine-level state, I/O-free), ``worker`` (a
worker process's serve loop, and ``WorkerPool``: the shared pool with that entry point),
``worker_state`` (its per-worker state machine), ``payload`` (vLLM's ``update_info`` /
``init_info`` parsing), ``weight_loader`` (the weights, handle mapping, copy-out),
``vllm_receive`` (``--receive vllm``: chunks through vLLM's own IPC receive code).

May import: the shared engine modules (``slotsync.engine.pool``, ``worker_pipe``,
``worker_device``, ``http_shapes``, ``faults``, ``shm``, ``cuda_standin``, ``checksum``),
``slotsync.protocol``, ``slotsync.testing``'s process helpers, torch, and vLLM (for
``--receive vllm`` only). Never another engine family (``slotsync.engine.vllm``,
``slotsync.engine.sglang``), never the daemon.
"""
