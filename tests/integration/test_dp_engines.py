"""Data-parallel engines and list-form ``update_info`` on both engines (issue 18 B, and the
engine side of A / E).

Each engine kind runs as one ``python -m slotsync.engine --workers 4 --data-parallel-size 2``:
two DP replicas of TP=2 behind one API server, as ``vllm serve --data-parallel-size 2
--tensor-parallel-size 2``. Worker ``i`` is TP rank ``i % 2`` of replica ``i // 2``. On the
vLLM-code engine every worker is vLLM's own ``gpu_worker.Worker`` with the parallel config an
engine core gives it, so vLLM's ``update_weights`` picks ``update_info[data_parallel_index *
world_size + rank]`` and vLLM's ``parse_update_info`` parses the entry; the reference engine
must do the same wherever the daemon can tell (``test_reference_answers_lists_as_vllm``
compares them call by call). Payloads are shared-memory handles pickled by the daemon's own
writer (``tests/shm_payloads.py``), one entry per worker.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from engines import model_file, start_engine  # noqa: E402
from shm_payloads import Segments, bytes_of, packed_info, unpacked_info  # noqa: E402
from spawned_ranks import rounds, run_ranks  # noqa: E402
from state_readers import checksums_in_worker_order, engine_stats  # noqa: E402

from slotsync.engine.checksum import tensor_checksum  # noqa: E402
from slotsync.protocol.wire import ShmHandle  # noqa: E402
from slotsync.testing.processes import DaemonProcess  # noqa: E402
from slotsync.testing.tensors import make_tensors  # noqa: E402

pytestmark = pytest.mark.slow

DP, TP = 2, 2
WORKERS = DP * TP
IMPLS = [pytest.param("reference", id="reference"),
         pytest.param("vllm", id="vllm", marks=pytest.mark.vllm)]
WRAP = ("Call to collective_rpc method failed: Worker failed with error '{}', please check the "
        "stack trace above for the root cause")


def _start(impl: str) -> Any:
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    kw: dict[str, Any] = {"model": model_file(make_tensors(0))}
    if impl == "vllm":  # every reply read: one step's failure does not shift the next's
        kw["executor_replies"] = "all"
    return start_engine(WORKERS, impl_name=impl, data_parallel_size=DP, **kw)


@pytest.fixture(scope="module")
def ref_dp() -> Iterator[Any]:
    with _start("reference") as eng:
        yield eng


@pytest.fixture(scope="module")
def vllm_dp() -> Iterator[Any]:
    with _start("vllm") as eng:
        yield eng


def _settle(eng: Any) -> Any:
    """No fault, no session open on any worker, serving, every weight servable."""
    eng.request("POST", "/_slotsync/fault", {"clear": True})
    eng.request("POST", "/finish_weight_update")  # (a 500 when nothing is active)
    assert not any(w["active"] for w in engine_stats(eng)["workers"])
    eng.request("POST", "/resume")
    return eng


@pytest.fixture(params=IMPLS)
def dp_engine(request: pytest.FixtureRequest) -> Any:
    """The module's DP=2 x TP=2 engine of each kind, settled."""
    return _settle(request.getfixturevalue("ref_dp" if request.param == "reference"
                                           else "vllm_dp"))


@pytest.fixture
def shm() -> Iterator[Segments]:
    s = Segments()
    yield s
    s.close()


def sums_in_worker_order(eng: Any) -> list[dict[str, str]]:
    """Each worker's ``{name: sha256}``, in global worker order, from either engine."""
    got = checksums_in_worker_order(eng)
    assert len(got) == WORKERS
    return got


def entry(tensors: dict[str, torch.Tensor], uuid: str, shm: Segments, packed: bool) -> dict:
    """One worker's ``update_info``: handles for that worker's GPU UUID only."""
    if not packed:
        return unpacked_info(tensors, [uuid], shm)
    data = b"".join(bytes_of(t) for t in tensors.values())
    seg = shm.put(data, max(len(data), 1))
    return packed_info(tensors, {uuid: ShmHandle(segment=seg.name, offset=0,
                                                 nbytes=max(len(data), 1))})


