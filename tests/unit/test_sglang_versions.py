"""SGLang versions, layouts and the engine table's kind (issue 26): which releases the daemon
speaks, what it refuses before the pause, and the TOML keys ``kind`` and ``pause_mode``."""

from __future__ import annotations

from pathlib import Path

import pytest

from slotsync.daemon.service.config import Config, ConfigError, read_config_file
from slotsync.daemon.sglang import versions as sv
from slotsync.daemon.sglang.routes import Dialect, NotAnSglangStep, plan

DOCS = Path(__file__).resolve().parents[2] / "docs"


@pytest.mark.parametrize(("text", "base"), [
    ("0.5.23", "0.5.23"), ("0.5.23.post1", "0.5.23"), ("0.5.21+cu130", "0.5.21"),
    (" 0.5.20 ", "0.5.20"), ("0.5", None), ("dev", None), (None, None), (523, None)])
def test_parse(text, base):
    assert sv.parse(text) == base


def test_only_the_releases_read_are_supported_and_the_refusal_names_them():
    for v in ("0.5.20", "0.5.21", "0.5.23", "0.5.23.post2"):
        assert sv.check_supported(v, "http://e") == ""
    for v in ("0.5.22", "0.5.24", "0.6.0", "0.5.23.dev4", None):
        why = sv.check_supported(v, "http://e")
        assert "http://e" in why and "0.5.20, 0.5.21, 0.5.23" in why
        assert (repr(v) if v else "no version") in why


def test_features_by_version():
    assert not sv.has("0.5.20", "sessions") and sv.has("0.5.21", "sessions")
    assert sv.has("0.5.23", "frees_after_barrier") and not sv.has("0.5.20",
                                                                   "frees_after_barrier")
    assert sv.has("0.5.23", "soft_flush_failure") and not sv.has("0.5.21", "soft_flush_failure")
    with pytest.raises(KeyError):
        sv.has("0.5.23", "nonsense")


def info(**kw):
    return {"version": "0.5.23", "tp_size": 2, "dp_size": 1, "pp_size": 1,
            "enable_dp_attention": False, "tokenizer_worker_num": 1, **kw}


@pytest.mark.parametrize(("kw", "words"), [
    ({"pp_size": 2}, "pp_size 2"),
    ({"dp_size": 2}, "dp_size 2"),
    ({"dp_size": 2, "enable_dp_attention": True}, "dp_size 2"),  # 0.5.23 resolves it to 1
    ({"tp_size": 4}, "tp_size 4"),
    ({"tokenizer_worker_num": 2}, "tokenizer_worker_num 2"),
    ({"frontend": "rust"}, "'rust' front end"),
])
def test_layouts_refused(kw, words):
    assert words in sv.layout_refusal(info(**kw), 2, "http://e")


def test_attention_dp_passes_on_0_5_20_and_0_5_21():
    """0.5.20/0.5.21 allow dp_size > 1 with attention DP (tokenizer_control_mixin L513 /
    L565); 0.5.23 reports attention DP as dp_size 1 (parallel.py L192-194)."""
    for v in ("0.5.20", "0.5.21"):
        assert sv.layout_refusal(info(version=v, dp_size=2, enable_dp_attention=True), 2,
                                 "e") == ""
    assert sv.layout_refusal(info(), 2, "e") == ""


def test_looks_like_sglang():
    assert sv.looks_like_sglang(info())
    assert not sv.looks_like_sglang({"vllm_config": {}, "version": "x", "tp_size": 1})
    assert not sv.looks_like_sglang(None) and not sv.looks_like_sglang({"version": "0.5.23"})


def test_the_docs_carry_the_features_table():
    text = (DOCS / "sglang-versions.md").read_text()
    assert sv.features_markdown() in text, "docs/sglang-versions.md: paste features_markdown()"


def test_steps_sglang_has_no_counterpart_of_are_refused_loudly():
    for step in ("draft_support", "check_replies", "start_draft_weight_update"):
        with pytest.raises(NotAnSglangStep, match=step):
            plan(step, None, Dialect("0.5.23"))


def test_finish_sets_the_version_after_the_session_and_never_aborts_requests():
    reqs = plan("finish_weight_update", {"weight_version": "v3"}, Dialect("0.5.23"))
    assert [(r.method, r.path) for r in reqs] == [("POST", "/end_weight_update"),
                                                  ("POST", "/update_weight_version")]
    assert reqs[1].body == {"new_version": "v3", "abort_all_requests": False}
    reqs = plan("finish_weight_update", {"weight_version": "v3"}, Dialect("0.5.20"))
    assert [r.path for r in reqs] == ["/update_weight_version"]


def _table(tmp_path: Path, extra: str) -> Config:
    p = tmp_path / "c.toml"
    p.write_text('[[engines]]\nurl = "http://127.0.0.1:30000"\nslot_start = 0\n'
                 f"slot_size = 2\n{extra}")
    cfg = Config()
    read_config_file(p, cfg)
    return cfg


