"""``slotsync bench lora`` (issue 36): the time from the last rank's ``publish_adapter`` call to a
LoRA adapter being servable on the engine, against the disk path users have today (PEFT's
``save_pretrained`` into a folder, then vLLM's ``POST /v1/load_lora_adapter``), on the same
machine, the same engine and the same adapter, in one run.

Here: ``adapter`` (the adapter's shapes -- Qwen3-8B's at rank 32 by default, a small one for
CI -- its tensors, PEFT config, the PEFT-style save of the disk path, and the engine's stand-in
model), ``rank`` (the trainer rank process: both paths, interleaved, timed with one clock),
``profile`` (where the time goes: the daemon's own folder write and the engine's read, each
measured alone with the code those processes run) and ``run`` (the command: its options, the
daemon, engine and ranks, the figures, the targets and the BENCHMARKS.md section).

Layer: inside ``slotsync.bench`` (imports the daemon's vLLM helper, the engines' launcher,
``slotsync.testing`` and ``slotsync.protocol``; torch only inside the functions that run it);
``bench/cli.py`` imports ``run``.
"""