def post(eng: Any, path: str, body: Any = None) -> tuple[int, Any]:
    return eng.request("POST", path, body)


# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("impl", IMPLS)
def test_world_size_counts_dp_as_vllm(impl: str, request: pytest.FixtureRequest) -> None:
    """``/get_world_size``: D x TP with ``include_dp`` (vLLM's default), TP without, pydantic's
    bool spellings, vLLM's 400 for another; ``/collective_rpc`` answers replica 0's TP
    results (``DPLBAsyncMPClient.call_utility_async``)."""
    eng = _settle(request.getfixturevalue("ref_dp" if impl == "reference" else "vllm_dp"))
    got = {q: eng.request("GET", "/get_world_size" + q)
           for q in ("", "?include_dp=true", "?include_dp=false", "?include_dp=0",
                     "?include_dp=YES", "?include_dp=maybe")}
    sizes = {q: (s, b.get("world_size")) for q, (s, b) in got.items()}
    assert sizes == {"": (200, 4), "?include_dp=true": (200, 4), "?include_dp=false": (200, 2),
                     "?include_dp=0": (200, 2), "?include_dp=YES": (200, 4),
                     "?include_dp=maybe": (400, None)}, got
    assert got["?include_dp=maybe"][1]["error"]["param"] == "query.include_dp"
    if impl == "reference":  # the test engine's extension: every worker, global order
        assert got[""][1]["gpu_uuids"] == got["?include_dp=false"][1]["gpu_uuids"] == \
            eng.gpu_uuids
    assert post(eng, "/collective_rpc", {"method": "check_health"}) == \
        (200, {"results": [None] * TP})
    layout = [(w["index"], w["dp_index"], w["tp_rank"], w["gpu_uuid"])
              for w in engine_stats(eng)["workers"]]
    assert layout == [(i, i // TP, i % TP, u) for i, u in enumerate(eng.gpu_uuids)]


@pytest.mark.parametrize("packed", [False, True], ids=["unpacked", "packed"])
def test_list_form_lands_on_worker_dp_index_times_tp_plus_rank(dp_engine: Any, shm: Segments,
                                                               packed: bool) -> None:
    """Two chunks of list-form payloads, entry ``i`` holding worker ``i``'s own values
    (``make_tensors(10 + i)``) and a different half of the names per worker; worker 3's entry
    of chunk 0 is empty (no names), so all of its names come in chunk 1. Each worker then
    holds exactly its entries: its own values, checksums per worker; each ran both chunks;
    the reference engine's byte count per worker is what its entries carried."""
    eng = dp_engine
    uuids = eng.gpu_uuids
    own = [dict(make_tensors(10 + i)) for i in range(WORKERS)]
    names = list(own[0])
    first = [[n for j, n in enumerate(names) if (j + i) % 2 == 0] if i < 3 else []
             for i in range(WORKERS)]
    before = [w["update_count"] for w in engine_stats(eng)["workers"]]
    bytes_before = [w.get("bytes_loaded", 0) for w in engine_stats(eng)["workers"]]
    assert post(eng, "/init_weight_transfer_engine", {"init_info": {"packed": packed}})[0] == 200
    assert post(eng, "/start_weight_update")[0] == 200
    for chunk in range(2):
        infos = []
        for i in range(WORKERS):
            pick = first[i] if chunk == 0 else [n for n in names if n not in first[i]]
            infos.append(entry({n: own[i][n] for n in pick}, uuids[i], shm, packed))
        status, body = post(eng, "/update_weights", {"update_info": infos})
        assert status == 200, body
    status, body = post(eng, "/finish_weight_update", {"weight_version": f"list-{packed}"})
    assert status == 200, body
    got = sums_in_worker_order(eng)
    for i in range(WORKERS):
        assert got[i] == {n: tensor_checksum(t) for n, t in own[i].items()}, f"worker {i}"
    workers = engine_stats(eng)["workers"]
    assert [w["update_count"] - b for w, b in zip(workers, before, strict=True)] == [2] * 4
    if eng.impl == "reference":
        full = sum(t.numel() * t.element_size() for t in own[0].values())
        assert [w["bytes_loaded"] - b for w, b in zip(workers, bytes_before, strict=True)] == \
            [full] * 4
    assert eng.request("GET", "/weight_info")[1] == {"weight_version": f"list-{packed}"}


@pytest.mark.vllm
def test_reference_answers_lists_as_vllm(ref_dp: Any, vllm_dp: Any, shm: Segments) -> None:
    """Bad list-form payloads on DP=2 x TP=2: a list too short (vLLM's ``IndexError`` in the
    worker past its end), an entry with an unknown key, without ``shapes`` or without every
    key (vLLM's ``parse_update_info`` in that worker only), an entry that is not an object and an
    ``update_info`` that is neither (FastAPI's 400 before any worker sees it), packed empty
    entries with and without the worker's handle -- the same status, body and per-worker
    session flags on both engines, step by step."""
    engines = {"vllm": _settle(vllm_dp), "reference": _settle(ref_dp)}
    uuids = ref_dp.gpu_uuids
    assert vllm_dp.gpu_uuids == uuids
    t = dict(make_tensors(21))
    few = {n: t[n] for n in list(t)[:2]}
    good = [entry(few, u, shm, False) for u in uuids]
    unknown = [*good[:2], {**good[2], "bogus": 1}, good[3]]
    no_shapes = [good[0], {k: v for k, v in good[1].items() if k != "shapes"}, *good[2:]]
    empty_packed = [entry(few, uuids[0], shm, True), entry({}, uuids[1], shm, True),
                    entry(few, uuids[2], shm, True), entry({}, uuids[3], shm, True)]
    no_handle = [*empty_packed[:3], {**empty_packed[3],
                                     "ipc_handles_pickled": packed_info({}, {})[
                                         "ipc_handles_pickled"]}]
    steps: list[tuple[str, str, Any]] = [
        ("init", "/init_weight_transfer_engine", {"init_info": {"packed": False}}),
        ("start", "/start_weight_update", None),
        ("too short", "/update_weights", {"update_info": good[:3]}),
        ("finish split", "/finish_weight_update", None),
        ("start", "/start_weight_update", None),
        ("empty list", "/update_weights", {"update_info": []}),
        ("finish split", "/finish_weight_update", None),
        ("start", "/start_weight_update", None),
        ("unknown key", "/update_weights", {"update_info": unknown}),
        ("finish split", "/finish_weight_update", None),
        ("start", "/start_weight_update", None),
        ("no shapes", "/update_weights", {"update_info": no_shapes}),
        ("finish split", "/finish_weight_update", None),
        ("start", "/start_weight_update", None),
        ("empty entry", "/update_weights", {"update_info": [*good[:3], {}]}),
        ("finish split", "/finish_weight_update", None),
        ("start", "/start_weight_update", None),
        ("only names", "/update_weights", {"update_info": {"names": []}}),
        ("start", "/start_weight_update", None),
        ("not an object", "/update_weights", {"update_info": [good[0], 5, good[2], None]}),
        ("neither", "/update_weights", {"update_info": "x"}),
        ("a number", "/update_weights", {"update_info": 7}),
        ("12 not objects", "/update_weights", {"update_info": [*good, *range(12)]}),
        ("a long string", "/update_weights", {"update_info": ["y" * 300, *good[1:]]}),
        ("one too many", "/update_weights", {"update_info": [*good, {}]}),
        ("finish", "/finish_weight_update", {"weight_version": "ok"}),
        ("init packed", "/init_weight_transfer_engine", {"init_info": {"packed": True}}),
        ("start", "/start_weight_update", None),
        ("empty packed", "/update_weights", {"update_info": empty_packed}),
        ("no handle", "/update_weights", {"update_info": no_handle}),
        ("finish split", "/finish_weight_update", None),
    ]
    seen: dict[str, list[tuple[int, Any, list[bool]]]] = {k: [] for k in engines}
    for name, eng in engines.items():
        for _, path, body in steps:
            status, got = post(eng, path, body)
            seen[name].append((status, got, [w["active"] for w in engine_stats(eng)["workers"]]))
    for (label, *_), a, b in zip(steps, seen["vllm"], seen["reference"], strict=True):
        assert b == a, f"step {label!r}: vLLM {a}, reference {b}"
    by_label = dict(zip([s[0] for s in steps], seen["vllm"], strict=False))
    assert by_label["too short"][:2] == (500, {"error": {
        "message": WRAP.format("list index out of range"), "type": "InternalServerError",
        "param": None, "code": 500}})
    assert by_label["too short"][2] == [True, True, True, False]
    assert "unexpected keyword argument 'bogus'" in by_label["unknown key"][1]["error"][
        "message"]
    assert "missing 3 required positional arguments: 'names', 'dtype_names', and 'shapes'" \
        in by_label["empty entry"][1]["error"]["message"]
    assert by_label["not an object"][0] == 400 and by_label["not an object"][2] == [True] * 4
    assert by_label["empty packed"][0] == 200
    assert "IPC handle not found for GPU UUID" in by_label["no handle"][1]["error"]["message"]


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "unpacked"])
def test_daemon_round_lands_on_every_dp_worker(dp_engine: Any, packed: bool) -> None:
    """A normal (dict-form) round through slotsyncd, 4 ranks in one slot over the DP=2 x TP=2
    engine: the daemon's ``/get_world_size?include_dp=true`` counts 4, the merged handles
    reach all four workers of both replicas (checksums per worker, the version)."""
    eng = dp_engine
    with DaemonProcess() as d:
        ev = run_ranks(d, eng.url, packed, [{"rounds": 1}] * WORKERS)
        for r in range(WORKERS):
            assert [e["status"] for e in rounds(ev, r)] == ["ok"], (ev, d.log_tail())
    want = {n: tensor_checksum(t) for n, t in make_tensors(1)}
    got = sums_in_worker_order(eng)
    assert [{n: s[n] for n in want} for s in got] == [want] * WORKERS
    assert eng.request("GET", "/weight_info")[1] == {"weight_version": "v1"}
    assert eng.request("GET", "/is_paused")[1] == {"is_paused": False}