def test_engine_table_kind_and_pause_mode(tmp_path):
    (e,) = _table(tmp_path, 'kind = "sglang"\npause_mode = "retract"\n').engines
    assert (e.kind, e.pause_mode) == ("sglang", "retract")
    (e,) = _table(tmp_path, "").engines
    assert (e.kind, e.pause_mode) == ("", "in_place")
    with pytest.raises(ConfigError, match="kind 'tgi'"):
        _table(tmp_path, 'kind = "tgi"\n')
    with pytest.raises(ConfigError, match="pause_mode 'keep'"):
        _table(tmp_path, 'kind = "sglang"\npause_mode = "keep"\n')
    with pytest.raises(ConfigError, match="pause_mode is SGLang's"):
        _table(tmp_path, 'kind = "vllm"\npause_mode = "abort"\n')


def _doc_chunk_row() -> tuple[str, str]:
    """docs/sglang.md section 4's ``chunk k`` row: (0.5.21/0.5.23 cell, 0.5.20 cell)."""
    text = (DOCS / "sglang.md").read_text()
    section = text.split("## 4. What the daemon does per round", 1)[1].split("\n## ", 1)[0]
    (row,) = [line for line in section.splitlines() if line.startswith("| chunk k |")]
    cells = [c.strip() for c in row.strip().strip("|").split(" | ")]
    assert len(cells) == 3, cells
    return cells[1], cells[2]


def _chunk_body(version: str) -> dict:
    """The ``/update_weights_from_tensor`` body the daemon sends an SGLang ``version`` engine
    for one packed chunk of two ranks: the family's merge, then the step's plan."""
    import msgspec
    from test_coordinator import chunk

    from slotsync.daemon.core.family import MergeFacts
    from slotsync.daemon.sglang.family import SGLANG
    from slotsync.protocol.wire import logical_gpu_uuid

    uuids = {r: logical_gpu_uuid(r) for r in range(2)}
    merged = SGLANG.merge(0, {r: chunk(0, 0, r) for r in range(2)},
                          MergeFacts(uuids, True, "shm", 2, SGLANG), None)
    body = msgspec.json.decode(bytes(SGLANG.chunk_body(merged)))
    (req,) = plan("update_weights", body, Dialect(version))
    assert (req.method, req.path) == ("POST", "/update_weights_from_tensor")
    return req.body


@pytest.mark.parametrize("version", sv.SUPPORTED)
def test_the_chunk_body_per_version_is_what_the_docs_say(version):
    """Issue 35 item 16: docs/sglang.md section 4 said 0.5.20 gets the chunk body without
    ``selector``; the daemon sends every version the same body, ``selector`` included
    (0.5.20 ignores it). The table's row is read: every field the body has is named in the
    0.5.21+ cell with its value, and the 0.5.20 cell says the same body, selector included."""
    new, old = _doc_chunk_row()
    body = _chunk_body(version)
    assert set(body) == {"serialized_named_tensors", "load_format", "flush_cache",
                         "abort_all_requests", "selector"}, body
    assert len(body["serialized_named_tensors"]) == 2  # one entry per TP rank
    assert (body["load_format"], body["flush_cache"], body["abort_all_requests"],
            body["selector"]) == ("flattened_bucket", False, False, "all")
    for key, shown in (("load_format", '"flattened_bucket"'), ("flush_cache", "false"),
                       ("abort_all_requests", "false"), ("selector", '"all"')):
        assert f'"{key}": {shown}' in new, (key, new)
    assert '"serialized_named_tensors"' in new and "no `weight_version`" in new
    assert "weight_version" not in body
    assert body == _chunk_body("0.5.23")  # the same body for every version
    assert old.startswith("the same body, `selector` included"), old
    assert "without" not in old, old


@pytest.mark.sglang
@pytest.mark.parametrize("version", sv.SUPPORTED)
def test_each_version_takes_the_chunk_body_with_sglangs_own_validation(version):
    """The body of each version through that version's ``UpdateWeightsFromTensorReqInput``,
    validated by SGLang's own ``msgspec_struct_pydantic_core_schema`` (the SGLang-code
    engine's structs): 0.5.21+ read ``selector "all"``; 0.5.20 has no such field, ignores it,
    and keeps ``disable_draft_model`` null (SGLang's default), as the docs say."""
    pytest.importorskip("pydantic")
    from pydantic import TypeAdapter

    from slotsync.engine.sglang.http import request_structs, sglang_helpers
    from slotsync.engine.sglang.state import VERSIONS

    try:
        helpers = sglang_helpers()
    except ImportError as e:
        pytest.skip(f"SGLang is not importable: {e}")
    cls = request_structs(VERSIONS[version], helpers).update
    got = TypeAdapter(cls).validate_python(_chunk_body(version))
    assert (got.load_format, got.flush_cache, got.abort_all_requests, got.weight_version) == (
        "flattened_bucket", False, False, None)
    assert len(got.serialized_named_tensors) == 2
    if version == "0.5.20":
        assert not hasattr(got, "selector") and got.disable_draft_model is None
    else:
        assert got.selector == "all"
