"""Issue 15 part E: configuration and demo edges.

``--check-config`` prints the runtime folder it resolves to, refuses one the daemon could not
create or use (also at start, before binding), and output into a closed pipe ends quietly
(``slotsyncd``, ``slotsync``); ``slotsync demo`` refuses ``--gpus-per-engine 0`` and a
``--ranks`` whose memory estimate does not fit what is available.
"""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import pytest

from slotsync.daemon import main as daemon_main
from slotsync.daemon.service.config import Config, default_runtime_dir, filesystem_type, load_config

ROOT = Path(__file__).resolve().parents[2]
_RUNTIME_VARS = ("SLOTSYNC_RUNTIME_DIR", "RUNTIME_DIRECTORY", "XDG_RUNTIME_DIR")
needs_proc = pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux /proc")


def _env(**extra: str) -> dict[str, str]:
    """This environment without the variables choosing the default runtime folder."""
    env = {k: v for k, v in os.environ.items() if k not in _RUNTIME_VARS}
    return {**env, **extra}


def _slotsyncd(*argv: str, env: dict[str, str] | None = None, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "slotsync.daemon", *argv], capture_output=True,
                          text=True, timeout=60, env=env, cwd=ROOT, **kw)


def _into_closed_pipe(argv: list[str], env: dict[str, str] | None = None
                      ) -> subprocess.CompletedProcess:
    """Run ``argv`` with stdout a pipe whose reader has gone (like ``| head -2`` once head has
    exited): every write to it fails with EPIPE."""
    r, w = os.pipe()
    os.close(r)
    try:
        return subprocess.run(argv, stdout=w, stderr=subprocess.PIPE, text=True, timeout=120,
                              env=env, cwd=ROOT)
    finally:
        os.close(w)


def _quiet(err: str) -> bool:
    return "Traceback" not in err and "Exception ignored" not in err and "BrokenPipe" not in err


# ------------------------------------------------------------------ 1. the resolved runtime dir


def test_check_config_prints_the_runtime_folder_it_resolves_to(tmp_path):
    out = _slotsyncd("--check-config", "--status-port", "-1",
                     env=_env(XDG_RUNTIME_DIR=str(tmp_path)))
    assert out.returncode == 0, out.stderr
    d = json.loads(out.stdout)
    assert d["runtime_dir"] == f"{tmp_path}/slotsync"  # not ""
    assert d["state_dir"] == f"{tmp_path}/slotsync"
    assert d["endpoint"] == f"ipc://{tmp_path}/slotsync/slotsyncd.sock"
    assert not (tmp_path / "slotsync").exists()  # --check-config creates nothing


def test_describe_resolves_runtime_and_state_dir(monkeypatch, tmp_path):
    for var in _RUNTIME_VARS:
        monkeypatch.delenv(var, raising=False)
    d = Config().describe()
    assert d["runtime_dir"] == default_runtime_dir() == f"/tmp/slotsync-{os.getuid()}"
    assert d["state_dir"] == d["runtime_dir"] and "sources" not in d
    d = Config(runtime_dir=str(tmp_path), state_dir=str(tmp_path / "st")).describe()
    assert d["runtime_dir"] == str(tmp_path) and d["state_dir"] == str(tmp_path / "st")


# ------------------------------------------------------------------ 2. an unusable runtime dir


@needs_proc
@pytest.mark.parametrize("mode", [["--check-config"], []], ids=["check-config", "start"])
def test_runtime_dir_under_proc_is_refused_naming_option_source_and_reason(mode):
    """``--runtime-dir /proc/slotsync`` passed ``--check-config`` (as root, os.access says
    /proc is writable) and then failed at start with a bare ``[Errno 2]``."""
    out = _slotsyncd(*mode, "--runtime-dir", "/proc/slotsync", "--status-port", "-1")
    assert out.returncode == 2, out.stdout + out.stderr
    err = out.stderr
    assert "runtime_dir '/proc/slotsync': cannot create /proc/slotsync: /proc " in err, err
    assert "from --runtime-dir" in err and "Traceback" not in err
    assert "ready" not in out.stdout


