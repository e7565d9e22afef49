"""Issue 36 E: the adapters each slot's engine holds, from the slots' ``/status`` entries
(``"adapters"``: ``lora_name``, ``version``, ``served_name``, ``state``, ``nbytes``,
``loaded_at``, ``error``), in Prometheus (``Metrics``: read at scrape time from the slot table,
and the adapter rounds' ends) and in ``slotsync status`` (its table, its stderr line and exit
status when an adapter is lost)."""

from __future__ import annotations

import shutil
import subprocess

import pytest
from prometheus_client import generate_latest
from test_status_cli_summary import _serve

from slotsync.cli import status as status_cli
from slotsync.cli.status_adapters import lost_adapters, render_adapters
from slotsync.daemon.core.coordinator import Timeouts
from slotsync.daemon.families import SlotTable
from slotsync.daemon.service.metrics import ADAPTER_STATES, Metrics
from slotsync.protocol.wire import PROTOCOL_VERSION, Register, served_name


def _adapter(name: str, version: int, state: str, nbytes: int = 12_500_000,
             loaded_at: float | None = 1000.0, error: str | None = None) -> dict:
    """One ``"adapters"`` entry of a slot's ``/status`` (the shape of ctx "Status shape")."""
    return {"lora_name": name, "version": version, "served_name": served_name(name, version),
            "state": state, "nbytes": nbytes, "loaded_at": loaded_at, "error": error}


LOST_ERROR = ("engine restarted; loading math@v3 again failed: 400 max_loras=1 is full "
              "(start vLLM with --max-loras 2)")


def _table_with_adapters(adapters: dict[tuple[int, int], list[dict]]) -> SlotTable:
    """A real ``SlotTable`` with one registered rank per slot, each slot's ``status()`` given
    ``adapters`` (the core's ledger writes it; here it is fed, so that this test reads only
    the document)."""
    table = SlotTable(Timeouts(), "t")
    for i, (start, end) in enumerate(sorted(adapters)):
        table.on_message(f"rank{start}".encode(), Register(
            PROTOCOL_VERSION, start, f"00000000-0000-0000-0000-{i:012d}", start, end - start,
            f"http://e{start}:1", True, "shm", "host", 100 + start), 1000.0)
    for slot, entries in adapters.items():
        c = next(c for c in table.slots.values() if tuple(c.slot) == slot)
        real = c.status
        c.status = lambda now=None, real=real, entries=entries: {**real(now),
                                                                  "adapters": entries}
    return table


def _sample(text: str, name: str) -> float:
    (line,) = [ln for ln in text.splitlines() if ln.startswith(name + " ")]
    return float(line.rsplit(" ", 1)[1])


# ------------------------------------------------------------------------------- metrics


def test_served_version_and_states_per_slot_and_adapter_are_read_at_scrape_time():
    entries = [_adapter("math", 3, "served"), _adapter("math", 4, "loading")]
    table = _table_with_adapters({(0, 2): entries, (2, 4): [_adapter("math", 3, "served")]})
    m = Metrics("t")
    m.watch(table)
    text = generate_latest(m.registry).decode()
    assert _sample(text, 'slotsync_adapter_served_version{lora_name="math",slot="[0,2)"}') == 3
    assert _sample(text, 'slotsync_adapter_served_version{lora_name="math",slot="[2,4)"}') == 3
    got = {s: _sample(text, f'slotsync_adapter_versions{{lora_name="math",slot="[0,2)",'
                            f'state="{s}"}}') for s in ADAPTER_STATES}
    assert got == {"served": 1, "loading": 1, "reloading": 0, "unloading": 0, "lost": 0}

    # the round ends: v4 served, v3 unloading; then the engine restarts and v4 is lost
    entries[:] = [_adapter("math", 3, "unloading"), _adapter("math", 4, "served")]
    text = generate_latest(m.registry).decode()
    assert _sample(text, 'slotsync_adapter_served_version{lora_name="math",slot="[0,2)"}') == 4
    entries[:] = [_adapter("math", 4, "lost", error=LOST_ERROR)]
    text = generate_latest(m.registry).decode()
    assert _sample(text, 'slotsync_adapter_served_version{lora_name="math",slot="[0,2)"}') == 0
    assert _sample(text, 'slotsync_adapter_versions{lora_name="math",slot="[0,2)",'
                         'state="lost"}') == 1
    assert _sample(text, 'slotsync_adapter_versions{lora_name="math",slot="[2,4)",'
                         'state="lost"}') == 0


def test_no_adapter_series_for_slots_without_adapters():
    m = Metrics("t")
    m.watch(_table_with_adapters({(0, 2): []}))
    text = generate_latest(m.registry).decode()
    assert "slotsync_adapter_served_version{" not in text
    assert "slotsync_adapter_versions{" not in text


