"""slotsync's engines: HTTP servers that speak vLLM's weight-transfer contract.

Two implementations of ``python -m slotsync.engine`` (``--impl``):

* ``reference`` (default): stands in for ``vllm serve`` (with ``VLLM_SERVER_DEV_MODE=1``, the
  IPC weight-transfer backend and ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``) where vLLM cannot
  run, with vLLM's routes, per-worker state machine, error texts and connection handling
  (``shared/vllm-contract.md``; checked against vLLM's own code by
  ``test_vllm_engine.py``). One worker process per GPU UUID (real or logical) holds a
  copy of the weights and maps CUDA IPC handles, or the CPU shared-memory stand-in handles.
* ``vllm``: vLLM's own router, exception handlers and uvicorn launcher in front of worker
  processes that run vLLM's ``gpu_worker.Worker`` weight-update code; stand-ins only for the
  engine core, the distributed groups and the CUDA calls the receive path makes.

Modules: ``worker`` (reference worker process: serve loop), ``worker_state`` (its per-worker
state machine), ``payload`` (vLLM's ``update_info`` / ``init_info`` parsing), ``weight_loader``
(the weights, handle mapping, copy-out), ``worker_pipe`` (the worker's end of the pool's pipe,
both impls), ``server`` (reference aiohttp routes, fan-out, test-only ``/_slotsync/`` routes),
``engine_state`` (its engine-level state), ``http_shapes`` (vLLM's error bodies and 400
texts), ``pool`` (worker processes and ``collective_rpc``), ``faults`` (test-only fault
injection), ``shm`` (the shared-memory stand-in handle), ``cuda_standin`` (CPU / logical-UUID
stand-ins for vLLM's receive path), ``vllm_server`` (``--impl vllm``: vLLM's routers and
launcher), ``vllm_engine_client`` (its ``AsyncLLM`` stand-in), ``vllm_executor`` (its
executor stand-in), ``vllm_worker`` / ``vllm_model`` (its workers), ``vllm_receive``
(``--receive vllm``), ``checksum`` (``tensor_checksum``, ``checksums_by_worker``),
``launcher`` (``ReferenceEngine`` for tests and demos), ``__main__`` (``python -m
slotsync.engine``).
"""
