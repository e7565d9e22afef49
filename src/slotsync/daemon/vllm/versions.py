"""Which vLLM versions slotsyncd speaks to, and which feature needs which version (I/O-free).

The daemon asks ``GET /version`` when it first meets an engine and again after a restart is
suspected (``update.BEGIN_STAGES``: ``version`` and ``version_again``); vLLM answers
``{"version": VLLM_VERSION}`` (vLLM 0.32 ``vllm/entrypoints/serve/instrumentator/basic.py``
``show_version``; ``VLLM_VERSION`` is ``vllm.version.__version__``, ``"dev"`` when vLLM's
build wrote no ``_version.py``). ``check_supported`` turns that answer into a refusal (a
message naming the engine, the version and the supported range) or None; ``feature_missing``
says whether one feature of ``FEATURES`` is there.

``FEATURES`` is the one table of what changed when; ``docs/vllm-versions.md`` carries it too
(``tests/unit/test_vllm_versions.py`` checks they agree). Each row says where its first version
comes from: ``checked in 0.32/0.33`` means the feature is in vLLM 0.32's and 0.33's source (the
two this project has), and its first version is the one the row names from the cited PR or
``vllm-contract.md``, not read from older code.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

SUPPORTED_MIN: tuple[int, int] = (0, 27)
SUPPORTED_MAX: tuple[int, int] = (0, 33)
"""``(major, minor)``: slotsyncd speaks the weight-transfer routes of vLLM 0.27 .. 0.33, any
patch, release candidate, dev or local build of those minors (vllm-contract.md)."""

_VERSION = re.compile(
    r"v?(?P<major>\d+)\.(?P<minor>\d+)(?:\.(?P<patch>\d+))?"
    r"(?P<pre>(?:a|b|rc)\d+)?(?:\.post\d+)?(?:\.dev\d+)?(?:\+[0-9A-Za-z.\-_]+)?"
)


@dataclass(frozen=True, slots=True)
class Version:
    """A parsed vLLM version: ``text`` as the server sent it, ``major``, ``minor``, ``patch``
    (0 when absent). Pre-releases, dev and local parts count as their minor (``0.33.0rc1``,
    ``0.32.1.dev12+gabc`` and ``0.32.0+cpu`` are 0.33, 0.32, 0.32)."""

    text: str
    major: int
    minor: int
    patch: int

    @property
    def minor_key(self) -> tuple[int, int]:
        """``(major, minor)``."""
        return (self.major, self.minor)

    @property
    def short(self) -> str:
        """``"0.32"``."""
        return f"{self.major}.{self.minor}"


def parse(text: str) -> Version | None:
    """``text`` (a PEP 440 version as vLLM writes it: ``0.32.0``, ``0.33.0rc1``,
    ``0.32.1.dev12+gabc``, ``0.32.0+cpu``; surrounding blanks ignored) as a ``Version``, or
    None when it is not one (``"dev"``, ``"garbage"``, ``""``)."""
    m = _VERSION.fullmatch(text.strip()) if isinstance(text, str) else None
    if m is None:
        return None
    return Version(text, int(m["major"]), int(m["minor"]), int(m["patch"] or 0))


@dataclass(frozen=True, slots=True)
class Feature:
    """One row of ``FEATURES``: ``first`` the first vLLM ``(major, minor)`` that has it;
    ``what`` what it is; ``before`` what a version before ``first`` does instead ('' when it
    has nothing in its place); ``source`` where ``first`` comes from; ``required``: slotsyncd
    needs it in every round (a version without it is refused)."""

    first: tuple[int, int]
    what: str
    before: str
    source: str
    required: bool = False


FEATURES: dict[str, Feature] = {
    "start_finish_sessions": Feature(
        first=(0, 21),
        what="start/finish sessions (`/start_weight_update` ... `/finish_weight_update`) "
        "around the chunks",
        before="has no start/finish sessions: each update_weights stands alone",
        source="vllm-contract.md; checked in 0.32/0.33 (`rl/online/api_router.py`)",
        required=True),
    "handle_args_only": Feature(
        first=(0, 22),
        what="handle values that are `reduce_tensor`'s args alone",
        before="takes (rebuild_fn, args) pairs as handle values (0.17-0.21)",
        source="vllm-contract.md (pairs in 0.17-0.21); checked in 0.32/0.33 "
        "(`weight_transfer/ipc_engine.py`)",
        required=True),
    "start_without_body": Feature(
        first=(0, 25),
        what="a `/start_weight_update` without a body",
        before="needs a JSON body `{}` at `/start_weight_update` (0.21-0.24)",
        source="vllm-contract.md; checked in 0.32/0.33 (`rl/online/api_router.py`)",
        required=True),
    "draft_sessions": Feature(
        first=(0, 26),
        what="draft-model sessions (`/start_draft_weight_update` ... `/update_weights` ... "
        "`/finish_weight_update`)",
        before="",
        source="issue 18 (vLLM 0.26+); the route checked in 0.32/0.33 "
        "(`rl/online/api_router.py`)"),
    "packed_in_init_info": Feature(
        first=(0, 27),
        what="`packed` in the `init_info` of `/init_weight_transfer_engine`",
        before="takes `packed` in each update_info (0.22-0.26)",
        source="vllm-contract.md; checked in 0.32/0.33 (`weight_transfer/ipc_engine.py` "
        "`IPCWeightTransferInitInfo`)",
        required=True),
    "list_update_info": Feature(
        first=(0, 29),
        what="a list-form `update_info` indexed by global worker rank "
        "(`dp_index * TP * PP + rank`), one entry per worker (rank-local payloads)",
        before="takes one update_info dict for every worker",
        source="vLLM PR 52497, fixed in 56950 (issue 18); checked in 0.32/0.33 "
        "(`weight_transfer/base.py` `WeightTransferUpdatePayload`)"),
    "weight_checker": Feature(
        first=(0, 32),
        what="`POST /weight_checker` (checksum / compare / reset)",
        before="",
        source="checked in 0.32/0.33 (`rl/online/api_router.py`); earlier versions not "
        "checked"),
    "world_size_include_dp": Feature(
        first=(0, 32),
        what="`GET /get_world_size?include_dp=true` (data-parallel ranks counted)",
        before="",
        source="checked in 0.32/0.33 (`rl/online/api_router.py`); earlier versions not "
        "checked (FastAPI ignores a query parameter a route does not declare)"),
}
"""Feature name -> ``Feature``: the single source of truth for which vLLM version has what
(``docs/vllm-versions.md`` is checked against it)."""


def _range() -> str:
    lo, hi = SUPPORTED_MIN, SUPPORTED_MAX
    return f"{lo[0]}.{lo[1]}-{hi[0]}.{hi[1]}"


def _as_version(version: str | Version | None) -> Version | None:
    return version if isinstance(version, Version) or version is None else parse(version)


def feature_missing(version: str | Version | None, feature: str) -> str | None:
    """Why an engine of vLLM ``version`` (its ``/version`` text, e.g.
    ``EngineSession.vllm_version``, or a parsed ``Version``) lacks ``feature`` (a key of
    ``FEATURES``), or None when it has it. An unknown or unparsable version lacks every
    feature (the daemon never guesses).

    Raises:
        KeyError: ``feature`` is not in ``FEATURES``.
    """
    f = FEATURES[feature]
    v = _as_version(version)
    need = f"{f.first[0]}.{f.first[1]}"
    if v is None:
        return (f"{f.what} needs vLLM {need} or later, and the engine's vLLM version is not "
                f"known ({version!r})")
    if v.minor_key >= f.first:
        return None
    instead = f", which {f.before}" if f.before else ""
    return f"{f.what} needs vLLM {need} or later; the engine runs vLLM {v.text}{instead}"


def check_supported(version_text: Any, engine_url: str = "the engine") -> str | None:
    """Why slotsyncd refuses an engine whose ``/version`` said ``version_text`` (the
    ``"version"`` value; anything else, a non-string, is refused as unknown), or None when
    it is in ``SUPPORTED_MIN`` .. ``SUPPORTED_MAX``. The message names ``engine_url``, what
    was received, and the supported range; an older version's names each required feature
    it lacks, the latest first."""
    v = parse(version_text) if isinstance(version_text, str) else None
    speaks = f"slotsyncd speaks the weight-transfer routes of vLLM {_range()}"
    if v is None:
        return (f"vLLM version {version_text!r} at {engine_url} is not a version slotsyncd "
                f"knows: {speaks}; check what the server at {engine_url} is, or run a "
                f"supported vLLM")
    if v.minor_key > SUPPORTED_MAX:
        return (f"vLLM {v.text} at {engine_url} is newer than slotsyncd knows: {speaks}, "
                f"and {v.short}'s are not checked; run vLLM {_range()} or a slotsyncd that "
                f"supports {v.short}")
    if v.minor_key < SUPPORTED_MIN:
        lacking = [f for f in FEATURES.values() if f.required and v.minor_key < f.first]
        lacking.sort(key=lambda f: f.first, reverse=True)
        whys = "; ".join(f"{f.before}, where slotsyncd needs {f.what} "
                         f"({f.first[0]}.{f.first[1]}+)" for f in lacking)
        return (f"vLLM {v.text} at {engine_url}: {speaks}; vLLM {v.short} {whys}; upgrade "
                f"vLLM to {_range()}, or sync that engine's weights without slotsyncd")
    return None


def answer_refusal(error: str, engine_url: str) -> str:
    """The refusal for a ``GET /version`` that gave no version: ``error`` is what the call
    got (``"HTTP 404: Not Found"``, ``"HTTP 200: not JSON: '...'"``, no answer), cut to
    300 characters, at ``engine_url``."""
    error = error.removeprefix("version: ")  # (EngineError's route prefix)
    return (f"engine {engine_url} did not say its vLLM version: GET /version gave "
            f"{error[:300]}; slotsyncd speaks the weight-transfer routes of vLLM {_range()} "
            f"and refuses an engine whose version it does not know")


def version_of(result: Any) -> Any:
    """The ``"version"`` value of a ``/version`` answer (``{"version": "0.32.0"}``), or
    ``result`` itself when it has no such key (so a refusal names what came back)."""
    if isinstance(result, dict) and "version" in result:
        return result["version"]
    return result


def features_markdown() -> str:
    """``FEATURES`` as the Markdown table ``docs/vllm-versions.md`` holds (one row per
    feature, in ``FEATURES``' order; a unit test checks the two agree)."""
    lines = ["| feature | first vLLM | what | before it | slotsyncd needs it | source |",
             "|---|---|---|---|---|---|"]
    for name, f in FEATURES.items():
        lines.append(f"| `{name}` | {f.first[0]}.{f.first[1]} | {f.what} | "
                     f"{f.before or '-'} | {'every round' if f.required else 'when used'} | "
                     f"{f.source} |")
    return "\n".join(lines) + "\n"
