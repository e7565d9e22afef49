"""The vLLM-code engine (``python -m slotsync.engine --impl vllm``): vLLM's own routers,
exception handlers and launcher over worker processes that run vLLM's ``gpu_worker.Worker``
weight-update code.

Modules: ``server`` (vLLM's routers and uvicorn launcher), ``engine_client`` (the
``AsyncLLM`` stand-in), ``executor`` (the executor stand-in: ``collective_rpc`` over the
workers with vLLM's reply handling), ``dp`` (data-parallel engine cores behind one API
server), ``worker`` (a worker process: vLLM's ``Worker`` and the stand-ins around it, and its
entry point ``vllm_worker_main``), ``model`` (the model a worker holds).

May import: the shared engine modules (``slotsync.engine.pool``, ``worker_pipe``,
``worker_device``, ``faults``, ``cuda_standin``, ``checksum``, ...), ``slotsync.protocol``,
``slotsync.testing``'s process helpers, torch and vLLM. Never another engine family
(``slotsync.engine.reference``, ``slotsync.engine.sglang``), never the daemon.
"""
