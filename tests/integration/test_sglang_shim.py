"""``tools/sglang_shim.py`` on CPU: the SGLang code the GPU machine's engine imports (issue 26 E).

The shim is built from the installed sglang (0.5.23, ``scripts/test``) into ``tmp_path``; its
own check (a fresh interpreter, ``PYTHONPATH`` = the shim: every ``sglang`` module from the
shim; slotsync's packed, unpacked and empty pickles through SGLang's normalization,
``SafeUnpickler``, ``_rebuild_cuda_tensor_modified`` and ``FlattenedTensorBucket``) must pass;
the copied files (``patch_torch.py``, ``tensor_bucket.py``, and the engine front's
``msgspec_utils.py`` and ``auth.py``, and ``tp_worker.py``, read for its source only) are
byte-identical, and every segment of the extracted
``common.py`` is the real file's lines at the range its header names.
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _tool() -> ModuleType:
    spec = importlib.util.spec_from_file_location("sglang_shim", ROOT / "tools" / "sglang_shim.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.sglang
def test_shim_is_sglangs_code_and_loads_slotsyncs_pickles(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, str(ROOT / "tools" / "sglang_shim.py"), str(tmp_path)],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    assert "checked:" in out.stdout and str(tmp_path) in out.stdout
    src = Path(importlib.util.find_spec("sglang").submodule_search_locations[0])  # type: ignore
    for rel in (*_tool().COPIED, *_tool().SOURCE_ONLY):
        assert (tmp_path / "sglang" / rel).read_bytes() == (src / rel).read_bytes(), rel
    assert "LoRA receive methods compile" in out.stdout  # (issue 36: lora_code.receive)
    assert "--enable-lora code" in out.stdout  # (issue 36: the engine's LoRA routes)
    real = (src / "srt" / "utils" / "common.py").read_text().splitlines(keepends=True)
    shim = (tmp_path / "sglang" / "srt" / "utils" / "common.py").read_text()
    segments = re.split(r"\n\n# common\.py L(\d+)-(\d+)\n", shim)[1:]
    ranges = list(zip(segments[0::3], segments[1::3], segments[2::3], strict=True))
    defined = set()
    for start, end, text in ranges:
        assert text.rstrip("\n") == "".join(real[int(start) - 1:int(end)]).rstrip("\n"), start
        defined |= {a or b for a, b in re.findall(r"^(?:class|def) (\w+)|^(\w+) = ", text,
                                                  re.M)}
    for name in ("SafeUnpickler", "MultiprocessingSerializer", "_looks_like_pickle_payload",
                 "normalize_serialized_named_tensor_payload", "is_npu", "is_musa",
                 "torch_release"):
        assert name in defined, name


def test_extraction_refuses_a_name_defined_nowhere() -> None:
    tool = _tool()
    src = ("from __future__ import annotations\nimport io\n\n"
           "def f(x):\n    return io.BytesIO(helper(x))\n\n"
           "def helper(x):\n    return bytes(x)\n\n"
           "def g():\n    return missing_thing()\n")
    text = tool.extract(src, ["f"], "fake.py")
    assert "import io\n" in text and "def helper" in text and "def g" not in text
    with pytest.raises(ValueError, match="'missing_thing' is referenced but defined nowhere"):
        tool.extract(src, ["g"], "fake.py")
    with pytest.raises(ValueError, match="lacks 'from __future__ import annotations'"):
        tool.extract("def f():\n    pass\n", ["f"], "fake.py")
