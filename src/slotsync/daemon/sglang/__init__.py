"""SGLang as an engine family of the daemon (issue 26): its ``EngineFamily`` (``family.py``),
step table (``routes.py``), payload (``merge.py``, ``tensor_pickle.py``), buffer fence
(``fence.py``), version table (``versions.py``) and HTTP client (``client.py``).

Layer ``vllm | sglang`` of the daemon (pyproject.toml): may import ``daemon.core``,
``daemon.engine_http`` and ``slotsync.protocol``; never ``daemon.vllm`` (independent
families; ``tensor_pickle.py`` still reads ``vllm/ipc_pickle.py``'s opcode helpers: to move
below both), ``daemon.families``, the node links or the service.
"""