@needs_proc
def test_unusable_folder_names_where_the_option_came_from(tmp_path, monkeypatch, capsys):
    def refused(argv: list[str], environ: dict[str, str]) -> str:
        with pytest.raises(SystemExit) as e:
            load_config(argv, environ=environ)
        assert e.value.code == 2
        return capsys.readouterr().err

    err = refused([], {"SLOTSYNC_RUNTIME_DIR": "/proc/slotsync"})
    assert "runtime_dir '/proc/slotsync'" in err
    assert "from environment SLOTSYNC_RUNTIME_DIR" in err
    toml = tmp_path / "d.toml"
    toml.write_text('state_dir = "/sys/slotsync-state"\n')
    err = refused(["--config", str(toml), "--runtime-dir", str(tmp_path)], {})
    assert "state_dir '/sys/slotsync-state': cannot create /sys/slotsync-state: /sys " in err
    assert f"from config file {toml}" in err
    err = refused(["--socket", "ipc:///proc/slotsyncd.sock", "--runtime-dir", str(tmp_path)],
                  {})
    assert "socket folder '/proc'" in err and "from --socket" in err
    for var in _RUNTIME_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("XDG_RUNTIME_DIR", "/proc")  # the default resolves under /proc
    err = refused([], {})
    assert "runtime_dir '/proc/slotsync'" in err
    assert "from the default, $XDG_RUNTIME_DIR/slotsync" in err


def test_a_name_too_long_for_the_filesystem_is_refused_without_creating_anything(tmp_path):
    long = tmp_path / ("x" * 300) / "state"
    out = _slotsyncd("--check-config", "--runtime-dir", str(tmp_path), "--state-dir", str(long),
                     "--status-port", "-1")
    assert out.returncode == 2 and "state_dir" in out.stderr, out.stderr
    assert "more than the 255 a file name may have there" in out.stderr
    assert list(tmp_path.iterdir()) == []


def test_existing_runtime_directory_of_systemd_is_used_as_it_is(tmp_path):
    """systemd creates RuntimeDirectory before the start: it passes and is left alone."""
    rt = tmp_path / "run-slotsync"
    rt.mkdir(mode=0o750)
    rt.chmod(0o750)
    out = _slotsyncd("--check-config", "--status-port", "-1",
                     env=_env(RUNTIME_DIRECTORY=str(rt)))
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["runtime_dir"] == str(rt)
    cfg, _ = load_config(["--status-port", "-1", "--state-dir", str(tmp_path / "st")],
                         environ={"SLOTSYNC_RUNTIME_DIR": str(rt)})
    assert daemon_main.make_folders(cfg) is None
    assert (rt.stat().st_mode & 0o777) == 0o750  # not re-moded
    assert (tmp_path / "st").is_dir()  # the in-flight record's folder, made before binding


