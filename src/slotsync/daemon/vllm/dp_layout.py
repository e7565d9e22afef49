"""Data-parallel layouts that one API server cannot drive (issue 25 D): an I/O-free rule.

slotsync drives an engine through one HTTP endpoint. A vLLM engine with data parallelism
(DP, and DP x EP for MoE models) is served in one of three load-balancing modes, and in two
of them one API server reaches only some of the DP ranks. vLLM 0.32
``v1/engine/core_client.py`` ``MPClient.__init__``: a server's client manages the ranks
``[data_parallel_index, data_parallel_index + n)``, with ``n = data_parallel_size_local`` if
``ParallelConfig.local_engines_only`` (``config/parallel.py``: ``data_parallel_external_lb
or data_parallel_hybrid_lb``) else ``data_parallel_size``; one rank only when
``data_parallel_rank_local`` is set (``offline_mode``); ``DpLayout.reached``:

* internal LB (``vllm serve --data-parallel-size N`` on the first node, ``--headless`` on the
  others): the one server reaches all N ranks, and one call reaches every rank
  (``DPLBAsyncMPClient.call_utility_async``): accepted;
* hybrid LB (``--data-parallel-hybrid-lb``, or implied by ``--data-parallel-start-rank``,
  ``engine/arg_utils.py``): one server per node, reaching that node's ranks;
* external LB (``--data-parallel-external-lb``, ``--data-parallel-rank``): one server per rank.

In the last two the daemon would drive one slice of a group whose pause and resume are
collective: a rank's pause completes only once every DP rank of the deployment was paused
(``v1/engine/core.py`` ``DPEngineCoreProc._pause_complete`` and ``_has_global_unfinished_reqs``,
the all-reduce of ``ParallelConfig.sync_dp_state``), a pending pause cannot be resumed
(``DPEngineCoreProc.resume_scheduler`` raises), a resume blocks in an all-reduce until every
rank resumes (``ParallelConfig.has_unfinished_dp``), and the weight calls reach only the
server's own ranks. So such an engine is refused in the begin, before the pause
(``refusal``); ``docs/dp-layouts.md`` has the finding in full.

Where the layout comes from: ``GET /server_info?config_format=json`` (vLLM 0.32
``entrypoints/serve/dev/server_info/api_router.py`` ``show_server_info``, registered in dev
mode, the same ``VLLM_SERVER_DEV_MODE=1`` the weight-transfer routes need): ``{"vllm_config":
<the server's VllmConfig, dumped by pydantic>, "vllm_env": ..., "system_env": ...}``, whose
``vllm_config.parallel_config`` has the fields read here. It is asked with ``GET /version``
(``update.BEGIN_STAGES``, the ``version`` stages), so once per engine process and again after
a restart, and at every begin while refused. An answer that says nothing (a 404: the reference
engine or a server without the route, see ``client.py``'s ``ABSENT_IS_NONE``; a body that is not
JSON; a ``vllm_config`` in text form; a field missing or of another type) is no information:
the update goes on as it did before this rule.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from slotsync.daemon.core.engine_session import EngineSession


@dataclass(frozen=True, slots=True)
class DpLayout:
    """The data-parallel fields of one API server's ``parallel_config``: ``size``
    (``data_parallel_size``: every DP rank of the deployment), ``size_local``
    (``data_parallel_size_local``), ``first_rank`` (``data_parallel_index``, else
    ``data_parallel_rank``), ``hybrid_lb`` / ``external_lb`` (``data_parallel_hybrid_lb`` /
    ``data_parallel_external_lb``), ``offline`` (``data_parallel_rank_local`` is set)."""

    size: int
    size_local: int
    first_rank: int
    hybrid_lb: bool
    external_lb: bool
    offline: bool = False

    def reached(self) -> range:
        """The DP ranks one call of this server reaches (vLLM 0.32 ``core_client.py``): the
        ranks its client manages (``MPClient.__init__`` ``engine_ranks_managed``), each of
        them with ``DPLBAsyncMPClient`` (``call_utility_async`` = ``call_utility_all_async``),
        the first only with ``DPAsyncMPClient``, the client of external LB
        (``make_async_mp_client``; ``AsyncMPClient.call_utility_async``: ``core_engine``)."""
        if self.offline or self.external_lb:
            return range(self.first_rank, self.first_rank + 1)
        n = self.size_local if self.hybrid_lb else self.size
        return range(self.first_rank, self.first_rank + n)


def _int(x: Any) -> int | None:
    return x if isinstance(x, int) and not isinstance(x, bool) else None


def read(result: Any) -> DpLayout | None:
    """The layout in a ``/server_info?config_format=json`` answer (parsed JSON), or None when
    it says nothing usable (see the module docstring)."""
    cfg = result.get("vllm_config") if isinstance(result, dict) else None
    pc = cfg.get("parallel_config") if isinstance(cfg, dict) else None
    if not isinstance(pc, dict):
        return None
    size, local, rank = (_int(pc.get(k)) for k in (
        "data_parallel_size", "data_parallel_size_local", "data_parallel_rank"))
    index = _int(pc.get("data_parallel_index", rank))  # (an init=False field in 0.32)
    hybrid, external = pc.get("data_parallel_hybrid_lb"), pc.get("data_parallel_external_lb")
    if (size is None or local is None or index is None or not isinstance(hybrid, bool)
            or not isinstance(external, bool)):
        return None
    return DpLayout(size, local, index, hybrid, external,
                    offline=pc.get("data_parallel_rank_local") is not None)


def refusal(layout: DpLayout | None, engine_url: str) -> str:
    """Why the daemon must not drive the engine at ``engine_url`` whose server reported
    ``layout``, or '' (no layout known, no data parallelism, or a server whose calls reach
    every DP rank): more than one DP rank, of which one call reaches only some. That is
    every hybrid and external layout with more than one DP rank: vLLM's CLI turns hybrid off
    when a node holds every rank (``arg_utils.py``: ``data_parallel_size_local ==
    data_parallel_size``), and external LB pins ``data_parallel_size_local`` to 1."""
    if layout is None or layout.size <= 1:
        return ""
    ranks = layout.reached()
    if ranks == range(layout.size):
        return ""
    if layout.hybrid_lb:
        mode = ("hybrid load balancing (--data-parallel-hybrid-lb, or "
                "--data-parallel-start-rank): one API server per node")
    elif layout.external_lb:
        mode = ("external load balancing (--data-parallel-external-lb, or "
                "--data-parallel-rank): one API server per DP rank")
    else:
        mode = "an API server that reaches only some of the DP ranks"
    n = layout.size
    return (
        f"engine {engine_url} is one API server of a data-parallel deployment that slotsync "
        f"cannot drive: vLLM's /server_info says data_parallel_size={n} served with {mode}, so "
        f"this server reaches only DP ranks [{ranks.start}, {ranks.stop}) of the {n}. In "
        "vLLM, pause and resume are collective across every DP rank: /pause on one server "
        "does not return until every DP rank of the deployment was paused (and a pending "
        "pause cannot be cancelled), /resume blocks until every rank resumes, and the weight "
        "calls reach only this server's ranks; so updating one endpoint at a time would hang "
        "the whole data- and expert-parallel group. Serve the model with vLLM's internal load "
        f"balancer instead: `vllm serve ... --data-parallel-size {n} --data-parallel-size-local "
        "<its ranks> --data-parallel-address <its address>` on the first node, `vllm serve ... "
        f"--headless --data-parallel-size {n} --data-parallel-size-local <its ranks> "
        "--data-parallel-start-rank <its first rank> --data-parallel-address <the first "
        "node's address>` on each other node, and give slotsync only the first node's "
        "endpoint: one pause, update and resume from it reach every DP rank "
        "(docs/dp-layouts.md)")


def check(engine: EngineSession, result: Any, engine_url: str) -> str:
    """``/server_info``'s answer at the begin: record on ``engine`` why its layout is refused
    (``EngineSession.dp_layout_refused``, '' when it is not) and return it."""
    engine.dp_layout_refused = refusal(read(result), engine_url)
    return engine.dp_layout_refused
