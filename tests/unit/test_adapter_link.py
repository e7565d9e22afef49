"""The daemon takes a rank's adapter part as the safetensors file itself (issue 36, the vLLM
path's fast case): a rank that holds every tensor whole lays its shared-memory segment out as
a complete ``adapter_model.safetensors`` and seals it (``protocol/rank/adapters/part.py``);
``write_adapter_folder`` (``daemon/vllm/adapters.py``) with ``PartReader.take``
(``daemon/service/adapter_io.py``) hard-links it into the version's folder instead of copying
and hashing it, and only when nothing can change it any more. Segments made by the rank's own
``AdapterPart``; folders on ``/dev/shm`` (the link needs one filesystem).

What each test can fail on: the folder's file is the segment's inode (linked) or another
(copied); the bytes read back with the safetensors package; ``PartReader.taken`` says why a
segment was not linked; a segment a process can still write is never linked, and a byte it
changed after the rank's digests is caught by the copy's sha256 check.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
safetensors_torch = pytest.importorskip("safetensors.torch")

from lora_plans import lora_tensors, peft_config, reader, split_plan  # noqa: E402

from slotsync.daemon.core.adapters.gather import gather  # noqa: E402
from slotsync.daemon.service.adapter_io import PartReader  # noqa: E402
from slotsync.daemon.vllm import adapters  # noqa: E402
from slotsync.daemon.vllm.adapters import (  # noqa: E402
    TENSORS_FILE,
    AdapterDataError,
    linkable,
    write_adapter_folder,
)
from slotsync.protocol import wire  # noqa: E402
from slotsync.protocol.rank.adapters.inputs import part_tensors  # noqa: E402
from slotsync.protocol.rank.adapters.part import AdapterPart  # noqa: E402
from slotsync.protocol.topology import EngineSlot  # noqa: E402
from slotsync.protocol.wire.adapter import file_header  # noqa: E402

SHM = Path("/dev/shm")
CPU = torch.device("cpu")


@pytest.fixture
def shm_root() -> Iterator[Path]:
    """A folder on /dev/shm's tmpfs, as the daemon's adapter_dir there."""
    root = Path(tempfile.mkdtemp(prefix="test-adapter-link-", dir=SHM))
    yield root
    shutil.rmtree(root, ignore_errors=True)


class Rank:
    """One rank's part made by the rank's own code: filled (digests taken), its begin, the
    daemon's plan of it, and the handle for ``transport`` (``"host"`` seals the segment)."""

    def __init__(self, tensors: dict, transport: str = "host", before_handle=None,
                 config: dict | None = None) -> None:
        self.parts = part_tensors(tensors, None, rank=0, slot=EngineSlot(0, 1), transport="shm",
                                  device=CPU)
        self.part = AdapterPart(self.parts, rank=0, transport="shm", device=CPU, owned=[])
        digests = self.part.fill()
        begin = wire.AdapterBegin(
            update_id=1, lora_name="math", version=3,
            config_json=json.dumps(config or peft_config()),
            tensors=[wire.AdapterTensor(t.name, t.dtype, list(t.shape), 0, t.shape[0], d)
                     for t, d in zip(self.parts, digests, strict=True)])
        self.plan = gather({0: begin})
        self.path = SHM / self.part.segment.name
        if before_handle is not None:
            before_handle(self)
        self.handle = self.part.handle(transport)

    def free(self) -> None:
        self.part.free()


@pytest.fixture
def ranks() -> Iterator[list[Rank]]:
    made: list[Rank] = []
    yield made
    for r in made:
        r.free()


def _boom(*_a, **_k):
    raise AssertionError("the part was copied")


def _equal(file: Path, tensors: dict) -> None:
    back = safetensors_torch.load_file(file)
    assert set(back) == set(tensors)
    for name, t in tensors.items():
        assert back[name].dtype == t.dtype and torch.equal(back[name], t), name


def test_a_sealed_whole_part_is_linked_as_the_file_and_outlives_the_ranks_name(
        shm_root: Path, ranks: list[Rank], monkeypatch) -> None:
    """One rank holds every tensor whole: its segment is the safetensors file (the header
    the daemon expects, then the part; mode 0444); the daemon links it (no copy, no hash:
    ``_copy_parts`` raises here), the folder's file is the segment's inode; after the rank
    frees its part the name is gone from /dev/shm and the daemon's link keeps the bytes."""
    tensors = lora_tensors(r=8, seed=5)
    rank = Rank(tensors)
    ranks.append(rank)
    st = rank.path.stat()
    assert stat.S_IMODE(st.st_mode) == 0o444
    assert rank.handle.offset == len(rank.part.header) > 0
    assert st.st_size == rank.handle.offset + rank.handle.nbytes
    assert linkable(rank.plan) == (0, rank.part.header)
    monkeypatch.setattr(adapters, "_copy_parts", _boom)
    with PartReader({0: rank.handle}) as r:
        folder = write_adapter_folder(shm_root, rank.plan, r.read, r.take)
    assert r.taken == {0: ""}
    file = folder / TENSORS_FILE
    assert (file.stat().st_ino, file.stat().st_nlink) == (st.st_ino, 2)
    assert (folder / "adapter_config.json").read_text() == rank.plan.config_json
    _equal(file, tensors)
    rank.free()
    assert not rank.path.exists() and file.stat().st_nlink == 1
    _equal(file, tensors)