def test_round_after_a_worker_failure_on_a_dp_engine(dp_engine: Any) -> None:
    """Worker 3 (replica 1, TP rank 1) fails chunk 0 of a round: the ranks are told, the
    engine stays paused. The next round's first executor call is the daemon's check_health
    (``check_replies``), which the DP engine answers with replica 0's two results for a slot
    of four: in step (``replies_in_step``), so the round goes through as a full update."""
    eng = dp_engine
    rpc_before = engine_stats(eng)["route_counts"].get("collective_rpc", 0)
    status, body = post(eng, "/_slotsync/fault", {"route": "update_weights", "workers": [3],
                                                  "message": "boom on worker 3"})
    assert status == 200, body
    with DaemonProcess() as d:
        ev = run_ranks(d, eng.url, True, [{"rounds": 1}] * WORKERS)
        failed = rounds(ev, 0)
        assert failed[0]["status"] == "error" and "boom on worker 3" in failed[0]["message"], ev
        ev = run_ranks(d, eng.url, True, [{"rounds": 1, "first_round": 2}] * WORKERS)
        for r in range(WORKERS):
            assert [e["status"] for e in rounds(ev, r)] == ["ok"], (ev, d.log_tail())
    # the check_health went out (POST /collective_rpc) and passed
    assert engine_stats(eng)["route_counts"].get("collective_rpc", 0) > rpc_before
    want = {n: tensor_checksum(t) for n, t in make_tensors(2)}
    assert [{n: s[n] for n in want} for s in sums_in_worker_order(eng)] == [want] * WORKERS
    assert eng.request("GET", "/weight_info")[1] == {"weight_version": "v2"}


