"""``slotsync demo --lora``'s parts (issue 36 E; ``slotsync.demo.lora``): the adapter's layouts
over the ranks tile every tensor exactly, SGLang's never split one, the names are PEFT's as
``publish_adapter`` takes them, the Llama it makes has the modules the adapter targets, the
engine-side check fails on each way an engine can differ from the trainer, and the options it
cannot run with are refused before anything starts. The runs themselves:
``tests/integration/test_demo_lora.py``."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from slotsync.demo import build_parser, lora, main_from_args  # noqa: E402
from slotsync.engine.checksum import tensor_checksum  # noqa: E402
from slotsync.protocol.rank.adapters.inputs import peft_name_problem  # noqa: E402

SHAPES = {f"model.layers.{i}.self_attn.{p}": s for i in range(2)
          for p, s in (("q_proj", (8, 8)), ("k_proj", (4, 8)), ("v_proj", (4, 8)),
                       ("o_proj", (8, 8)))}


@pytest.mark.parametrize("ranks", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("layout", ["rows", "one", "spread"])
def test_the_ranks_parts_tile_every_tensor_once(layout, ranks):
    tensors = lora.adapter_tensors(SHAPES, 1, r=4)
    parts = [lora.rank_part(tensors, layout, i, ranks) for i in range(ranks)]
    for name, whole in tensors.items():
        pieces = sorted((rows.get(name, (0, None))[0], part[name])
                        for part, rows in parts if name in part)
        assert pieces, name
        assert torch.equal(torch.cat([p for _, p in pieces]), whole), (name, layout)
        starts = [a for a, _ in pieces]
        assert starts == sorted(set(starts))  # (no two parts from the same row)
        if layout != "rows" or ranks > whole.shape[0]:
            assert len(pieces) == 1  # whole on one rank
    if layout == "one":
        assert all(not part for part, _ in parts[1:])
    if layout == "spread" and ranks > 1:
        assert sum(1 for part, _ in parts if part) == min(ranks, len(tensors))


def test_sglang_rounds_never_split_a_tensor_and_vllm_rounds_do():
    """SGLang refuses a tensor split over ranks (daemon/sglang/adapters.py ``refusal``); the
    vLLM-style engines get row shards in round 1 and one holder in round 2."""
    assert {lora.round_layout("sglang", k, 2) for k in range(1, 5)} == {"one", "spread"}
    assert [lora.round_layout(e, k, 2) for e in ("reference", "vllm") for k in (1, 2)] == [
        "rows", "one"] * 2
    assert {lora.round_layout(e, k, 1) for e in ("reference", "sglang") for k in (1, 2)} == {
        "one"}


def test_the_adapter_is_peft_named_and_differs_per_version():
    one, two = lora.adapter_tensors(SHAPES, 1), lora.adapter_tensors(SHAPES, 2)
    assert len(one) == 2 * len(SHAPES)
    assert all(peft_name_problem(n) == "" for n in one)
    name = "base_model.model.model.layers.1.self_attn.k_proj"
    assert one[f"{name}.lora_A.weight"].shape == (lora.LORA_RANK, 8)
    assert one[f"{name}.lora_B.weight"].shape == (4, lora.LORA_RANK)
    assert all(not torch.equal(one[n], two[n]) for n in one)
    assert all(torch.equal(one[n], t) for n, t in lora.adapter_tensors(SHAPES, 1).items())


def test_the_llama_it_makes_has_the_adapters_modules(tmp_path):
    from safetensors.torch import load_file

    path = lora.make_llama(tmp_path / "llama.safetensors")
    shapes = lora.attention_shapes(path)
    cfg = lora.LLAMA
    h, kv = cfg["hidden_size"], cfg["num_key_value_heads"] * 64
    assert len(shapes) == 4 * cfg["num_hidden_layers"]
    assert shapes["model.layers.0.self_attn.q_proj"] == (h, h)
    assert shapes["model.layers.3.self_attn.v_proj"] == (kv, h)
    weights = load_file(str(path))
    assert sum(t.numel() * t.element_size() for t in weights.values()) == lora.llama_bytes()
    assert lora.model_problem(path) is None


class _Engine:
    """``GET /_slotsync/lora`` answers in the reference / vLLM-code engines' shape
    (``sglang=False``) or the SGLang engine's."""

    def __init__(self, held: dict[str, list[dict[str, str] | None]], sglang: bool) -> None:
        self.held, self.sglang = held, sglang

    def request(self, method, path, body=None):
        assert (method, path) == ("GET", "/_slotsync/lora")
        if self.sglang:
            ranks: dict[str, dict] = {}
            for name, per in self.held.items():
                for i, sums in enumerate(per):
                    ranks.setdefault(f"tp{i}", {})
                    if sums is not None:
                        ranks[f"tp{i}"][name] = sums
            return 200, {"adapters": sorted(self.held), "ranks": ranks}
        ids = {name: k for k, name in enumerate(self.held, start=1)}
        workers = [{"index": i, "loaded": {str(ids[n]): {"checksums": per[i]}
                                           for n, per in self.held.items()
                                           if per[i] is not None}}
                   for i in range(len(next(iter(self.held.values()))))]
        return 200, {"adapters": [{"lora_name": n, "lora_int_id": k}
                                  for n, k in ids.items()], "workers": workers}