def test_adapter_round_ends_count_by_outcome_with_duration_and_bytes():
    m = Metrics("t")
    text = generate_latest(m.registry).decode()
    # (the counter exists at 0 from the start, so the first failure is an increase())
    assert _sample(text, 'slotsync_adapter_loads_total{outcome="failed"}') == 0
    m.adapter_round_ended("success", 0.08, 12_500_000)
    m.adapter_round_ended("failed", 400.0, 12_500_000)
    m.adapter_round_ended("refused", 0.001)  # (an outcome not in the set counts as failed)
    text = generate_latest(m.registry).decode()
    assert _sample(text, 'slotsync_adapter_loads_total{outcome="success"}') == 1
    assert _sample(text, 'slotsync_adapter_loads_total{outcome="failed"}') == 2
    assert _sample(text, "slotsync_adapter_bytes_total") == 12_500_000
    assert _sample(text, 'slotsync_adapter_load_duration_seconds_bucket{le="0.1"}') == 2
    assert _sample(text, 'slotsync_adapter_load_duration_seconds_bucket{le="300.0"}') == 2
    assert _sample(text, 'slotsync_adapter_load_duration_seconds_bucket{le="+Inf"}') == 3


def test_slot_events_that_end_adapter_rounds_are_counted_and_others_ignored():
    """``Metrics.slot_event`` reads the two ``SlotEvent``s that end an adapter round, with
    the fields the core writes (``core/adapters/answers.py``: ``adapter_loaded``;
    ``core/adapters/rounds.py``: ``adapter_failed``)."""
    m = Metrics("t")
    m.slot_event("adapter_loaded", {"engine": "http://e:1", "update_id": 3,
                                    "served_name": "math@v3", "bytes": 4096, "seconds": 0.02,
                                    "load_s": 0.01, "replaces": "math@v2"})
    m.slot_event("adapter_failed", {"engine": "http://e:1", "update_id": 4,
                                    "adapter": "math@v4", "seconds": 0.5, "error": "400"})
    m.slot_event("rank_gone", {"rank": 0})
    text = generate_latest(m.registry).decode()
    assert _sample(text, 'slotsync_adapter_loads_total{outcome="success"}') == 1
    assert _sample(text, 'slotsync_adapter_loads_total{outcome="failed"}') == 1
    assert _sample(text, "slotsync_adapter_bytes_total") == 4096
    assert _sample(text, "slotsync_adapter_load_duration_seconds_sum") == 0.52


def test_adapter_metrics_pass_promtool_check_metrics():
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not installed (Debian: apt-get install prometheus)")
    m = Metrics("t")
    m.watch(_table_with_adapters({(0, 2): [_adapter("math", 3, "served"),
                                           _adapter("code", 1, "lost", error="gone")]}))
    m.adapter_round_ended("success", 0.1, 10)
    r = subprocess.run([promtool, "check", "metrics"], input=generate_latest(m.registry),
                       capture_output=True, timeout=60)
    # promtool prints lint problems and exits 1; clean means no output at all
    assert r.returncode == 0 and not (r.stdout + r.stderr).strip(), r.stdout + r.stderr


# ------------------------------------------------------------------------------- the CLI


def _doc(table: SlotTable) -> dict:
    return {"version": "t", "endpoint": "ipc:///x", "ranks_connected": 1,
            "slots": [c.status() for _, c in sorted(table.slots.items())],
            "released_engines": []}


def test_status_table_shows_each_engines_adapters_versions_and_states():
    table = _table_with_adapters({
        (0, 2): [_adapter("math", 3, "served", loaded_at=958.0),
                 _adapter("math", 4, "loading", loaded_at=None)],
        (2, 4): [_adapter("math", 3, "lost", error=LOST_ERROR),
                 _adapter("code", 1, "reloading", nbytes=3_100_000, loaded_at=None)]})
    text = render_adapters(_doc(table), now=1000.0)
    lines = text.splitlines()
    assert lines[0].split() == ["SLOT", "ENGINE", "ADAPTER", "STATE", "SIZE", "LOADED", "ERROR"]
    rows = {(ln.split()[0], ln.split()[2]): ln for ln in lines[1:5]}
    assert rows[("[0,2)", "math@v3")].split()[1:7] == [
        "http://e0:1", "math@v3", "served", "12.5", "MB", "42s"]
    assert " loading " in rows[("[0,2)", "math@v4")]
    assert " reloading " in rows[("[2,4)", "code@v1")] and "3.1 MB" in rows[("[2,4)",
                                                                               "code@v1")]
    assert " LOST " in rows[("[2,4)", "math@v3")] and "engine restarted" in rows[
        ("[2,4)", "math@v3")]
    assert lines[5:] == ["[0,2) serves math@v3 (12.5 MB)", "[2,4) serves no adapter"]
    # and the whole table carries it between the ranks and the peers
    assert "\nSLOT   ENGINE       ADAPTER" in status_cli.render_table(_doc(table))


