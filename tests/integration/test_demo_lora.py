"""``slotsync demo --lora`` (issue 36 E): LoRA adapter rounds from two trainer ranks through a
real slotsyncd into each engine kind -- the reference engine, vLLM's own LoRA router and
worker LoRA manager (``--engine vllm``), SGLang's own LoRA receive code on 2 TP ranks
(``--engine sglang``) -- on a small random Llama the demo makes. Each round's line must say
that every worker holds exactly the trainer's tensors under the served name
(``demo@v<k>``, read back through the engine's ``/_slotsync/lora``) and that the previous
version was unloaded; the vLLM-style engines get a round whose tensors are split by rows over
both ranks and one held by one rank, SGLang's one held by one rank and one spread whole over
both. Nothing is left behind: the demo's folder, with the daemon's adapter folders, is gone
(the suite's leak check covers shared memory and processes).

Red on the old code: ``slotsync demo`` had no ``--lora`` (argparse exits 2); then the
daemon's line counted base-weight updates only ("updates ok 0, failed 0")."""

from __future__ import annotations

import os
import re

import pytest

pytest.importorskip("torch")

from test_demo import _demo_here  # noqa: E402

pytestmark = pytest.mark.slow

ENGINES = [
    pytest.param("reference", ("rows split over 2 ranks", "all on one rank"), id="reference"),
    pytest.param("vllm", ("rows split over 2 ranks", "all on one rank"), id="vllm-code",
                 marks=pytest.mark.vllm),
    pytest.param("sglang", ("all on one rank", "whole tensors spread over 2 ranks"),
                 id="sglang-code", marks=pytest.mark.sglang),
]


@pytest.mark.parametrize("engine,layouts", ENGINES)
def test_demo_lora_rounds_verify_on_every_worker(engine, layouts, capsys, monkeypatch):
    if engine == "vllm":
        from engines import vllm_importable

        why = vllm_importable()
        if why:
            pytest.skip(f"vllm cannot be imported: {why}")
    out = _demo_here(["--lora", "--ranks", "2", "--rounds", "2", "--device", "cpu",
                      "--engine", engine], capsys, monkeypatch)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text
    lines = out.stdout.splitlines()
    one = next(ln for ln in lines if "round 1/2:" in ln)
    two = next(ln for ln in lines if "round 2/2:" in ln)
    assert "demo@v1" in one and layouts[0] in one, one
    assert "demo@v2" in two and layouts[1] in two, two
    for line in (one, two):
        assert "32 tensors" in line and "checksums equal on 2 workers" in line, line
    assert "demo@v1 unloaded" in two, two
    assert "MISMATCH" not in text
    adapters = next(ln for ln in lines if "slot [0, 2) adapters:" in ln)  # (the daemon's
    # /status; demo@v1 may still be listed "unloading" until the daemon has its answer)
    assert "demo@v2 served" in adapters and "demo@v1 served" not in adapters, adapters
    counts = next(ln for ln in lines if "daemon: slot [0, 2) state" in ln)  # (the trial saw
    # "updates ok 0, failed 0" there: base-weight updates only)
    assert "adapter rounds ok 2, failed 0" in counts and "updates ok" not in counts, counts
    assert "slotsync demo OK" in out.stdout
    (folder,) = re.findall(r"ipc://(\S+)/slotsyncd\.sock", out.stdout)
    assert not os.path.exists(folder)  # (the daemon's adapter folders were in it)


def test_demo_lora_with_an_engine_slot_per_rank(capsys, monkeypatch):
    """Two engines of one worker each: every slot's one rank holds its adapter whole."""
    out = _demo_here(["--lora", "--ranks", "2", "--gpus-per-engine", "1", "--rounds", "1",
                      "--device", "cpu"], capsys, monkeypatch)
    assert out.returncode == 0, out.stdout + out.stderr
    for slot in ("slot [0, 1)", "slot [1, 2)"):
        line = next(ln for ln in out.stdout.splitlines() if f"round 1/1 {slot}:" in ln)
        assert "demo@v1" in line and "checksums equal on 1 worker " in line, line
