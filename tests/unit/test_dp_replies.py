"""The daemon's ``check_replies`` reading against a data-parallel engine (issue 18 B).

vLLM 0.32's ``DPLBAsyncMPClient`` (one ``vllm serve --data-parallel-size D``) runs
``collective_rpc`` on every DP replica and answers replica 0's results only
(``core_client.py`` ``call_utility_async``): the check (each worker's ``rpc_rank``) on a
DP=2 x TP=2 engine answers ``["0", "1"]`` for a slot of four ranks. That is in step; a stale
reply in the list is not, a success (null) included.
"""

from __future__ import annotations

from slotsync.daemon.core.engine_session import replies_in_step


def ranks(n: int) -> dict:
    return {"results": [str(i) for i in range(n)]}


def test_each_worker_of_replica_0_answering_its_rank_is_in_step() -> None:
    assert replies_in_step(ranks(4), 4)  # DP=1, TP=4
    assert replies_in_step(ranks(2), 4)  # DP=2 x TP=2: replica 0's two
    assert replies_in_step(ranks(1), 4)  # DP=4 x TP=1


def test_a_stale_reply_or_a_count_that_fits_no_layout_is_out_of_step() -> None:
    assert not replies_in_step({"results": ["0", "a queued error"]}, 4)
    assert not replies_in_step({"results": ["0", None]}, 2)  # a queued success (gh-58242)
    assert not replies_in_step({"results": [None, None]}, 2)  # check_health's answer
    assert not replies_in_step({"results": ["0", "True"]}, 2)  # a queued draft_support
    assert not replies_in_step({"results": ["1", "0"]}, 2)
    assert not replies_in_step(ranks(3), 4)  # 3 does not divide 4
    assert not replies_in_step({"results": []}, 4)
    assert not replies_in_step(ranks(8), 4)
    assert not replies_in_step({"error": "x"}, 4)
