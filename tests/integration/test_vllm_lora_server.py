"""The real vLLM server on the CPU (issue 36 C): ``python -m vllm.entrypoints.openai.api_server
--enable-lora`` (dev mode, ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1``) serving a tiny random Llama
saved by the test (no download), driven through the daemon's own ``VllmClient`` routes and
``daemon/vllm/adapters.py``:

* ``/server_info`` gives the LoRA limits; ``/v1/models`` lists what was loaded;
* folders written by ``write_adapter_folder`` from two ranks' parts load
  (``/v1/load_lora_adapter``), and generation with each version (vLLM's token-in/token-out
  ``/inference/v1/generate``, greedy) gives exactly the tokens of a reference computed here:
  the same Llama in ``transformers`` with the adapter merged into its weights; two versions
  give different tokens, and differ from the base model;
* unload takes a version off the list (a request naming it: 404);
* ``--max-cpu-loras 2``: an evicted adapter still listed is read again from its folder by
  the next request of it (same tokens); one whose folder is gone kills the engine at the
  next request of it -- why the daemon keeps folders while an engine may re-read them.

About 90 s to start on a loaded 2-core machine. vLLM's CPU attention takes head sizes 32,
64, ... (``tests/lora_plans.py`` ``TINY_LLAMA``); with 16 the first step kills the engine.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("vllm.entrypoints.openai.api_server")

from lora_plans import TINY_LLAMA, lora_tensors, peft_config, reader, split_plan  # noqa: E402

from slotsync.daemon.vllm import adapters  # noqa: E402
from slotsync.daemon.vllm.client import VllmClient  # noqa: E402
from slotsync.testing.ports import free_port  # noqa: E402
from slotsync.testing.processes import die_with_parent  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

PROMPT = [1, 2, 3]
NEW_TOKENS = 6
R, ALPHA = 8, 16


def _model(folder: Path) -> None:
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY_LLAMA))
    model.to(torch.float32).save_pretrained(folder, safe_serialization=True)


def _adapter(version: int) -> dict[str, torch.Tensor]:
    """Version ``version``'s tensors, large enough to change greedy tokens."""
    return {k: v * 5 for k, v in lora_tensors(r=R, seed=100 + version,
                                              dtype=torch.float32).items()}


def _reference_tokens(folder: Path, tensors: dict[str, torch.Tensor] | None) -> list[int]:
    """Greedy tokens of the Llama in ``transformers``, the adapter merged into its weights
    (W + alpha / r * B A, PEFT's LoRA)."""
    model = transformers.LlamaForCausalLM.from_pretrained(folder, torch_dtype=torch.float32)
    state = model.state_dict()
    with torch.no_grad():
        for name, a in (tensors or {}).items():
            if name.endswith("lora_A.weight"):
                module = name.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
                b = tensors[name.replace("lora_A", "lora_B")]
                state[module + ".weight"] += (ALPHA / R) * b @ a
        model.load_state_dict(state)
        ids = list(PROMPT)
        for _ in range(NEW_TOKENS):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(PROMPT):]


