"""The I/O-free rules of an adapter round's plan (issue 36 D, ``daemon/core/adapters/``):
a slot's ``AdapterBegin`` parts gathered into one plan (agreement, exact tiling of each
tensor's rows), the version order against the one served, the engine's limits, and the
ledger's view of an engine restart. Red on the old code: the modules did not exist."""

from __future__ import annotations

import pytest
from adapter_ranks import CONFIG, A, B, begin, part, two_rank_parts
from hypothesis import given, settings
from hypothesis import strategies as st

from slotsync.daemon.core.adapters.gather import (
    AdapterRefused,
    gather,
    limits_refusal,
    version_refusal,
)
from slotsync.daemon.core.adapters.ledger import (
    LOST,
    RELOADING,
    SERVED,
    AdapterEntry,
    AdapterLedger,
    parse_served_name,
)
from slotsync.daemon.core.adapters.plan import LoraLimits
from slotsync.protocol import wire

FLAGS = (("enabled", "--enable-lora"), ("max_loras", "--max-loras"),
         ("max_lora_rank", "--max-lora-rank"))


def test_parts_split_over_ranks_gather_into_one_plan_in_row_order():
    parts = two_rank_parts()
    plan = gather({r: begin(0, p) for r, p in parts.items()})
    assert (plan.lora_name, plan.version, plan.served_name) == ("math", 1, "math@v1")
    assert plan.lora_rank == 4 and plan.config_json == CONFIG and plan.ranks == (0, 1)
    assert [t.name for t in plan.tensors] == [A, B]
    a, b = plan.tensors
    assert a.whole is not None and a.whole.rank == 0 and a.whole.offset == 0
    assert [(p.rank, p.row_start, p.row_stop) for p in b.parts] == [(0, 0, 10), (1, 10, 16)]
    # each part's offset is where wire.part_offsets puts it behind its rank's handle
    assert b.parts[0].offset == wire.part_offsets([t for t, _ in parts[0]])[0][1] == 256
    assert b.parts[1].offset == 0
    assert b.nbytes == 16 * 4 * 4 and plan.nbytes == 4 * 16 * 4 + 16 * 4 * 4
    assert b.parts[0].sha256 == parts[0][1][0].sha256


@pytest.mark.parametrize("rows1, words", [
    ((11, 16), "rows [10, 11) of its 16 are held by no rank"),
    ((9, 16), "rows [9, 10) are held by rank 0 and rank 1"),
    ((10, 15), "rows [15, 16) of its 16 are held by no rank"),
])
def test_parts_that_leave_a_gap_or_overlap_are_refused_naming_the_rows(rows1, words):
    parts = two_rank_parts()
    parts[1] = [part(B, (16, 4), rows1)]
    with pytest.raises(AdapterRefused, match=r"adapter tensor '.*lora_B.weight'") as e:
        gather({r: begin(0, p) for r, p in parts.items()})
    assert words in str(e.value)


def test_ranks_that_split_rows_without_rows_are_told_to_pass_rows():
    """The fresh-user trial (MEDIUM): two ranks each pass their half of a tensor's rows as a
    plain tensor without ``rows=``; each half is then taken as a whole tensor, rows [0, 8)
    of shape [8, 4], from both ranks. The overlap refusal says how to declare the rows each
    rank holds (``rows={name: (row_start, whole_shape)}``, docs/publisher.md), and that ranks
    that each hold the whole tensor publish it from one rank. (Red before: it said only
    "the ranks' parts must not overlap".)"""
    halves = {r: [part(B, (8, 4), (0, 8))] for r in range(2)}
    with pytest.raises(AdapterRefused) as e:
        gather({r: begin(0, p) for r, p in halves.items()})
    text = str(e.value)
    assert "rows [0, 8) are held by rank 0 and rank 1" in text
    assert f"rows={{{B!r}: (row_start, whole_shape)}}" in text, text
    assert "docs/publisher.md" in text and "from one rank" in text, text


def test_ranks_that_disagree_are_refused_naming_both():
    parts = two_rank_parts()
    with pytest.raises(AdapterRefused, match="rank 1 sends 2, rank 0 1"):
        gather({0: begin(0, parts[0]), 1: begin(0, parts[1], version=2)})
    with pytest.raises(AdapterRefused, match="disagree on the adapter: rank 1 sends 'code'"):
        gather({0: begin(0, parts[0]), 1: begin(0, parts[1], lora_name="code")})
    other = CONFIG.replace('"r": 4', '"r": 8')
    with pytest.raises(AdapterRefused, match=r"PEFT config \(config_json\)"):
        gather({0: begin(0, parts[0]), 1: begin(0, parts[1], config=other)})
    shape = [part(B, (16, 8), (10, 16))]
    with pytest.raises(AdapterRefused, match=r"rank 1 sends dtype float32 shape \[16, 8\], "
                       r"rank 0 dtype float32 shape \[16, 4\]"):
        gather({0: begin(0, parts[0]), 1: begin(0, shape)})
    with pytest.raises(AdapterRefused, match="no rank sends any tensor"):
        gather({0: begin(0, []), 1: begin(0, [])})


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 40), st.lists(st.integers(0, 3), min_size=1, max_size=8),
       st.data())
