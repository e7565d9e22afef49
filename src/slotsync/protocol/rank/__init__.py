"""The trainer-side client: what runs in a trainer rank's process to publish its weights.

``publisher.py`` (``Publisher``, the facade a training loop calls, and ``PublishStats``) and
``connection.py`` (its connection to the daemon: parts, registration, the begin's settling,
errors, close); ``session.py`` (the update's state machine, sans I/O); ``pipeline.py`` (copy,
send and ack order over the staging regions); ``waits.py`` (sends and deadline waits, a daemon
gone); ``link.py`` (the ZeroMQ DEALER socket) and ``connect_check.py`` (why a daemon cannot be
reached); ``inputs.py`` (argument, tensor and manifest checks); ``manifest_cache.py`` (manifest
digests kept across rounds); ``gc_hold.py`` (the cyclic GC held off during ``publish``);
``export.py``, ``staging.py``, ``chunk_export.py``, ``export_ledger.py``, ``shm_segment.py``,
``sharded.py`` and ``gather.py`` (tensors to handle records: CUDA IPC and shared memory, the
staging memory, DTensor shards, the Triton gather); ``groups.py`` (per-slot
``torch.distributed`` groups); ``adapters/`` (``Publisher.publish_adapter``: a LoRA adapter
round, issue 36).

Layer: above the schema in ``slotsync.protocol`` (``wire``, ``topology``, ``errors``,
``chunking``, ``manifest``, ``liveness``, ``endpoint``), which it imports, with torch, zmq and
msgspec. It never imports the daemon, an engine or a benchmark (import-linter: "Rank-side code
never imports the daemon ..."), and the schema never imports it. Nothing here is imported by
``import slotsync.protocol`` until a torch-dependent name is used.
"""
