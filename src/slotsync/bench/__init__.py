"""``slotsync bench``: benchmarks of the control plane (CPU) and the data plane (GPU).

What lives here: ``cli`` (the ``slotsync bench`` / ``python -m slotsync.bench`` command line:
``control`` and ``gpu`` and the dispatch to the others), one module per benchmark (``hop``
with ``hop_run``, ``vs_vllm`` with ``vs_vllm_rounds`` and ``vllm_trainer_standin``, the
``lora`` subpackage (``slotsync bench lora``: an adapter through slotsync vs the disk),
``oversize``, ``fsdp_gather``, ``gather_kernel``, ``ep``, ``soak``, ``profile_chunk``; the
last six also run as ``python -m slotsync.bench.NAME``), what they share (``control``: the
control-plane rounds and their timing; ``control_memory``: the memory a control session needs,
checked before it starts; ``gpu``: the CUDA IPC run; ``model``: Qwen3-30B-A3B's
tensor shapes and chunking; ``fake_exports``: synthetic export handles; ``report``: the
Markdown sections of BENCHMARKS.md, the machine line, the integer options, the sweep's plot).

What it may import: the daemon, the engines, ``slotsync.testing``, ``slotsync.protocol``,
torch (inside the functions that run on a rank or a GPU). Never the CLI (``slotsync.cli``) or
the demo: ``slotsync.cli`` imports this package, not the other way (the layers contract in
``pyproject.toml``). Inside it, ``cli`` is on top: no benchmark imports ``cli``.
"""