def test_start_refuses_a_folder_that_only_trying_shows_it_cannot_create(tmp_path, monkeypatch,
                                                                        capsys):
    """What ``validate`` cannot see without creating anything still ends in exit 2 naming
    the option, before anything is bound, not in a bare ``[Errno 2]``."""
    def makedirs(path, *a, **kw):
        raise FileNotFoundError(errno.ENOENT, "No such file or directory", str(path))

    monkeypatch.setattr(daemon_main.os, "makedirs", makedirs)
    monkeypatch.setattr(daemon_main, "serve", lambda _c: pytest.fail("serve() was reached"))
    with pytest.raises(SystemExit) as e:
        daemon_main.main(["--runtime-dir", str(tmp_path / "rt"), "--status-port", "-1"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"runtime_dir '{tmp_path}/rt': cannot create {tmp_path}/rt: [Errno 2] No such " in err
    assert "from --runtime-dir" in err


def test_filesystem_type_reads_the_deepest_mount(tmp_path):
    info = tmp_path / "mountinfo"
    info.write_text(
        "22 27 0:21 / /proc rw,relatime - proc proc rw\n"
        "27 1 254:0 / / rw,relatime - ext4 /dev/vda rw\n"
        "30 27 0:27 / /my\\040mnt rw,relatime shared:5 - tmpfs tmpfs rw\n"
        "31 27 0:28 / /my\\040mnt rw,relatime - xfs /dev/vdb rw\n"  # stacked: the last wins
    )
    assert filesystem_type("/proc/slotsync", str(info)) == "proc"
    assert filesystem_type("/proc", str(info)) == "proc"
    assert filesystem_type("/procfoo", str(info)) == "ext4"
    assert filesystem_type("/my mnt/a/b", str(info)) == "xfs"
    assert filesystem_type("/x", str(tmp_path / "none")) == ""


# ------------------------------------------------------------------ 3. a closed stdout


def test_check_config_into_a_closed_pipe_is_quiet():
    out = _into_closed_pipe([sys.executable, "-m", "slotsync.daemon", "--check-config",
                             "--status-port", "-1"])
    assert out.returncode == 0 and _quiet(out.stderr), out.stderr
    assert "configuration OK" in out.stderr


def test_check_config_piped_into_head_is_quiet():
    out = subprocess.run(f"'{sys.executable}' -m slotsync.daemon --check-config "
                         "--status-port -1 | head -c 10", shell=True, capture_output=True,
                         text=True, timeout=60, cwd=ROOT)
    assert out.stdout == '{\n  "runti' and _quiet(out.stderr), out.stderr


@pytest.mark.parametrize("argv", [["-m", "slotsync.daemon", "--help"],
                                  ["-m", "slotsync", "--help"],
                                  ["-m", "slotsync", "demo", "--help"]])
def test_help_into_a_closed_pipe_is_quiet(argv):
    out = _into_closed_pipe([sys.executable, *argv])  # (argparse ignores the closed pipe)
    assert out.returncode == 0 and _quiet(out.stderr), out.stderr


@pytest.mark.parametrize("json_flag", [[], ["--json"]])
def test_status_into_a_closed_pipe_is_quiet_and_keeps_its_exit_status(json_flag):
    doc = {"version": "0.1.0", "endpoint": "ipc:///x", "slots": [
        {"slot": [0, 2], "state": "failed", "ranks_expected": 2, "ranks_registered": [0, 1]}]}

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            self.send_response(200)
            self.end_headers()
            self.wfile.write(json.dumps(doc).encode())

        def log_message(self, *a):
            pass

    srv = HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        out = _into_closed_pipe([sys.executable, "-m", "slotsync", "status", "--url",
                                 f"http://127.0.0.1:{srv.server_port}", *json_flag])
    finally:
        srv.shutdown()
    assert out.returncode == 1 and _quiet(out.stderr), out.stderr  # 1: a slot failed


def test_demo_into_a_closed_pipe_stops_quietly():
    pytest.importorskip("torch")
    from slotsync.demo import find_default_model

    find_default_model()
    out = _into_closed_pipe([sys.executable, "-m", "slotsync", "demo", "--ranks", "1",
                             "--rounds", "1", "--device", "cpu"])
    assert out.returncode == 141 and _quiet(out.stderr), out.stderr
    assert "lost contact" not in out.stderr


# ------------------------------------------------------------------ 4. --gpus-per-engine


@pytest.mark.parametrize("n", ["0", "-2"])
def test_demo_refuses_gpus_per_engine_below_one(n):
    pytest.importorskip("torch")
    out = subprocess.run([sys.executable, "-m", "slotsync", "demo", "--gpus-per-engine", n],
                         capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert f"--gpus-per-engine must be >= 1, got {n}" in out.stderr


def test_demo_default_gpus_per_engine_is_all_ranks():
    from slotsync import demo

    assert demo.build_parser().parse_args([]).gpus_per_engine is None


# ------------------------------------------------------------------ 5. the memory estimate


def _meminfo(tmp_path: Path, available_kb: int | None) -> Path:
    f = tmp_path / "meminfo"
    lines = ["MemTotal:       24000000 kB", "MemFree:         1000000 kB"]
    if available_kb is not None:
        lines.append(f"MemAvailable:   {available_kb:8d} kB")
    f.write_text("\n".join([*lines, "Buffers:           10000 kB", ""]))
    return f


def test_mem_available_reads_meminfo(tmp_path, monkeypatch):
    from slotsync.demo import config as demo

    assert demo.mem_available(str(_meminfo(tmp_path, 22_000_000))) == 22_000_000 * 1024
    assert demo.mem_available(str(_meminfo(tmp_path, None))) is None  # old kernel: no line
    assert demo.mem_available(str(tmp_path / "missing")) is None  # not Linux: no check
    monkeypatch.setenv(demo.MEMINFO_ENV, str(_meminfo(tmp_path, 1234)))
    assert demo.mem_available() == 1234 * 1024


def test_memory_estimate_grows_per_rank_and_engine():
    from slotsync.demo import config as demo

    model = 90_868_376  # all-MiniLM-L6-v2
    one, two = demo.estimate_demo_memory(1, 1, model), demo.estimate_demo_memory(2, 1, model)
    per_rank = 2 * (demo.PROCESS_BASE_BYTES + demo.MODEL_COPIES_PER_PROCESS * model) + model
    assert two - one == int(per_rank) or abs(two - one - per_rank) <= 1
    assert demo.estimate_demo_memory(2, 2, model) - two == (demo.PROCESS_BASE_BYTES
                                                           + demo.RESOURCE_TRACKER_BYTES)
    # the measured peaks (0.96 GiB at --ranks 1, 5.2 GiB at --ranks 8) are not underestimated
    assert 0.96 * 2**30 <= one <= 1.3 * 2**30
    assert 5.2 * 2**30 <= demo.estimate_demo_memory(8, 1, model) <= 7 * 2**30
    # bigger models cost more per rank
    assert demo.estimate_demo_memory(4, 1, 10 * model) > demo.estimate_demo_memory(4, 1, model)


def test_memory_problem_against_fake_available_memory():
    from slotsync.demo import config as demo

    model = 90_868_376
    gb = 10**9
    assert demo.memory_problem(4, None, model, 22 * gb) is None
    assert demo.memory_problem(64, None, model, None) is None  # unknown: no check
    # --ranks 32 on the 24 GiB machine of the trial (22 GB free)
    why = demo.memory_problem(32, None, model, 22 * gb)
    assert why is not None and why.startswith("--ranks 32: the demo would need about ")
    need = demo.estimate_demo_memory(32, 1, model)
    assert f"{need / 1e9:.1f} GB" in why and "the 22.0 GB this machine has available" in why
    assert "more than 80%" in why and "--skip-memory-check" in why
    fit = int(why.split("use --ranks ")[1].split()[0])
    assert demo.memory_problem(fit, None, model, 22 * gb) is None
    assert demo.memory_problem(fit + 1, None, model, 22 * gb) is not None
    # with a slot size, the advice is a --ranks it divides
    why = demo.memory_problem(64, 4, model, 22 * gb)
    assert why is not None and int(why.split("use --ranks ")[1].split()[0]) % 4 == 0
    assert "16 engine servers" in why
    why = demo.memory_problem(2, None, model, 1 * gb)
    assert why is not None and "not even the smallest run fits" in why


def test_demo_ranks_64_refused_when_memory_is_short(tmp_path):
    pytest.importorskip("torch")
    from slotsync.demo import MEMINFO_ENV, find_default_model

    find_default_model()
    env = {**os.environ, MEMINFO_ENV: str(_meminfo(tmp_path, 8_000_000))}  # 8.2 GB
    out = subprocess.run([sys.executable, "-m", "slotsync", "demo", "--ranks", "64",
                          "--device", "cpu"], capture_output=True, text=True, timeout=60,
                         env=env, cwd=ROOT)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert "--ranks 64: the demo would need about" in out.stderr
    assert "of the 8.2 GB this machine has available (MemAvailable)" in out.stderr
    assert out.stdout == ""  # refused before anything started


def test_skip_memory_check_lets_the_demo_start(tmp_path, monkeypatch):
    pytest.importorskip("torch")
    from slotsync import demo

    demo.find_default_model()
    monkeypatch.setenv(demo.MEMINFO_ENV, str(_meminfo(tmp_path, 1_000_000)))
    started: list[int] = []
    monkeypatch.setattr(demo, "run_demo", lambda cfg: started.append(cfg.ranks) or 0)
    args = demo.build_parser().parse_args(["--ranks", "8", "--device", "cpu"])
    assert demo.main_from_args(args) == 2 and started == []
    args.skip_memory_check = True
    assert demo.main_from_args(args) == 0 and started == [8]
