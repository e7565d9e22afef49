"""``slotsync status`` and ``slotsync demo`` count a slot's LoRA adapter rounds beside its
base-weight updates (issue 36's fresh-user trial: after ``slotsync demo --lora`` ran its
adapter rounds, the daemon's line said "updates ok 0, failed 0", and ``slotsync status``'s
table had no count at all). The slots are the core's own, driven through adapter rounds and
base-weight rounds by ``test_adapter_rounds``' harness (a scripted vLLM engine with its LoRA
routes); their ``/status`` entries go through the status table and the demo's daemon line.

Red on the old code: ``slotsync.cli.status`` had no ``rounds`` (the table no ROUNDS column)
and ``slotsync.demo.run`` no ``rounds_summary`` (the demo printed ``updates ok 0, failed 0``
for a slot that ran only adapter rounds)."""

from __future__ import annotations

from test_adapter_rounds import started

from slotsync.cli.status import render_table, rounds
from slotsync.demo.run import rounds_summary


def _row(doc: dict) -> tuple[str, str]:
    """The status table's header line and the slot's row."""
    lines = render_table({"version": "t", "endpoint": "ipc:///x", "slots": [doc]}).splitlines()
    return lines[1], lines[2]


def test_a_slot_of_adapter_rounds_only_counts_them_ok_and_failed():
    h = started()
    h.adapter_round(0, version=1)
    h.adapter_round(1, version=2)
    h.engine.fail[("load_lora_adapter", 2)] = "HTTP 500: worker failed to read the folder"
    h.adapter_round(2, version=3)
    doc = h.coord.status()
    assert (doc["adapter_rounds_succeeded"], doc["adapter_rounds_failed"]) == (2, 1)
    assert (doc["updates_succeeded"], doc["updates_failed"]) == (0, 0)
    head, row = _row(doc)
    assert "ROUNDS OK/FAILED" in head
    assert rounds(doc) == "weights 0/0, adapters 2/1" and "weights 0/0, adapters 2/1" in row
    assert rounds_summary(doc) == "adapter rounds ok 2, failed 1"  # (no "updates ok 0")


def test_base_weight_updates_alone_read_as_before_and_both_kinds_side_by_side():
    h = started()
    h.round(0)  # a base-weight update: the slot's first id
    doc = h.coord.status()
    assert doc["updates_succeeded"] == 1 and doc["adapter_rounds_succeeded"] == 0
    assert rounds(doc) == "weights 1/0" and "weights 1/0" in _row(doc)[1]
    assert rounds_summary(doc) == "updates ok 1, failed 0"  # (the demo's line, unchanged)
    h.adapter_round(1, version=1)  # (adapter and base rounds share the slot's ids)
    doc = h.coord.status()
    assert rounds(doc) == "weights 1/0, adapters 1/0"
    assert rounds_summary(doc) == "updates ok 1, failed 0; adapter rounds ok 1, failed 0"


def test_a_slot_that_ran_nothing_and_an_older_daemons_document():
    h = started()
    doc = h.coord.status()
    assert rounds(doc) == "weights 0/0" and rounds_summary(doc) == "updates ok 0, failed 0"
    for key in ("adapter_rounds_succeeded", "adapter_rounds_failed"):  # (before issue 36)
        doc.pop(key)
    assert rounds(doc) == "weights 0/0"
    assert rounds({"slot": [0, 2], "state": "idle"}) == "-"  # (no counts reported at all)
