"""The docs agree with the repository and with each other where a reader copies from them
(issue 35 item 9): every ``deploy/``, ``scripts/`` or ``tools/`` path they name exists (they
named ``deploy/k8s/``), every ``SlotTopology(...)`` they write is one the code accepts (the
TP=16 engine over two nodes was refused), the pages on engines over several nodes name one
key folder, ``deploy/slotsyncd.toml``'s, and drive the engine on a loopback URL, as
configuration.md advises for vLLM's dev-mode routes."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from slotsync.protocol.topology import SlotTopology

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
PATH = re.compile(r"(?<![\w/.-])((?:deploy|scripts|tools)/[\w./-]*)")
TOPOLOGY = re.compile(r"SlotTopology\(([^()]*)\)")
TOML_FENCE = re.compile(r"^```toml\n(.*?)^```", re.S | re.M)


def _rel(p: Path) -> str:
    return str(p.relative_to(ROOT))


def test_every_repository_path_the_docs_name_exists() -> None:
    missing = [f"{_rel(doc)}: {m.rstrip('.')}" for doc in DOCS
               for m in PATH.findall(doc.read_text())
               if not (ROOT / m.rstrip(".")).exists()]
    assert not missing, "paths the docs name that do not exist:\n" + "\n".join(missing)


def test_every_slot_topology_the_docs_write_is_accepted() -> None:
    written = [(doc, m) for doc in DOCS for m in TOPOLOGY.findall(doc.read_text())
               if "=" in m and "..." not in m]
    assert any("gpus_per_engine=16" in m for _, m in written), "multi-node.md's TP=16 engine"
    for doc, args in written:
        topo = eval(f"SlotTopology({args})", {"SlotTopology": SlotTopology})  # noqa: S307
        assert topo.slots, f"{_rel(doc)}: SlotTopology({args})"


def _tables() -> list[tuple[Path, dict]]:
    """Every TOML block of the pages on engines over several nodes that parses alone."""
    out = []
    for doc in DOCS:
        for block in TOML_FENCE.findall(doc.read_text()):
            try:
                out.append((doc, tomllib.loads(block)))
            except tomllib.TOMLDecodeError:
                continue
    return out


def test_the_docs_name_the_key_folders_of_deploy_slotsyncd_toml() -> None:
    """One place for the keys, as deploy/slotsyncd.toml and operations.md install them (the
    Kubernetes page mounts its Secret elsewhere, as deploy/kubernetes/ does)."""
    example = (ROOT / "deploy" / "slotsyncd.toml").read_text()
    public = re.search(r'^# peer_public_keys = "([^"]+)"', example, re.M).group(1)
    secret_dir = Path(re.search(r'^# curve_secret_key = "([^"]+)"', example, re.M).group(1)
                      ).parent
    seen = 0
    for doc, table in _tables():
        if doc.name == "deploy-kubernetes.md" or "peer_public_keys" not in table:
            continue
        seen += 1
        assert table["peer_public_keys"] == public, _rel(doc)
        assert Path(table["curve_secret_key"]).parent == secret_dir, _rel(doc)
    assert seen >= 2  # (multi-node.md's and configuration.md's)
    for doc in DOCS:
        assert "/etc/slotsync/peers" not in doc.read_text(), _rel(doc)


def test_engines_over_several_nodes_are_driven_on_a_loopback_url() -> None:
    """The owner's daemon, beside the API server, is the only caller: the table's URL is a
    loopback one and multi-node.md's owner node serves vLLM there (--host 127.0.0.1), and the
    trainer names the same URL."""
    urls = {_rel(doc): e["url"] for doc, t in _tables() for e in t.get("engines", [])
            if "owner" in e}
    assert urls and all(u.startswith(("http://127.0.0.1:", "http://localhost:"))
                        for u in urls.values()), urls
    page = (ROOT / "docs" / "multi-node.md").read_text()
    serve = re.search(r"vllm serve .*?--node-rank 0 .*?--port (\d+)", page, re.S)
    assert serve and "--host 127.0.0.1" in serve.group(0), serve
    assert f'HTTPVLLMWeightSyncClient("http://127.0.0.1:{serve.group(1)}")' in page