def test_a_segment_a_process_can_still_write_is_copied_and_a_change_is_caught(
        shm_root: Path, ranks: list[Rank]) -> None:
    """A process that opened the rank's segment for writing before the seal and still holds
    it: the daemon gets no read lease, so it copies and hashes instead of linking (the
    reason kept in ``taken``); a byte that process changes after the rank's digests is then
    caught: ``AdapterDataError`` naming the tensor and the rank, no folder left."""
    tensors = lora_tensors(r=8, seed=6)
    writers: list[int] = []
    rank = Rank(tensors, before_handle=lambda rk: writers.append(os.open(rk.path, os.O_RDWR)))
    ranks.append(rank)
    (fd,) = writers
    try:
        assert stat.S_IMODE(rank.path.stat().st_mode) == 0o444  # (sealed, yet still open)
        with PartReader({0: rank.handle}) as r:
            folder = write_adapter_folder(shm_root, rank.plan, r.read, r.take)
        assert "open for writing" in r.taken[0], r.taken
        assert (folder / TENSORS_FILE).stat().st_ino != rank.path.stat().st_ino
        _equal(folder / TENSORS_FILE, tensors)
        shutil.rmtree(folder)
        victim = rank.plan.tensors[3]
        os.pwrite(fd, b"\xff\xff", rank.handle.offset + victim.parts[0].offset + 2)
        with PartReader({0: rank.handle}) as r, pytest.raises(AdapterDataError) as e:
            write_adapter_folder(shm_root, rank.plan, r.read, r.take)
        assert (e.value.tensor, e.value.rank) == (victim.name, 0)
        assert os.listdir(shm_root) == []
    finally:
        os.close(fd)


@pytest.mark.parametrize("case", ["unsealed", "two links", "other fs"])
def test_a_segment_that_is_not_exactly_the_sealed_file_is_copied_and_says_why(
        shm_root: Path, tmp_path: Path, ranks: list[Rank], case: str) -> None:
    """Each check of ``PartReader.take`` refuses the link, naming why, and the folder is
    then copied (another inode) and reads back equal: a segment still writable (the
    ``"device"`` handle is not sealed), one with a second link, and an adapter folder on
    another filesystem than /dev/shm."""
    tensors = lora_tensors(r=8, seed=7)
    rank = Rank(tensors, "device" if case == "unsealed" else "host")
    ranks.append(rank)
    root = shm_root
    want = {"unsealed": "did not seal", "two links": "2 links", "other fs": "adapter_dir"}[case]
    if case == "two links":
        os.link(rank.path, shm_root / "extra")
    if case == "other fs":
        if os.stat(tmp_path).st_dev == os.stat(SHM).st_dev:
            pytest.skip("the temp folder is on /dev/shm's filesystem")
        root = tmp_path
    with PartReader({0: rank.handle}) as r:
        folder = write_adapter_folder(root, rank.plan, r.read, r.take)
    assert want in r.taken[0], r.taken
    assert (folder / TENSORS_FILE).stat().st_ino != rank.path.stat().st_ino
    _equal(folder / TENSORS_FILE, tensors)


@pytest.mark.skipif(os.geteuid() != 0, reason="becoming another uid needs root")
def test_a_daemon_of_another_uid_than_the_ranks_is_told_why_it_cannot_link(
        shm_root: Path, ranks: list[Rank]) -> None:
    """The kernel grants a lease (``F_SETLEASE``) only on a file of the caller's uid, and
    with ``fs.protected_hardlinks`` links a read-only file only for its owner: a daemon of
    another uid (systemd's ``User=slotsync``, the ranks another user) copies, and ``take``
    says why and what to do. ``take`` runs in a child that became uid 4242 (no
    capabilities left)."""
    rank = Rank(lora_tensors(r=8, seed=13))
    ranks.append(rank)
    dest = shm_root / "theirs"
    dest.mkdir()
    os.chown(dest, 4242, 4242)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # (the child: a daemon of uid 4242)
        try:
            os.close(r)
            os.setgroups([])
            os.setgid(4242)
            os.setuid(4242)
            with PartReader({0: rank.handle}) as reader_:
                why = reader_.take(0, dest / TENSORS_FILE, rank.part.header)
            os.write(w, why.encode())
        finally:
            os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        why = f.read().decode()
    os.waitpid(pid, 0)
    assert why.startswith(f"no read lease on segment {rank.handle.segment!r}"), why
    assert (f"the segment is uid {os.geteuid()}'s and the daemon runs as uid 4242" in why
            and "run the daemon as the trainer ranks' user to link" in why), why
    assert not (dest / TENSORS_FILE).exists()