def test_status_says_each_engines_round_in_flight_and_rounds_so_far():
    table = _table_with_adapters({(0, 2): [_adapter("math", 3, "served", nbytes=0)],
                                  (2, 4): []})
    doc = _doc(table)
    doc["slots"][0].update(adapter_round={"update_id": 5, "adapter": "math@v4",
                                          "phase": "load", "failing": False},
                           adapter_rounds_succeeded=3, adapter_rounds_failed=1,
                           adapter_last_error="vLLM refused the load: 400 ... (start vLLM "
                                              "with --max-lora-rank 64)")
    doc["slots"][1].update(adapter_round={"update_id": 1, "adapter": "code@v1",
                                          "phase": "begin", "failing": True},
                           adapter_rounds_succeeded=0, adapter_rounds_failed=0)
    lines = render_adapters(doc, now=1000.0).splitlines()
    assert lines[1].split()[2:5] == ["math@v3", "served", "-"]  # (nbytes 0: not known)
    assert lines[2:] == [
        "[0,2) serves math@v3 (-); adapter round in flight: math@v4, phase load; 3 adapter "
        "round(s) succeeded, 1 failed, the last: vLLM refused the load: 400 ... (start vLLM "
        "with --max-lora-rank 64)",
        "[2,4) serves no adapter; adapter round in flight: code@v1, phase begin (failing)"]


def test_status_without_adapters_shows_no_adapter_part():
    doc = _doc(_table_with_adapters({(0, 2): []}))
    assert render_adapters(doc) == "" and lost_adapters(doc) == []
    assert "ADAPTER" not in status_cli.render_table(doc)
    # a daemon from before issue 36: no "adapters" key at all
    doc["slots"][0].pop("adapters")
    assert render_adapters(doc) == "" and lost_adapters(doc) == []


@pytest.mark.parametrize(("state", "rc"), [("lost", 1), ("loading", 0), ("reloading", 0),
                                           ("served", 0)])
def test_status_exits_1_and_names_the_lost_adapter_on_stderr(capsys, state, rc):
    table = _table_with_adapters({(0, 2): [_adapter("math", 3, state, error=LOST_ERROR
                                                    if state == "lost" else None)]})
    srv, url = _serve(_doc(table))
    try:
        got = status_cli.main_from_args(status_cli.build_parser().parse_args(["--url", url]))
    finally:
        srv.shutdown()
    out, err = capsys.readouterr()
    assert got == rc, err
    assert "math@v3" in out
    if state == "lost":
        assert ("1 adapter version(s) lost" in err and "[0,2) math@v3: engine restarted"
                in err and "--max-loras 2" in err), err
    else:
        assert "lost" not in err, err


# ------------------------------------------------- against the core's adapter rounds


def test_the_cores_adapter_rounds_show_in_metrics_and_status():
    """The core's own rounds (``tests/unit/test_adapter_rounds.py``'s harness: a scripted
    engine with LoRA routes) through ``Metrics`` (the table at scrape time, the ``SlotEvent``s
    as the executor passes them) and ``slotsync status``'s renderer: a vLLM round served, then
    an SGLang engine's restart that loses its adapter. (Skipped where the core's adapter
    rounds are not there yet.)"""
    rounds = pytest.importorskip("test_adapter_rounds")

    for kind in ("vllm", "sglang"):
        h = rounds.started(kind=kind)
        m = Metrics("t")
        m.watch(h.table)
        for version in (1, 2):  # (SGLang's stand-in takes whole tensors only)
            h.adapter_round(version - 1, version=version, parts=rounds.whole_parts(version)
                            if kind == "sglang" else None)
        for e in h.events:
            m.slot_event(e.event, e.fields)
        text = generate_latest(m.registry).decode()
        assert _sample(text, 'slotsync_adapter_served_version{lora_name="math",'
                             'slot="[0,2)"}') == 2, kind
        assert _sample(text, 'slotsync_adapter_loads_total{outcome="success"}') == 2
        doc = {"version": "t", "slots": [h.coord.status()]}
        assert "[0,2) serves math@v2 (" in render_adapters(doc) and not lost_adapters(doc)
    # (h: the SGLang engine) it restarts; the next round's begin finds math@v2 lost
    h.engine.restart()
    h.adapter_round(2, version=2, parts=rounds.whole_parts(2), data=False)
    text = generate_latest(m.registry).decode()
    assert _sample(text, 'slotsync_adapter_versions{lora_name="math",slot="[0,2)",'
                         'state="lost"}') == 1
    assert _sample(text, 'slotsync_adapter_served_version{lora_name="math",'
                         'slot="[0,2)"}') == 0
    doc = {"version": "t", "slots": [h.coord.status()]}
    (lost,) = lost_adapters(doc)
    assert lost.startswith("[0,2) math@v2: ") and "publish version 2" in lost, lost
    assert " LOST " in render_adapters(doc)
