"""Which SGLang versions slotsyncd speaks to, what each has, and which layouts it refuses
(I/O-free; issue 26).

SGLang has no ``GET /version``: its ``GET /server_info`` carries ``"version": __version__``
next to every server argument (SGLang 0.5.23 ``srt/entrypoints/http_server.py`` L863-888;
docs/sglang-contract.md 2.5). The daemon reads that answer once per engine process (the
``version`` begin stage, ``update.BEGIN_STAGES``) and refuses, before the pause, a version it
has not read (``check_supported``) or a parallel layout its payload cannot address
(``layout_refusal``).

``FEATURES`` is the one table of what changed between the versions read
(docs/sglang-contract.md section 1; ``docs/sglang.md`` carries it too, and
``tests/unit/test_sglang_versions.py`` checks they agree).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

SUPPORTED: tuple[str, ...] = ("0.5.20", "0.5.21", "0.5.23")
"""The SGLang releases whose weight-update code was read (docs/sglang-contract.md 0). 0.5.22
was not read; a later release may move the session, the payload or the place where the
received tensors are freed (the buffer fence, ``daemon/sglang/fence.py``), so it is refused until
someone reads it."""

_VERSION = re.compile(r"(?P<base>\d+\.\d+\.\d+)(?:\.post\d+)?(?:\+[0-9A-Za-z.\-_]+)?")


@dataclass(frozen=True, slots=True)
class Feature:
    """One row of ``FEATURES``: ``since`` the first supported version that has it, and
    ``what`` it changes for the daemon, with where that is in SGLang's code."""

    since: str
    what: str


FEATURES: dict[str, Feature] = {
    "sessions": Feature("0.5.21", "POST /begin_weight_update and /end_weight_update; "
                        "/update_weights_from_tensor outside a session is a 400 (scheduler "
                        "weight_updater.py L232-239, 0.5.23)"),
    "selector": Feature("0.5.21", "the update's `selector` field (target/draft/all); 0.5.20 "
                        "has `disable_draft_model` (io_struct L2027 / L1841)"),
    "soft_flush_failure": Feature("0.5.23", "a refused flush after a tensor update is a 400, "
                                  "not a scheduler assert that kills the server "
                                  "(weight_updater.py L128-132)"),
    "retract_flushable": Feature("0.5.21", "the cache can be flushed after a `retract` pause "
                                 "(is_fully_idle(ignore_waiting), scheduler.py L5337)"),
    "frees_after_barrier": Feature("0.5.21", "each TP rank frees the received tensors after "
                                   "the TP barrier, so a reply proves only rank 0's copies "
                                   "(weight_updater.py L241 / L262): the fence waits for a "
                                   "later call (daemon/sglang/fence.py)"),
    "checker_skip_list": Feature("0.5.21", "POST /weights_checker takes `skip_tensor_list`: "
                                 "the call that proves an adapter's copies on every TP rank "
                                 "hashes no weight (weight_checker.py _is_skip_weight_check; "
                                 "daemon/sglang/adapters.py proving_body)"),
}


def parse(text: Any) -> str | None:
    """The release ``text`` names (``"0.5.23"`` for ``"0.5.23"``, ``"0.5.23.post1"``,
    ``"0.5.23+cu130"``), or None when it is no SGLang release number."""
    if not isinstance(text, str):
        return None
    m = _VERSION.fullmatch(text.strip())
    return m.group("base") if m else None


def has(version: str | None, feature: str) -> bool:
    """Whether the supported release ``version`` has ``feature`` (a key of ``FEATURES``).

    Raises:
        KeyError: an unknown feature (a bug).
    """
    since = FEATURES[feature].since
    base = parse(version)
    return base is not None and _key(base) >= _key(since)


def _key(base: str) -> tuple[int, ...]:
    return tuple(int(x) for x in base.split("."))


def version_of(server_info: Any) -> Any:
    """The ``"version"`` value of a ``GET /server_info`` answer (None if absent)."""
    return server_info.get("version") if isinstance(server_info, dict) else None


