"""The SGLang engines (``python -m slotsync.engine --impl sglang`` and ``--impl
sglang-reference``): SGLang's weight-sync routes over TP-rank worker processes, with SGLang's
own validation and payload code or slotsync's mirror of them.

Modules: ``server`` (the aiohttp front, SGLang's tokenizer side: the routes, validation,
auth, the pause flag), ``scheduler`` (SGLang's scheduler: calls in arrival order, the TP
barrier over the ranks, the weight-update handlers, the engine's death on a scheduler
exception), ``state`` (the per-version rules and the engine-level state, I/O-free),
``server_info`` (the start options and the ``/model_info`` / ``/server_info`` bodies),
``http`` (SGLang's request structs, their validation, error bodies and auth), ``faults``
(test-only fault injection), ``worker`` (one TP rank's process and its entry point
``sglang_worker_main``), ``payload`` (how a rank reads and loads its entry), ``standin``
(CPU stand-ins for SGLang's receive code).

May import: the shared engine modules (``slotsync.engine.pool``, ``worker_pipe``,
``http_shapes``, ``faults``, ``shm``, ``cuda_standin``, ``checksum``, ...),
``slotsync.protocol``, ``slotsync.testing``'s process helpers, torch and SGLang. Never
another engine family (``slotsync.engine.reference``, ``slotsync.engine.vllm``), never the
daemon.
"""
