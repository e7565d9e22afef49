"""A rank's side of an adapter round (issue 36): ``Publisher.publish_adapter``.

``inputs.py`` (what ``publish_adapter`` accepts: the PEFT config as the text every rank sends,
the version, each tensor's rows of dim 0 -- whole, declared with ``rows=``, or an FSDP2
``Shard(0)`` DTensor's local rows -- and PEFT's tensor names), ``part.py`` (this rank's part in
memory: one host copy in a POSIX shared-memory segment, where the digests are taken, and on a
GPU one packed device buffer; which handle each transport sends, and freeing both), and
``round.py`` (the conversation: ``wire.AdapterBegin``, its ack and transport,
``wire.AdapterData``, the served name; errors, deadlines and a daemon restart as
``Publisher.publish`` has them).

Layer: inside ``protocol/rank/`` (imports its ``export``, ``shm_segment``, ``sharded``,
``session``, ``connection`` and the schema, with torch); ``publisher.py`` imports ``round``.
"""
