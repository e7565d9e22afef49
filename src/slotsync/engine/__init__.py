"""slotsync's engines: HTTP servers that speak vLLM's or SGLang's weight-sync contract, for
tests, demos and benchmarks (``python -m slotsync.engine --impl ...``).

The map, in three engine families and what they share:

* ``reference/`` (``--impl reference``, the default): stands in for ``vllm serve`` (with
  ``VLLM_SERVER_DEV_MODE=1``, the IPC weight-transfer backend and
  ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``) where vLLM cannot run, with vLLM's routes,
  per-worker state machine, error texts and connection handling (``shared/vllm-contract.md``;
  checked against vLLM's own code by ``test_vllm_engine.py``). One worker process per GPU
  UUID (real or logical) holds a copy of the weights and maps CUDA IPC handles, or the CPU
  shared-memory stand-in handles; ``--receive vllm`` receives through vLLM's own code.
* ``vllm/`` (``--impl vllm``): vLLM's own router, exception handlers and uvicorn launcher in
  front of worker processes that run vLLM's ``gpu_worker.Worker`` weight-update code;
  stand-ins only for the engine core (and its DP replicas), the executor, the distributed
  groups and the CUDA calls the receive path makes.
* ``sglang/`` (``--impl sglang`` / ``sglang-reference``): SGLang's weight-sync routes over
  TP-rank worker processes, SGLang's own payload code or slotsync's mirror of it.
* Shared, beside them: ``pool`` (worker processes and ``collective_rpc``; each family hands
  it its workers' entry point), ``worker_pipe`` (the worker's end of the pool's pipe),
  ``worker_device`` (a worker's device and GPU UUID), ``http_shapes`` (vLLM's error bodies
  and 400 texts), ``faults`` (test-only fault injection), ``shm`` (the shared-memory
  stand-in handle), ``cuda_standin`` (CPU / logical-UUID stand-ins for the CUDA calls of a
  receive path), ``checksum`` (``tensor_checksum``, ``checksums_by_worker``).
* Above the families: ``__main__`` (``python -m slotsync.engine``: parses the options and
  starts one family's front and workers) and ``launcher`` (``ReferenceEngine``: an engine as
  a subprocess, for tests and demos).

The layering (pyproject.toml's import-linter contracts): ``__main__`` and ``launcher`` may
import the families; the three families are independent of each other (none imports
another); the shared modules import no family. Every engine module may import
``slotsync.protocol`` (the wire schema, the rank-side copy helpers), ``slotsync.testing``'s
process helpers, torch and its own engine's package; none imports the daemon.
"""
