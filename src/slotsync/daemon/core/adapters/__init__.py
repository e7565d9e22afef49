"""Adapter rounds (issue 36), I/O-free: what one round of a LoRA adapter is (``plan``), the
rules that gather a slot's ranks' parts into it, and what each engine holds."""
