"""slotsync's engines: HTTP servers that speak vLLM's weight-transfer contract.

Two implementations of ``python -m slotsync.engine`` (``--impl``):

* ``reference`` (default): stands in for ``vllm serve`` (with ``VLLM_SERVER_DEV_MODE=1``, the
  IPC weight-transfer backend and ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``) where vLLM cannot
  run, with vLLM's routes, per-worker state machine, error texts and connection handling
  (``shared/vllm-contract.md``; checked against vLLM's own code by
  ``tests/test_vllm_engine.py``). One worker process per GPU UUID (real or logical) holds a
  copy of the weights and maps CUDA IPC handles, or the CPU shared-memory stand-in handles.
* ``vllm``: vLLM's own router, exception handlers and uvicorn launcher in front of worker
  processes that run vLLM's ``gpu_worker.Worker`` weight-update code; stand-ins only for the
  engine core, the distributed groups and the CUDA calls the receive path makes.

Modules: ``worker`` (reference per-worker state machine, handle mapping, weights), ``server``
(reference aiohttp routes, fan-out, error wrapping, test-only ``/_slotsync/`` routes),
``pool`` (worker processes and ``collective_rpc``), ``faults`` (test-only fault injection),
``shm`` (the shared-memory stand-in handle), ``cuda_standin`` (CPU / logical-UUID stand-ins
for vLLM's receive path), ``vllm_server`` / ``vllm_worker`` / ``vllm_model`` (``--impl vllm``),
``vllm_receive`` (``--receive vllm``), ``checksum`` (``tensor_checksum``,
``checksums_by_worker``), ``launcher`` (``ReferenceEngine`` for tests and demos),
``__main__`` (``python -m slotsync.engine``).
"""
