"""slotsync's reference engine: an HTTP server that speaks vLLM 0.33's weight-transfer contract.

It stands in for ``vllm serve`` (with ``VLLM_SERVER_DEV_MODE=1``, the IPC weight-transfer
backend and ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``) where vLLM cannot run, so that the daemon
can be tested and demonstrated against the real routes, state machine and error texts
(``shared/vllm-contract.md``). One worker process per GPU UUID (real or logical) holds a copy
of the weights and maps CUDA IPC handles, or the CPU shared-memory stand-in handles.

Modules: ``worker`` (per-worker state machine, handle mapping, weights), ``server`` (aiohttp
routes, fan-out to workers, error wrapping, test-only ``/_slotsync/`` control routes),
``checksum`` (``tensor_checksum``), ``launcher`` (``ReferenceEngine`` for tests and demos),
``__main__`` (``python -m slotsync.engine``).
"""