@pytest.mark.parametrize("sglang", [False, True], ids=["vllm-shape", "sglang-shape"])
def test_the_check_fails_on_every_way_an_engine_can_differ(sglang):
    tensors = lora.adapter_tensors(SHAPES, 3)
    want = {n: tensor_checksum(t) for n, t in tensors.items()}
    name = next(iter(want))
    stale = {**want, name: tensor_checksum(tensors[name] + 1)}

    def check(held, previous=None):
        return lora.verify_adapter(_Engine(held, sglang), "demo@v3", want, previous, 2, 0.2)

    ok, line = check({"demo@v3": [want, want]}, "demo@v2")
    assert ok and "checksums equal on 2 workers" in line and "demo@v2 unloaded" in line
    ok, line = check({"demo@v3": [want, stale]})
    assert not ok and "1 tensors differ" in line and name in line
    ok, line = check({"demo@v3": [want, {n: h for n, h in want.items() if n != name}]})
    assert not ok and "1 tensors differ" in line  # (a tensor missing)
    ok, line = check({"demo@v3": [want, None]})
    assert not ok and "1 of 2 workers hold demo@v3" in line
    ok, line = check({"demo@v2": [want, want]}, "demo@v2")
    assert not ok and "demo@v3 is not served" in line and "demo@v2 still served" in line
    ok, line = check({"demo@v2": [want, want], "demo@v3": [want, want]}, "demo@v2")
    assert not ok and "demo@v2 still served" in line


@pytest.mark.parametrize("args,text", [
    (["--nodes", "2", "--ranks", "2"], "--lora --nodes 2: the daemon refuses adapter rounds"),
    (["--backend", "vllm-api"], "--lora publishes with slotsync's Publisher"),
    (["--model", "README.md"], "not a safetensors file"),
])
def test_options_it_cannot_run_with_are_refused_before_anything_starts(args, text, capsys,
                                                                         monkeypatch):
    from slotsync import demo

    monkeypatch.setattr(demo, "run_demo", lambda *a, **k: pytest.fail("the demo started"))
    assert main_from_args(build_parser().parse_args(["--lora", *args])) == 2
    err = capsys.readouterr().err
    assert text in err and "Traceback" not in err


def test_a_model_without_llama_projections_is_refused(tmp_path, capsys, monkeypatch):
    """``--lora --model`` of a model the adapter's modules are not in (all-MiniLM-L6-v2's
    BERT names, say) is refused naming what is missing and what to do."""
    from safetensors.torch import save_file

    from slotsync import demo

    path = tmp_path / "bert.safetensors"
    save_file({"encoder.layer.0.attention.self.query.weight": torch.zeros(4, 4)}, str(path))
    monkeypatch.setattr(demo, "run_demo", lambda *a, **k: pytest.fail("the demo started"))
    assert main_from_args(build_parser().parse_args(["--lora", "--model", str(path)])) == 2
    err = capsys.readouterr().err
    assert "no Llama-named attention projections" in err and "leave out --model" in err
