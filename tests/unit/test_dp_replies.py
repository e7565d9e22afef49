"""The daemon's ``check_replies`` reading against a data-parallel engine (issue 18 B).

vLLM 0.32's ``DPLBAsyncMPClient`` (one ``vllm serve --data-parallel-size D``) runs
``collective_rpc`` on every DP replica and answers replica 0's results only
(``core_client.py`` ``call_utility_async``): ``check_health`` on a DP=2 x TP=2 engine answers
two ``null``s for a slot of four ranks. That is in step; a stale reply in the list is not.
"""

from __future__ import annotations

from slotsync.daemon.engine_session import replies_in_step


def test_one_clean_reply_per_worker_of_replica_0_is_in_step() -> None:
    assert replies_in_step({"results": [None] * 4}, 4)  # DP=1, TP=4
    assert replies_in_step({"results": [None] * 2}, 4)  # DP=2 x TP=2: replica 0's two
    assert replies_in_step({"results": [None]}, 4)  # DP=4 x TP=1


def test_a_stale_reply_or_a_count_that_fits_no_layout_is_out_of_step() -> None:
    assert not replies_in_step({"results": [None, "a queued error"]}, 4)
    assert not replies_in_step({"results": [None] * 3}, 4)  # 3 does not divide 4
    assert not replies_in_step({"results": []}, 4)
    assert not replies_in_step({"results": [None] * 8}, 4)
    assert not replies_in_step({"error": "x"}, 4)