def test_a_segment_without_the_plans_header_is_not_linked(shm_root: Path, ranks: list[Rank]
                                                         ) -> None:
    """``take`` with a header other than the segment's first bytes links nothing and says
    so (the daemon's header comes from the plan: names, dtypes, shapes, order)."""
    rank = Rank(lora_tensors(r=8, seed=11))
    ranks.append(rank)
    dest = shm_root / "probe"
    with PartReader({0: rank.handle}) as r:
        why = r.take(0, dest, b"X" + rank.part.header[1:])
    assert "does not start with the safetensors header" in why and not dest.exists()


def test_a_handle_at_offset_0_is_not_linked_and_its_bytes_are_checked(
        shm_root: Path, ranks: list[Rank]) -> None:
    """A handle that does not start after the header (an older publisher lays its part out
    at offset 0) is not linked; here it covers other bytes than the part, which the copy's
    sha256 check refuses."""
    rank = Rank(lora_tensors(r=8, seed=8))
    ranks.append(rank)
    h = wire.ShmHandle(segment=rank.handle.segment, offset=0, nbytes=rank.handle.nbytes)
    with PartReader({0: h}) as r, pytest.raises(AdapterDataError):
        write_adapter_folder(shm_root, rank.plan, r.read, r.take)
    assert "offset 0" in r.taken[0]


def test_linkable_only_when_one_rank_holds_every_tensor_whole_without_padding() -> None:
    """``linkable``: one holder of whole tensors whose sizes need no padding -> that rank and
    the wire's header; tensors split over two ranks, or one whose size would leave a gap
    before the next (not a multiple of 256 bytes), -> None."""
    tensors = lora_tensors(r=8, seed=9)
    plan, _, begins = split_plan(tensors, peft_config(), ranks=1)
    assert linkable(plan) == (0, file_header([(t.name, t.dtype, t.shape) for t in begins[0]]))
    assert linkable(split_plan(tensors, peft_config(), ranks=2)[0]) is None
    odd = {"base_model.model.x.lora_A.weight": torch.ones(3, 5, dtype=torch.bfloat16),
           **tensors}
    assert linkable(split_plan(odd, peft_config(), ranks=1)[0]) is None
    last = {**tensors, "base_model.model.x.lora_A.weight": torch.ones(3, 5,
                                                                      dtype=torch.bfloat16)}
    assert linkable(split_plan(last, peft_config(), ranks=1)[0]) is not None


def test_the_file_header_is_what_safetensors_reads(tmp_path: Path) -> None:
    """``wire.adapter.file_header`` + the tensors back to back is a file the safetensors
    package reads back equal (its 256-byte padding included), and the copied folder of the
    same plan holds the same tensors."""
    tensors = lora_tensors(r=8, seed=10)
    plan, buffers, begins = split_plan(tensors, peft_config(), ranks=1)
    header = file_header([(t.name, t.dtype, t.shape) for t in begins[0]])
    assert header is not None and len(header) % wire.ADAPTER_ALIGN == 0
    (tmp_path / "f.safetensors").write_bytes(header + buffers[0])
    _equal(tmp_path / "f.safetensors", tensors)
    folder = write_adapter_folder(tmp_path, plan, reader(buffers))
    _equal(folder / TENSORS_FILE, tensors)


def test_the_daemon_says_whether_its_adapter_dir_can_take_links(shm_root: Path,
                                                                 tmp_path: Path) -> None:
    """``AdapterIO.links``: True for an ``adapter_dir`` on /dev/shm's filesystem, False for
    one elsewhere (the start's ``adapter_dir`` log line) or one that does not exist."""
    from slotsync.daemon.service.adapter_io import AdapterIO

    assert AdapterIO(shm_root).links() is True
    assert AdapterIO(tmp_path / "missing").links() is False
    if os.stat(tmp_path).st_dev != os.stat(SHM).st_dev:
        assert AdapterIO(tmp_path).links() is False
