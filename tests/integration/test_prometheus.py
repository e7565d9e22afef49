"""The daemon's metrics against Prometheus' own tools.

* ``promtool check rules`` / ``promtool test rules`` on ``deploy/prometheus/slotsync-alerts.yml``
  (each alert fires when it should, with the annotations it should);
* ``promtool check config`` on the example ``deploy/prometheus/prometheus.yml``;
* ``Metrics`` unit tests: the table gauges read a ``SlotTable`` at scrape time;
* ``promtool check metrics`` on a real daemon's ``/metrics`` after two real rounds (no
  warnings allowed), and a real Prometheus server on loopback scraping that daemon every second
  during the rounds, queried back through its HTTP API.

Tests needing ``promtool`` / ``prometheus`` skip with a reason when the tool is missing (CI
installs the Debian package ``prometheus``). The integration part needs torch (trainer ranks).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
from prometheus_client import generate_latest

from slotsync.daemon.core.coordinator import SlotState, Timeouts
from slotsync.daemon.families import SlotTable
from slotsync.daemon.service.metrics import Metrics
from slotsync.engine.launcher import free_port
from slotsync.protocol.wire import PROTOCOL_VERSION, Begin, Register

ROOT = Path(__file__).resolve().parents[2]
PROM_DIR = ROOT / "deploy" / "prometheus"
ALERTS = PROM_DIR / "slotsync-alerts.yml"


def _tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.skip(f"{name} not installed (Debian: apt-get install prometheus)")
    return path


def _run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60, **kw)


def _sample(text: str, name: str) -> float:
    """The value of the one sample line starting with ``name`` (name plus labels)."""
    (line,) = [ln for ln in text.splitlines() if ln.startswith(name + " ")]
    return float(line.rsplit(" ", 1)[1])


# ---------------------------------------------------------------------------- rules, config


def test_alert_rules_pass_promtool_check():
    r = _run([_tool("promtool"), "check", "rules", str(ALERTS)])
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SUCCESS: 8 rules found" in r.stdout


def test_alert_rules_fire_as_specified():
    # promtool resolves rule_files relative to the test file.
    r = _run([_tool("promtool"), "test", "rules", "slotsync-alerts.test.yml"], cwd=PROM_DIR)
    assert r.returncode == 0, r.stdout + r.stderr


def test_example_prometheus_config_is_valid():
    r = _run([_tool("promtool"), "check", "config", "prometheus.yml"], cwd=PROM_DIR)
    assert r.returncode == 0, r.stdout + r.stderr


def test_alert_rules_use_only_exported_metrics():
    """Every slotsync_* name in the rules is a metric the daemon exports (the peer-link
    series: a daemon with a peer link; the adapter series: a slot with an adapter)."""
    import re

    from slotsync.daemon.node_links.peer_state import LinkState

    m = Metrics("test")
    table = SlotTable(Timeouts(), "test")
    _register(table, 0, 0, 2, 0.0)
    (c,) = table.slots.values()
    c.status = lambda now=None: {"slot": [0, 2], "adapters": [  # (issue 36's entry)
        {"lora_name": "math", "version": 3, "served_name": "math@v3", "state": "served",
         "nbytes": 10, "loaded_at": 1.0, "error": None}]}
    m.watch(table)
    m.watch_peers(type("Peers", (), {"links": lambda self: [LinkState("node0", "relays")]})())
    exported = generate_latest(m.registry).decode()
    for name in set(re.findall(r"slotsync_[a-z_]+", ALERTS.read_text())):
        assert f"\n{name}" in exported or exported.startswith(name), name


def test_every_alert_the_docs_promise_is_a_rule():
    """An expression the docs tell operators to alert on ("Alert on `EXPR`") is the expr of a
    rule in slotsync-alerts.yml (docs/multi-node.md promised `slotsync_peer_link_up == 0`,
    which had none: issue 35 item 8)."""
    import re

    import yaml

    exprs = {r["expr"].strip() for g in yaml.safe_load(ALERTS.read_text())["groups"]
             for r in g["rules"]}
    promised = {m for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
                for m in re.findall(r"[Aa]lert\s+on\s+`([^`]+)`", doc.read_text())}
    assert "slotsync_peer_link_up == 0" in promised
    assert promised <= exprs, sorted(promised - exprs)


# ---------------------------------------------------------------------------- Metrics (unit)


def _register(table: SlotTable, rank: int, start: int, size: int, now: float) -> bytes:
    ident = f"rank{rank}".encode()
    table.on_message(
        ident,
        Register(PROTOCOL_VERSION, rank, f"00000000-0000-0000-0000-{rank:012d}", start, size,
                 f"http://e{start}:1", True, "shm", "host", 100 + rank),
        now,
    )
    return ident


def test_table_gauges_are_read_at_scrape_time(monkeypatch):
    m = Metrics("1.2.3")
    table = SlotTable(Timeouts(), "1.2.3")
    m.watch(table)
    text = generate_latest(m.registry).decode()
    assert _sample(text, "slotsync_ranks_expected") == 0
    assert _sample(text, 'slotsync_slots{state="idle"}') == 0

    now = 1000.0
    a = _register(table, 0, 0, 2, now)
    _register(table, 2, 2, 2, now)
    _register(table, 3, 2, 2, now)
    text = generate_latest(m.registry).decode()
    assert _sample(text, "slotsync_ranks_expected") == 4
    assert _sample(text, "slotsync_ranks_connected") == 3
    assert _sample(text, 'slotsync_slots{state="registering"}') == 1
    assert _sample(text, 'slotsync_slots{state="idle"}') == 1
    assert _sample(text, "slotsync_updates_in_flight") == 0
    assert _sample(text, "slotsync_update_in_flight_seconds") == 0

    _register(table, 1, 0, 2, now)
    table.on_message(a, Begin(0, "v1"), now)  # slot [0, 2) starts an update at t=1000
    monkeypatch.setattr("slotsync.daemon.service.metrics.time.monotonic", lambda: now + 42.5)
    text = generate_latest(m.registry).decode()
    assert _sample(text, 'slotsync_slots{state="updating"}') == 1
    assert _sample(text, "slotsync_updates_in_flight") == 1
    assert _sample(text, "slotsync_update_in_flight_seconds") == 42.5
    assert sum(_sample(text, f'slotsync_slots{{state="{s.value}"}}') for s in SlotState) == 2


def test_update_ended_and_build_info():
    from slotsync.daemon.core.coordinator import UpdateEnded

    m = Metrics("1.2.3")
    m.update_ended(UpdateEnded((0, 2), "http://e:1", 0, "v1", "success", 1.5, 3, 1000))
    m.update_ended(UpdateEnded((0, 2), "http://e:1", 1, "v2", "failed", 400.0, 1, 10, "boom"))
    m.observe_request("update_weights", 0.2, ok=False)
    text = generate_latest(m.registry).decode()
    assert _sample(text, 'slotsync_updates_total{outcome="success"}') == 1
    assert _sample(text, 'slotsync_updates_total{outcome="failed"}') == 1
    assert _sample(text, "slotsync_chunks_total") == 4
    assert _sample(text, "slotsync_tensor_bytes_total") == 1010
    assert _sample(text, 'slotsync_update_duration_seconds_bucket{le="300.0"}') == 1
    assert _sample(text, 'slotsync_update_duration_seconds_bucket{le="+Inf"}') == 2
    assert _sample(text, 'slotsync_vllm_request_errors_total{route="update_weights"}') == 1
    assert _sample(text, "slotsync_update_last_success_timestamp_seconds") > 1.6e9
    (info,) = [ln for ln in text.splitlines() if ln.startswith("slotsync_build_info{")]
    assert 'version="1.2.3"' in info and "python=" in info
    assert "_created" not in text  # no *_created series


# ---------------------------------------------------------------------------- real daemon


def _get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=5) as r:
        return json.loads(r.read())


class PrometheusServer:
    """A real ``prometheus`` on loopback scraping ``target`` every second, storage in ``dir``."""

    def __init__(self, binary: str, target: str, dir: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cfg = dir / "prometheus.yml"
        cfg.write_text(
            "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
            "scrape_configs:\n"
            "  - job_name: slotsync\n"
            f"    static_configs: [{{targets: ['{target}']}}]\n"
        )
        self.log = open(dir / "prometheus.log", "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [binary, f"--config.file={cfg}", f"--storage.tsdb.path={dir / 'data'}",
             f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"],
            stdout=self.log, stderr=subprocess.STDOUT,
        )

    def wait_ready(self, timeout_s: float = 20.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"prometheus exited: {self.log_tail()}"
            try:
                with urllib.request.urlopen(self.url + "/-/ready", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.2)
        raise AssertionError(f"prometheus not ready in {timeout_s} s: {self.log_tail()}")

    def query(self, expr: str) -> list[dict]:
        body = _get_json(self.url + "/api/v1/query?" + urllib.parse.urlencode({"query": expr}))
        assert body["status"] == "success", body
        return body["data"]["result"]

    def log_tail(self) -> str:
        self.log.flush()
        return Path(self.log.name).read_bytes()[-3000:].decode(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


@pytest.fixture(scope="module")
def scraped_round(tmp_path_factory):
    """A daemon that ran two real rounds (2 ranks, reference engine) while a real Prometheus
    scraped it every second. Yields ``(daemon, prometheus)``; Prometheus is None without the
    binary (the promtool test still runs)."""
    if not (shutil.which("promtool") or shutil.which("prometheus")):
        pytest.skip("neither promtool nor prometheus installed (Debian: apt-get install "
                    "prometheus)")
    pytest.importorskip("torch")
    from spawned_ranks import rounds, run_ranks

    from slotsync.daemon.launcher import DaemonProcess
    from slotsync.engine.launcher import ReferenceEngine

    binary = shutil.which("prometheus")
    tmp = tmp_path_factory.mktemp("prometheus")
    with ReferenceEngine(workers=2, device="cpu") as engine, DaemonProcess() as daemon:
        prom = None
        if binary is not None:
            prom = PrometheusServer(binary, f"127.0.0.1:{daemon.status_port}", tmp)
        try:
            if prom is not None:
                prom.wait_ready()
            ev = run_ranks(daemon, engine.url, True, [{"rounds": 2}, {"rounds": 2}])
            for r in range(2):
                assert [e["status"] for e in rounds(ev, r)] == ["ok", "ok"], ev
            yield daemon, prom
        finally:
            if prom is not None:
                prom.stop()


@pytest.mark.slow
def test_promtool_check_metrics_on_real_daemon_after_rounds(scraped_round):
    daemon, _ = scraped_round
    text = daemon.metrics()
    assert 'slotsync_updates_total{outcome="success"} 2.0' in text
    r = _run([_tool("promtool"), "check", "metrics"], input=text)
    # promtool prints lint problems ("... counter metrics should have "_total" suffix") and
    # exits 1; clean means no output at all.
    assert r.returncode == 0 and not (r.stdout + r.stderr).strip(), r.stdout + r.stderr


@pytest.mark.slow
def test_prometheus_scrapes_the_rounds(scraped_round):
    _tool("prometheus")
    _, prom = scraped_round
    assert prom is not None
    deadline = time.monotonic() + 15  # a few 1 s scrapes after the rounds ended
    value = None
    while time.monotonic() < deadline:
        result = prom.query('slotsync_updates_total{job="slotsync",outcome="success"}')
        if result:
            value = float(result[0]["value"][1])
            if value >= 2:
                break
        time.sleep(0.5)
    assert value == 2, f"slotsync_updates_total{{outcome=success}} = {value}: {prom.log_tail()}"
    (up,) = prom.query('up{job="slotsync"}')
    assert up["value"][1] == "1"
    # The scrape saw the metrics Prometheus-style: histogram buckets up to 300 s, build info.
    assert prom.query('slotsync_update_duration_seconds_bucket{le="300.0"}')
    assert prom.query("slotsync_build_info")
