"""Adapters that let trainers publish through slotsync without writing their own loop.

* ``slotsync.integrations.vllm``: slotsync as a registered vLLM weight-transfer backend
  (``SlotsyncTrainerInitInfo``; vLLM 0.32-0.33 ``vllm/distributed/weight_transfer/``).
* ``slotsync.integrations.fsdp``: a ``WeightSource`` over an FSDP2 module whose parameters the
  publisher gathers straight into its staging regions.

Recipes for RL frameworks are in docs/integrations/. Rank-side code: may import
``slotsync.protocol`` (its schema and ``protocol.rank``) and torch; never the daemon, an engine
or a benchmark (pyproject.toml's import-linter contracts).
"""