def looks_like_sglang(server_info: Any) -> bool:
    """``GET /server_info`` was answered by SGLang: its flat server arguments with
    ``version`` and ``tp_size`` (SGLang 0.5.20-0.5.23 ``ServerArgs.resolved_dict()`` plus
    ``"version"``), not vLLM's dev-mode ``{"vllm_config", ...}``."""
    return (isinstance(server_info, dict) and "vllm_config" not in server_info
            and "tp_size" in server_info and "version" in server_info)


def check_supported(text: Any, engine_url: str) -> str:
    """'' when ``text`` (``/server_info``'s ``version``) is a supported release, else the
    refusal, naming the engine, the version and the supported list."""
    base = parse(text)
    if base in SUPPORTED:
        return ""
    shown = repr(text) if text is not None else "no version"
    return (f"engine {engine_url} runs SGLang {shown}, which slotsyncd does not speak: "
            f"supported SGLang releases are {', '.join(SUPPORTED)} "
            "(docs/sglang-versions.md); a release whose weight-update code was not read may "
            "free the received tensors elsewhere, and the buffer fence would not hold")


def answer_refusal(error: str, engine_url: str) -> str:
    """The refusal for an engine told to be SGLang whose ``GET /server_info`` (the version
    step) failed with ``error`` (cut to 300 characters)."""
    error = error.removeprefix("version: ")  # (EngineError's step prefix)
    return (f"engine {engine_url} did not give its SGLang server arguments: GET /server_info "
            f"gave {error[:300]}; slotsyncd reads SGLang's version there and refuses an "
            "engine whose version it does not know")


def _int(info: dict, key: str, default: int) -> int:
    v = info.get(key, default)
    return v if isinstance(v, int) and not isinstance(v, bool) else default


def layout_refusal(info: Any, slot_size: int, engine_url: str) -> str:
    """'' when the SGLang server of ``info`` (``/server_info``) can load this slot's chunks
    through ``/update_weights_from_tensor``, else why not (refused before the pause):

    * ``tp_size`` must equal the slot's ``slot_size`` ranks: entry r of
      ``serialized_named_tensors`` is read by TP rank r (tp_worker.py
      ``deserialize_own_rank``);
    * ``pp_size`` > 1: entries are indexed by TP rank alone, every stage would read them;
    * ``dp_size`` > 1 (without attention DP on 0.5.20/0.5.21): the route asserts it
      (tokenizer_control_mixin.py L569-571, 0.5.23): one server per DP replica;
    * ``tokenizer_worker_num`` > 1, or a ``frontend`` other than ``python``: not read.
    """
    if not isinstance(info, dict):
        return f"engine {engine_url}: GET /server_info gave no SGLang server arguments"
    tp, pp, dp = _int(info, "tp_size", 1), _int(info, "pp_size", 1), _int(info, "dp_size", 1)
    attn_dp = bool(info.get("enable_dp_attention"))
    if pp > 1:
        return (f"engine {engine_url} runs SGLang with pp_size {pp}: its tensor update is "
                "indexed by TP rank only, so every pipeline stage would read the same entry; "
                "slotsyncd drives pp_size 1 only")
    if dp > 1 and not (attn_dp and not has(version_of(info), "soft_flush_failure")):
        return (f"engine {engine_url} runs SGLang with dp_size {dp}: "
                "/update_weights_from_tensor refuses data-parallel replicas; run one server "
                "per replica, each its own engine slot (docs/sglang.md)")
    if tp != slot_size:
        return (f"engine {engine_url} runs SGLang with tp_size {tp} but its slot has "
                f"{slot_size} ranks: entry r of the update goes to TP rank r, one per rank")
    workers = _int(info, "tokenizer_worker_num", 1)
    if workers > 1:
        return (f"engine {engine_url} runs SGLang with tokenizer_worker_num {workers}: "
                "slotsyncd drives a single tokenizer only (not read)")
    frontend = info.get("frontend", "python")
    if frontend != "python":
        return (f"engine {engine_url} runs SGLang's {frontend!r} front end: slotsyncd "
                "drives the python front end only (not read)")
    return ""


def features_markdown() -> str:
    """``FEATURES`` as the markdown table of docs/sglang.md."""
    rows = ["| feature | since | what it changes |", "| --- | --- | --- |"]
    rows += [f"| `{k}` | {f.since} | {f.what} |" for k, f in FEATURES.items()]
    return "\n".join(rows)