class Server:
    """One ``vllm.entrypoints.openai.api_server`` process (its own process group)."""

    def __init__(self, model: Path, log: Path, tmp: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        tmp.mkdir()
        # (TMPDIR: vLLM leaves its ZMQ IPC sockets and vllm_dist_* folders there, also after
        # a clean exit; in the test's own folder they go with it)
        env = {**os.environ, "TMPDIR": str(tmp), "VLLM_SERVER_DEV_MODE": "1",
               "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1", "VLLM_CPU_KVCACHE_SPACE": "1",
               "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model",
                 str(model), "--host", "127.0.0.1", "--port", str(self.port),
                 "--enable-lora", "--max-lora-rank", str(R), "--max-loras", "2",
                 "--max-cpu-loras", "2", "--max-model-len", "128", "--skip-tokenizer-init",
                 "--dtype", "float32", "--enforce-eager", "--enable-scale-out"],
                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                start_new_session=True, preexec_fn=die_with_parent)

    def wait_ready(self, timeout_s: float = 420.0) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            assert self.proc.poll() is None, f"vLLM exited:\n{self.tail()}"
            try:
                with urllib.request.urlopen(self.url + "/v1/models", timeout=5) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            assert time.monotonic() < deadline, f"vLLM did not start:\n{self.tail()}"
            time.sleep(1)

    def tail(self, n: int = 6000) -> str:
        return self.log.read_text(errors="replace")[-n:]

    def generate(self, model: str) -> tuple[int, object]:
        body = {"model": model, "token_ids": PROMPT, "sampling_params": {
            "max_tokens": NEW_TOKENS, "temperature": 0, "detokenize": False}}
        req = urllib.request.Request(self.url + "/inference/v1/generate",
                                     json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=300) as r:
                return r.status, json.loads(r.read())["choices"][0]["token_ids"]
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read() or b"null")

    def wait_exit(self, timeout_s: float = 120.0) -> int:
        deadline = time.monotonic() + timeout_s
        while self.proc.poll() is None:
            assert time.monotonic() < deadline, "vLLM did not exit"
            time.sleep(0.5)
        return self.proc.returncode

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        try:  # (its engine core and worker, in its group, once it is gone)
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.fixture
def server(tmp_path: Path) -> Iterator[tuple[Server, Path]]:
    model = tmp_path / "model"
    _model(model)
    # (a short TMPDIR: vLLM's ZMQ IPC socket paths must fit sockaddr_un's 107 characters,
    # which pytest's base temp folder under CI's own temp folder does not leave room for)
    short = Path(tempfile.mkdtemp(prefix="vl-", dir="/tmp"))
    s = Server(model, tmp_path / "vllm.log", short / "t")
    try:
        s.wait_ready()
        yield s, model
    finally:
        s.stop()
        shutil.rmtree(short, ignore_errors=True)


async def test_real_vllm_loads_serves_and_unloads_the_daemons_folders(server,
                                                                     tmp_path: Path) -> None:
    s, model = server
    root = tmp_path / "adapters"
    root.mkdir()
    client = VllmClient(s.url, timeout_s=300)
    try:
        limits = adapters.lora_limits(await client.call("server_info"))
        assert limits.enabled and limits.max_lora_rank == R, limits
        assert adapters.served_adapters(await client.call("models")) == set()

        tensors, names = {}, {}
        for v in (1, 2, 3, 4):
            tensors[v] = _adapter(v)
            plan, buffers, _ = split_plan(tensors[v], peft_config(r=R, alpha=ALPHA),
                                          lora_name="math", version=v, ranks=2)
            assert all(len(t.parts) == 2 for t in plan.tensors)
            names[v] = plan.served_name
            adapters.write_adapter_folder(root, plan, reader(buffers))
        for v in (1, 2):
            await client.call("load_lora_adapter",
                              adapters.load_body(names[v], root / names[v]))
        assert adapters.served_adapters(await client.call("models")) == {names[1], names[2]}

        want = {v: _reference_tokens(model, tensors[v]) for v in (1, 2)}
        base = _reference_tokens(model, None)
        assert s.generate(str(model)) == (200, base)
        assert s.generate(names[1]) == (200, want[1])
        assert s.generate(names[2]) == (200, want[2])
        assert len({tuple(base), tuple(want[1]), tuple(want[2])}) == 3

        await client.call("unload_lora_adapter", adapters.unload_body(names[1]))
        assert adapters.served_adapters(await client.call("models")) == {names[2]}
        status, body = s.generate(names[1])
        assert status == 404 and "does not exist" in json.dumps(body), body

        # the workers' cache holds 2: loading v3 then v4 evicts v1 (unloaded, still cached)
        # then v2, which stays listed; a request of v2 reads its folder again (evicting v3)
        for v in (3, 4):
            await client.call("load_lora_adapter",
                              adapters.load_body(names[v], root / names[v]))
        assert s.generate(names[2]) == (200, want[2])
        shutil.rmtree(root / names[3])
        status, body = s.generate(names[3])
        assert status == 500, body
        assert s.wait_exit() is not None
        assert f"No adapter found for {root / names[3]}" in s.tail(200_000)
    finally:
        await client.close()
