"""What the SGLang daemon suites share (``tests/integration/test_sglang_daemon.py``,
``tests/faults/test_sglang_faults.py``): the SGLang-code engine (TP=2; the module's is
conftest's ``sgl`` / ``fresh_sgl``), the checks that a round landed, and an engine table
declaring the engine."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from engines import EngineBox
from spawned_ranks import rounds
from trainer_script import make_tensors

from slotsync.engine.checksum import tensor_checksum

TP = 2


def sglang_box(version: str, impl: str = "sglang", **sglang: Any) -> EngineBox:
    return EngineBox(TP, impl_name=impl, sglang={"sglang_version": version, **sglang})


def assert_landed(box: EngineBox, k: int) -> None:
    """Every TP rank holds round ``k``'s tensors; the version is ``v<k>``; generation runs
    and no session is left open."""
    want = {n: tensor_checksum(t) for n, t in make_tensors(k)}
    by_rank = box.checksums()
    assert sorted(by_rank) == [f"tp{r}" for r in range(TP)], by_rank.keys()
    for rank, sums in by_rank.items():
        assert {n: sums.get(n) for n in want} == want, f"{rank} differs"
    assert box.weight_version() == f"v{k}"
    stats = box.stats()
    assert stats["paused"] is False and stats["session_open"] is False, stats


def ok_rounds(ev: dict, n: int, box: EngineBox | None = None) -> None:
    """Every rank's ``n`` rounds succeeded (else their messages, and ``box``'s engine log)."""
    for r in range(TP):
        got = rounds(ev, r)
        assert [e["status"] for e in got] == ["ok"] * n, (
            [e.get("message") for e in got], box.eng.log_tail(3000) if box else "")


def table(tmp_path: Path, url: str, **keys: str | list[str]) -> list[str]:
    """``slotsyncd`` flags for an engine table declaring the engine (``keys``: more TOML, a
    string or a list of strings each)."""
    path = tmp_path / "slotsyncd.toml"
    extra = "".join(f"{k} = {json.dumps(v)}\n" for k, v in keys.items())
    path.write_text(f'[[engines]]\nurl = "{url}"\nslot_start = 0\nslot_size = {TP}\n{extra}')
    return ["--config", str(path)]