EXPERTS_PER_WORKER = 2


def shared_tensors(seed: int) -> dict[str, torch.Tensor]:
    """What every worker of an expert-parallel engine holds (embedding, norm)."""
    g = torch.Generator().manual_seed(seed)
    return {"embed.weight": torch.randn(16, 8, generator=g),
            "norm.weight": torch.randn(8, generator=g).to(torch.bfloat16)}


def expert_tensors(worker: int, seed: int) -> dict[str, torch.Tensor]:
    """Worker ``worker``'s own experts (``experts.<e>.w``, ``e`` = 2 * worker, 2 * worker + 1)."""
    g = torch.Generator().manual_seed(seed * 100 + worker)
    return {f"experts.{e}.w": torch.randn(8, 4, generator=g)
            for e in range(worker * EXPERTS_PER_WORKER, (worker + 1) * EXPERTS_PER_WORKER)}


@pytest.fixture(scope="module", params=IMPLS)
def ep_engine(request: pytest.FixtureRequest) -> Iterator[Any]:
    """A DP=2 x TP=2 engine whose worker ``i`` holds only the shared weights and its own two
    experts (``--worker-models``), as the workers of an expert-parallel engine do."""
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    named = [list({**shared_tensors(0), **expert_tensors(i, 0)}.items())
             for i in range(WORKERS)]
    kw: dict[str, Any] = {"executor_replies": "all"} if request.param == "vllm" else {}
    with start_engine(WORKERS, impl_name=request.param, data_parallel_size=DP,
                      worker_named=named, **kw) as eng:
        yield eng


