"""vLLM as an engine family of the daemon: its ``EngineFamily`` (``family.py``), payload
(``merge.py``, ``ipc_pickle.py``), version table (``versions.py``), DP-layout rule
(``dp_layout.py``) and HTTP client (``client.py``).

Layer ``vllm | sglang`` of the daemon (pyproject.toml): may import ``daemon.core``, what
the families share (``daemon.engine_http``, ``daemon.torch_pickle``) and
``slotsync.protocol``; never ``daemon.sglang`` (independent families), ``daemon.families``,
the node links or the service.
"""