def test_any_split_of_rows_over_ranks_tiles_and_one_part_dropped_is_refused(rows, owners,
                                                                            data):
    """Rows of one tensor cut at random points, the runs given to 4 ranks in any order:
    the plan holds every run in row order; without any one run it is refused (a gap)."""
    cuts = sorted(set(data.draw(st.lists(st.integers(1, rows - 1), max_size=len(owners) - 1)
                                if rows > 1 else st.just([]))))
    bounds = list(zip([0, *cuts], [*cuts, rows], strict=True))
    by_rank: dict[int, list] = {r: [] for r in range(4)}
    for i, (lo, hi) in enumerate(bounds):
        by_rank[owners[i % len(owners)]].append((lo, hi))

    def begins(skip: tuple[int, int] | None) -> dict[int, wire.AdapterBegin]:
        out = {}
        for r, runs in by_rank.items():
            # (one rank holds at most one part of a tensor: its runs become other tensors)
            ps = [part(f"t{k}" if k else B, (rows, 2), run)
                  for k, run in enumerate(x for x in runs if x != skip)]
            out[r] = begin(0, ps)
        return out

    if all(len(runs) <= 1 for runs in by_rank.values()):
        plan = gather(begins(None))
        (t,) = plan.tensors
        assert [(p.row_start, p.row_stop) for p in t.parts] == bounds
        if len(bounds) > 1:
            with pytest.raises(AdapterRefused, match="held by no rank"):
                gather(begins(bounds[len(bounds) // 2]))


def test_a_version_not_above_the_one_served_is_refused_naming_both():
    plan = gather({r: begin(0, p, version=2) for r, p in two_rank_parts(2).items()})
    assert version_refusal(plan, None, False, "http://e") == ""
    assert version_refusal(plan, 1, False, "http://e") == ""
    older = version_refusal(plan, 3, False, "http://e")
    assert older == ("adapter 'math' version 2 is a version older than version 3, which "
                     "engine http://e serves as math@v3: publish a version above 3")
    assert "the same version as version 2" in version_refusal(plan, 2, False, "http://e")
    # a version the engine lost with a restart may be published again
    assert version_refusal(plan, 2, True, "http://e") == ""


def test_limits_refuse_naming_the_flag_to_set():
    plan = gather({r: begin(0, p) for r, p in two_rank_parts().items()})  # r = 4
    off = limits_refusal(plan, LoraLimits(False, flags=FLAGS), set(), "http://e", "vLLM")
    assert off == "engine http://e (vLLM) does not serve LoRA adapters: start it with " \
                  "--enable-lora"
    small = limits_refusal(plan, LoraLimits(True, 0, 2, FLAGS), set(), "http://e", "vLLM")
    assert "r=4, above engine http://e's max_lora_rank 2: set --max-lora-rank to 4 or more" \
        in small
    full = limits_refusal(plan, LoraLimits(True, 1, 8, FLAGS), {"math@v0"}, "http://e", "x")
    assert ("would hold 2 adapters at once (math@v0, math@v1: a new version is loaded "
            "beside the one it replaces), above its max_loras 1: set --max-loras to 2 or more"
            in full)
    assert limits_refusal(plan, LoraLimits(True, 2, 4, FLAGS), {"math@v0"}, "e", "x") == ""
    assert limits_refusal(plan, LoraLimits(True), {"a@v1", "b@v1"}, "e", "x") == ""  # unknown


def test_the_ledger_after_a_restart_reloads_what_has_a_folder_and_loses_the_rest():
    ledger = AdapterLedger()
    ledger.entries["math@v3"] = AdapterEntry("math", 3, "math@v3", SERVED, folder="/f/m3")
    ledger.entries["code@v1"] = AdapterEntry("code", 1, "code@v1", SERVED)
    ledger.stray["math@v4"] = "/f/m4"
    rec = ledger.reconcile({"math@v3", "code@v1", "other@v7", "plain"}, True, "http://e")
    assert (rec.reload, rec.lost, rec.gone) == ([], [], ["/f/m4"])  # m4 gone: not held
    assert [e.served_name for e in rec.adopted] == ["other@v7"]  # (plain: not ours)
    assert ledger.current("other").version == 7
    rec = ledger.restarted(True, "http://e")  # the base round's probe: a new session
    assert [e.served_name for e in rec.reload] == ["math@v3"]
    assert ledger.entries["math@v3"].state == RELOADING
    lost = ledger.entries["code@v1"]
    assert {e.served_name for e in rec.lost} == {"code@v1", "other@v7"} and lost.state == LOST
    assert "publish version 1 of 'code' again" in lost.error
    assert ledger.folders_in_use() == {"/f/m3"}
    assert parse_served_name("math@v12") == ("math", 12) and parse_served_name("x@y") is None


def test_retired_folders_outlive_one_more_version():
    ledger = AdapterLedger()
    for v in (1, 2, 3):
        ledger.entries[f"m@v{v}"] = AdapterEntry("m", v, f"m@v{v}", SERVED, folder=f"/f/{v}")
    assert ledger.retire("m@v1") == []  # kept: a running request may read it again
    assert ledger.retire("m@v2") == ["/f/1"]
    assert ledger.folders_in_use() == {"/f/2", "/f/3"} and ledger.retired == [("m", "/f/2")]
