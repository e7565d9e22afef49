"""``tools/vllm_shim.py`` and ``--receive vllm`` on CPU: the GPU machine's code path.

The shim (vLLM's own ``base.py`` / ``ipc_engine.py`` / ``packed_tensor.py`` plus stand-ins for
what they import) is built from the installed vllm into ``tmp_path`` and put first on the
engine workers' ``sys.path`` (``SLOTSYNC_VLLM_SHIM``), shadowing the installed vllm; the
reference engine then loads every update through the shim's ``IPCWeightTransferEngine``
(``parse_update_info``, ``receive_weights``, ``PackedBufferImporter``) with the CPU stand-ins
of ``slotsync.engine.cuda_standin``.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("the shim is built from an installed vllm", allow_module_level=True)
torch = pytest.importorskip("torch")

from shm_payloads import Segments, packed_info, sample_tensors, unpacked_info  # noqa: E402

from slotsync.engine.checksum import tensor_checksum  # noqa: E402
from slotsync.engine.launcher import ReferenceEngine  # noqa: E402
from slotsync.engine.reference.vllm_receive import SHIM_ENV, receive_env  # noqa: E402
from slotsync.protocol.wire import ShmHandle  # noqa: E402

pytestmark = pytest.mark.vllm
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def shim(tmp_path_factory: pytest.TempPathFactory) -> Path:
    dest = tmp_path_factory.mktemp("shim")
    out = subprocess.run([sys.executable, str(ROOT / "tools" / "vllm_shim.py"), str(dest)],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    assert "checked:" in out.stdout
    return dest


def test_shim_holds_vllms_files_unchanged(shim: Path) -> None:
    src = Path(importlib.util.find_spec("vllm").submodule_search_locations[0])  # type: ignore
    for name in ("base.py", "ipc_engine.py", "packed_tensor.py", "clients.py"):
        copied = shim / "vllm" / "distributed" / "weight_transfer" / name
        assert copied.read_bytes() == (src / "distributed" / "weight_transfer" / name
                                       ).read_bytes()
    assert receive_env(shim) is not None


def test_receive_vllm_through_the_shim(shim: Path, segs: Segments) -> None:
    """Unpacked and packed (one buffer per worker, overwritten between chunks: vLLM's importer
    keeps the aliasing mapping) rounds land; vLLM's own errors come back."""
    with ReferenceEngine(workers=2, receive="vllm", env={SHIM_ENV: str(shim)},
                         startup_timeout_s=120) as eng:
        s = eng.request("GET", "/_slotsync/stats")[1]
        assert all(w["receive"] == "vllm" and w["vllm_file"].startswith(str(shim))
                   for w in s["workers"])
        tensors = sample_tensors(4)
        assert eng.request("POST", "/init_weight_transfer_engine", {"init_info": {}})[0] == 200
        assert eng.request("POST", "/start_weight_update")[0] == 200
        info = unpacked_info(tensors, eng.gpu_uuids, segs)
        assert eng.request("POST", "/update_weights", {"update_info": info})[0] == 200
        assert eng.request("POST", "/finish_weight_update")[0] == 200
        want = {n: tensor_checksum(t) for n, t in tensors.items()}
        sums = eng.request("POST", "/weight_checker", {"action": "checksum"})[1]["checksums"]
        assert all(sums[u] == want for u in eng.gpu_uuids)

        assert eng.request("POST", "/init_weight_transfer_engine",
                           {"init_info": {"packed": True}})[0] == 200
        bufs = {u: segs.put(b"", size=4096) for u in eng.gpu_uuids}
        by_uuid = {u: ShmHandle(segment=b.name, offset=0, nbytes=4096) for u, b in bufs.items()}
        new = sample_tensors(5)
        items = list(new.items())
        assert eng.request("POST", "/start_weight_update")[0] == 200
        for chunk in (dict(items[:2]), dict(items[2:])):
            data = b"".join(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
                            for t in chunk.values())
            for b in bufs.values():
                b.buf[: len(data)] = data
            status, body = eng.request("POST", "/update_weights",
                                       {"update_info": packed_info(chunk, by_uuid)})
            assert status == 200, body
        assert eng.request("POST", "/finish_weight_update", {"weight_version": "s"})[0] == 200
        want = {n: tensor_checksum(t) for n, t in new.items()}
        sums = eng.request("POST", "/weight_checker", {"action": "checksum"})[1]["checksums"]
        assert all(sums[u] == want for u in eng.gpu_uuids)
        assert [w["packed_maps"] for w in eng.request("GET", "/_slotsync/stats")[1]["workers"]
                ] == [1, 1]  # one export per worker, mapped once and reused
        # vLLM's own checks, through the shim
        assert eng.request("POST", "/start_weight_update")[0] == 200
        status, body = eng.request("POST", "/update_weights", {"update_info": info})
        assert status == 500 and "`tensor_sizes` is required when packed=True" in \
            body["error"]["message"]


def test_receive_vllm_without_ipc_engine_fails_loudly(tmp_path: Path) -> None:
    fake = tmp_path / "vllm"
    fake.mkdir()
    (fake / "__init__.py").write_text("")
    out = subprocess.run(
        [sys.executable, "-m", "slotsync.engine", "--receive", "vllm", "--port", "0"],
        capture_output=True, text=True, timeout=120, env={**os.environ, SHIM_ENV: str(tmp_path)})
    assert out.returncode == 2
    assert "--receive vllm needs vllm.distributed.weight_transfer.ipc_engine" in out.stderr