@pytest.mark.parametrize("packed", [False, True], ids=["unpacked", "packed"])
def test_each_ep_worker_keeps_only_its_names(ep_engine: Any, shm: Segments,
                                             packed: bool) -> None:
    """A rank-local round: entry ``i`` carries the shared weights (the same for every worker)
    and worker ``i``'s experts only. Every worker's checksums then list exactly its own
    names, each with the value its entry sent: the routing, proven per worker."""
    eng = _settle(ep_engine)
    uuids = eng.gpu_uuids
    shared = shared_tensors(5)
    own = [{**shared, **expert_tensors(i, 5)} for i in range(WORKERS)]
    assert post(eng, "/init_weight_transfer_engine", {"init_info": {"packed": packed}})[0] == 200
    assert post(eng, "/start_weight_update")[0] == 200
    status, body = post(eng, "/update_weights", {
        "update_info": [entry(own[i], uuids[i], shm, packed) for i in range(WORKERS)]})
    assert status == 200, body
    assert post(eng, "/finish_weight_update", {"weight_version": "ep"})[0] == 200
    got = sums_in_worker_order(eng)
    for i in range(WORKERS):
        assert got[i] == {n: tensor_checksum(t) for n, t in own[i].items()}, f"worker {i}"
    assert [w["num_weights"] for w in engine_stats(eng)["workers"]] == \
        [2 + EXPERTS_PER_WORKER] * WORKERS


def test_cli_refuses_a_dp_layout_or_worker_models_that_do_not_fit(tmp_path: Any,
                                                                  capsys: Any) -> None:
    """Before any worker starts: workers not a multiple of ``--data-parallel-size``, a
    ``--worker-models`` list of the wrong length or with a missing file, or both model
    options."""
    from slotsync.engine.__main__ import main

    m = str(model_file(make_tensors(0)))
    cases = [
        (["--workers", "3", "--data-parallel-size", "2"],
         "--workers 3 is not a multiple of --data-parallel-size 2"),
        (["--workers", "2", "--worker-models", m], "--worker-models has 1 entries, --workers is 2"),
        (["--workers", "2", "--worker-models", f"{m},{tmp_path}/none.safetensors"],
         "none.safetensors: no such file"),
        (["--workers", "1", "--model", m, "--worker-models", m],
         "--model and --worker-models exclude each other"),
    ]
    for argv, want in cases:
        with pytest.raises(SystemExit) as e:
            main(argv)
        text = f"{e.value.code} {capsys.readouterr().err}"
        assert want in text, (argv, text)
