"""SGLang as an engine family of the daemon (issue 26): its ``EngineFamily`` (``family.py``),
step table (``routes.py``), payload (``merge.py``, ``tensor_pickle.py``), buffer fence
(``fence.py``), version table (``versions.py``) and HTTP client (``client.py``).

Layer ``vllm | sglang`` of the daemon (pyproject.toml): may import ``daemon.core``, what
the families share (``daemon.engine_http``, ``daemon.torch_pickle``: ``tensor_pickle.py``
reads its opcode helpers there) and ``slotsync.protocol``; never ``daemon.vllm`` (independent
families), ``daemon.families``, the node links or the service.
"""
