"""The GPU data path's logic, on CPU: pooled host buffers, batched copies overlapping the IO, and their order.

There is no GPU here, so the tests route CPU tensors through the path device tensors take (``staged``) with a
copier whose copies happen only when their ticket is waited for, as an asynchronous device copy does: a missing
or late wait then gives wrong bytes (the buffers hold whatever was there), so a round trip that comes out equal
proves the order, not luck. The log of copies, waits, writes and reads checks the overlap itself.
"""

from __future__ import annotations

import pytest
import torch
from dist_helpers import run_ranks
from policies import small_chunks

import arrayckpt
from arrayckpt._io import pools
from arrayckpt._read import load as load_module
from arrayckpt._torch import transfer
from arrayckpt._write import packed

BATCH = 64 << 10


class DeferredCopier:
    """Copies that happen when waited for (not before), logged as ("copy", n) and ("wait", n)."""

    def __init__(self, log: list) -> None:
        self.log = log
        self.issued = 0

    def copy(self, pairs):
        number, pending = self.issued, list(pairs)
        self.issued += 1
        self.log.append(("copy", number))
        log = self.log

        class Ticket:
            done = False

            def wait(self) -> None:
                if not self.done:
                    for destination, source in pending:
                        destination.copy_(source)
                    self.done = True
                    log.append(("wait", number))

        return Ticket()


@pytest.fixture
def deferred(monkeypatch):
    """Every tensor staged, through a :class:`DeferredCopier`, 64 KiB batches, a fresh unpinned pool; yields the
    log (with ("write", keys) for each batch of writes)."""
    log: list = []
    copier = DeferredCopier(log)
    monkeypatch.setattr(transfer, "_pool", transfer.HostPool())
    real_write = packed.write_all  # chunk_destination's

    def write_all(jobs, context, where):
        log.append(("write", sorted({job.key for job in jobs})))
        return real_write(jobs, context, where)

    monkeypatch.setattr(packed, "write_all", write_all)
    with transfer.transfer_settings(staged=lambda t: True, copier=lambda device: copier, batch_bytes=BATCH,
                                    pinned=False):
        yield log


def _state() -> dict:
    generator = torch.Generator().manual_seed(0)
    big = torch.randn(96, 512, generator=generator)  # 192 KiB: split into pieces at chunk rows
    return {
        "big": big,
        "t": torch.randn(40, 64, generator=generator).t(),  # not contiguous
        "half": torch.randn(300, 17, generator=generator).to(torch.bfloat16),
        "ints": torch.arange(1000, dtype=torch.int64),
        "flag": torch.tensor([True, False, True]),
        "scalar": torch.tensor(2.5),
        "empty": torch.zeros(0, 3),
        "step": 7,
    }


def _assert_equal(got: dict, want: dict) -> None:
    for key, value in want.items():
        if isinstance(value, torch.Tensor):
            assert got[key].dtype == value.dtype and torch.equal(got[key], value), key
        else:
            assert got[key] == value, key


def _loaded(path, like: dict) -> dict:
    """What ``path`` holds, loaded the plain way (host tensors read in place, nothing staged)."""
    target = {key: torch.empty_like(v) if isinstance(v, torch.Tensor) else None for key, v in like.items()}
    with transfer.transfer_settings(staged=lambda t: False):
        arrayckpt.load(target, path)
    return target


def test_save_copies_in_batches_each_written_while_the_next_copies(tmp_path, deferred):
    state = _state()
    small_chunks(4 << 10, 16 << 10).save(state, tmp_path / "c")
    pool = transfer.host_pool()
    copies = [entry for entry in deferred if entry[0] == "copy"]
    assert len(copies) >= 4  # the state (~300 KiB) in 64 KiB batches
    # Batch k + 1 is issued before batch k is waited for and written: the copy overlaps the write.
    order = [entry for entry in deferred if entry[0] in ("copy", "wait")]
    assert order[:3] == [("copy", 0), ("copy", 1), ("wait", 0)]
    for number in range(len(copies) - 1):
        assert order.index(("copy", number + 1)) < order.index(("wait", number))
        wait = deferred.index(("wait", number))
        assert deferred[wait + 1][0] == "write"  # each batch is written right after its copies are done
    # Host memory: about two batches (plus one piece that cannot be split further), not the state.
    state_bytes = sum(v.numel() * v.element_size() for v in state.values() if isinstance(v, torch.Tensor))
    assert pool.peak_bytes <= 3 * BATCH < state_bytes
    assert pool.in_use == 0  # every buffer given back
    _assert_equal(_loaded(tmp_path / "c", state), state)
    assert arrayckpt.verify(tmp_path / "c").ok


def test_pool_buffers_are_reused_by_the_next_save_and_load(tmp_path, deferred):
    state = _state()
    arrayckpt.save(state, tmp_path / "a")
    pool = transfer.host_pool()
    first = pool.allocations
    assert first > 0
    arrayckpt.save(state, tmp_path / "b")
    assert pool.allocations == first  # same sizes: nothing allocated again
    target = {key: torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0 for key, v in state.items()}
    arrayckpt.load(target, tmp_path / "b")
    loaded = pool.allocations
    arrayckpt.load(target, tmp_path / "a")
    assert pool.allocations == loaded
    _assert_equal(target, state)
    pool.clear()
    with transfer.transfer_settings(keep_bytes=0):  # nothing kept idle: every save allocates
        arrayckpt.save(state, tmp_path / "c")
        again = pool.allocations
        arrayckpt.save(state, tmp_path / "d")
        assert pool.allocations > again > first


def test_load_reads_each_batch_while_the_previous_one_copies(tmp_path, deferred, monkeypatch):
    state = _state()
    arrayckpt.save(state, tmp_path / "c")
    real_read = load_module.read

    def read(checkpoint, requests, *, execute):
        deferred.append(("read", sorted({r.key for r in requests})))
        return real_read(checkpoint, requests, execute=execute)

    monkeypatch.setattr(load_module, "read", read)
    deferred.clear()
    transfer.host_pool().reset_counts()
    target = {key: torch.full_like(v, 3) if isinstance(v, torch.Tensor) else 0 for key, v in state.items()}
    arrayckpt.load(target, tmp_path / "c")
    _assert_equal(target, state)
    reads = [i for i, entry in enumerate(deferred) if entry[0] == "read"]
    copies = [entry[1] for entry in deferred if entry[0] == "copy"]
    assert len(reads) == len(copies) >= 3
    for k, number in enumerate(copies[:-1]):  # batch k + 1 is read after batch k's copies are issued, before
        issued, waited = deferred.index(("copy", number)), deferred.index(("wait", number))  # they are waited for
        assert issued < reads[k + 1] < waited
    assert transfer.host_pool().peak_bytes <= 3 * BATCH
    assert transfer.host_pool().in_use == 0


def test_dcp_load_through_the_reader_fills_device_targets_in_batches(tmp_path, deferred, monkeypatch):
    """``dcp.load`` with :class:`ArrayckptReader`: device targets go through the same pooled, pipelined path."""
    import torch.distributed.checkpoint as dcp

    from arrayckpt._integrations import dcp_reader
    from arrayckpt.dcp import ArrayckptReader

    state = _state()
    arrayckpt.save(state, tmp_path / "c")
    real_read = dcp_reader.read

    def read(checkpoint, requests, **kwargs):
        deferred.append(("read", sorted({r.key for r in requests})))
        return real_read(checkpoint, requests, **kwargs)

    monkeypatch.setattr(dcp_reader, "read", read)
    deferred.clear()
    transfer.host_pool().reset_counts()
    target = {key: torch.full_like(v, 3) if isinstance(v, torch.Tensor) else 0 for key, v in state.items()}
    dcp.load(target, storage_reader=ArrayckptReader(tmp_path / "c"))
    _assert_equal(target, state)
    copies = [entry[1] for entry in deferred if entry[0] == "copy"]
    reads = [i for i, entry in enumerate(deferred) if entry[0] == "read" and entry[1]]
    assert len(copies) >= 3 and len(reads) >= len(copies)
    for number in copies[:-1]:  # the next batch is read while this one's copies are in flight
        issued, waited = deferred.index(("copy", number)), deferred.index(("wait", number))
        assert any(issued < i < waited for i in reads)
    assert 0 < transfer.host_pool().peak_bytes <= 3 * BATCH
    assert transfer.host_pool().in_use == 0


def test_atomic_load_copies_nothing_until_every_read_passed(tmp_path, deferred):
    state = _state()
    arrayckpt.save(state, tmp_path / "c")
    chunk = next(path for path in (tmp_path / "c" / "ints").iterdir() if path.name != "zarr.json")
    data = chunk.read_bytes()
    chunk.write_bytes(bytes([data[0] ^ 0xFF]) + data[1:])  # damage the last-read tensor
    deferred.clear()
    target = {key: torch.full_like(v, 3) if isinstance(v, torch.Tensor) else 0 for key, v in state.items()}
    before = {key: v.clone() for key, v in target.items() if isinstance(v, torch.Tensor)}
    with pytest.raises(arrayckpt.CorruptCheckpointError, match="ints"):
        arrayckpt.load(target, tmp_path / "c", atomic=True)
    assert not [entry for entry in deferred if entry[0] == "copy"]
    _assert_equal({k: v for k, v in target.items() if k in before}, before)
    assert transfer.host_pool().in_use == 0
    # Without atomic=True the batches copied before the damage was found are named as overwritten.
    with pytest.raises(arrayckpt.CorruptCheckpointError) as failure:
        arrayckpt.load(target, tmp_path / "c")
    overwritten = failure.value.overwritten_keys
    assert "big" in overwritten and "ints" not in overwritten
    assert torch.equal(target["big"][:16], state["big"][:16])  # its first rows: copied in an earlier batch
    assert torch.equal(target["ints"], before["ints"])  # its batch failed to read: never copied
    assert transfer.host_pool().in_use == 0


def test_async_save_waits_for_its_staging_copies(tmp_path, deferred):
    state = _state()
    original = _state()
    handle = arrayckpt.async_save(state, tmp_path / "c")
    assert [entry for entry in deferred if entry[0] == "wait"]  # waited for before async_save returned
    for value in state.values():  # training changes its tensors at once
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            value.add_(1)
    handle.wait()
    _assert_equal(_loaded(tmp_path / "c", state), original)  # what the tensors held when async_save returned


def test_batches_split_by_bytes_in_order():
    sizes = [10, 50, 30, 100, 5, 5]
    groups = pools.batches(sizes, lambda n: n, 60)
    assert groups == [[10, 50], [30], [100], [5, 5]]
    assert pools.batches([], lambda n: n, 60) == []


def test_pool_size_classes_waste_at_most_an_eighth():
    pool = transfer.HostPool()
    for nbytes in (1, 65537, 1_000_000, 123_456_789):
        with transfer.transfer_settings(pinned=False):
            buffer = pool.take(nbytes)
        assert nbytes <= buffer.numel() <= max(64 << 10, nbytes * 9 // 8)
        pool.give([buffer])
    assert pool.in_use == 0


def _sharded_ranks(rank: int, world: int, path: str) -> bool:
    """Each rank saves and loads its row shard through the staged path, in batches smaller than its shard."""
    log: list = []
    copier = DeferredCopier(log)
    full = torch.arange(64 * 300, dtype=torch.float32).reshape(64, 300)
    rows = slice(rank * 32, rank * 32 + 32)
    with transfer.transfer_settings(staged=lambda t: True, copier=lambda device: copier, batch_bytes=8 << 10,
                                    pinned=False):
        small_chunks(4 << 10, 8 << 10).save({"w": arrayckpt.Shard(full[rows].clone(), (64, 300), (rank * 32, 0))},
                                             path)
        # Loaded onto another sharding: columns, each rank half of them.
        cols = slice(rank * 150, rank * 150 + 150)
        target = torch.zeros(64, 150)
        arrayckpt.load({"w": arrayckpt.Shard(target, (64, 300), (0, rank * 150))}, path)
    return torch.equal(target, full[:, cols]) and sum(entry[0] == "copy" for entry in log) >= 2


@pytest.mark.slow
def test_sharded_save_and_resharded_load_through_the_staged_path(tmp_path):
    assert run_ranks(2, _sharded_ranks, str(tmp_path / "c")) == [True, True]


def test_async_save_issues_device_copies_while_it_still_walks_the_state(tmp_path, deferred, monkeypatch, tuned):
    """Copies start in batches as the state is described (overlapping the walk), and every one is waited for before
    async_save returns, also when describing fails half-way."""

    tuned(device_issue_bytes=8 << 10)
    state = _state()
    original = _state()
    arrayckpt.async_save(state, tmp_path / "c").wait()
    copies = [i for i, entry in enumerate(deferred) if entry[0] == "copy"]
    waits = [i for i, entry in enumerate(deferred) if entry[0] == "wait"]
    assert len(copies) >= 3 and copies[1] < waits[0]  # a second batch issued before the first was waited for
    assert len(waits) == len(copies)
    _assert_equal(_loaded(tmp_path / "c", state), original)
    deferred.clear()
    with pytest.raises(arrayckpt.PickleNotAllowedError):
        arrayckpt.async_save({**state, "z_object": {1, 2}}, tmp_path / "d")  # fails after the tensors
    assert {e[1] for e in deferred if e[0] == "copy"} == {e[1] for e in deferred if e[0] == "wait"} != set()


def test_load_into_parameters_that_require_grad(tmp_path, deferred):
    """Device targets are often a model's parameters: the staged path fills them outside autograd (an in-place copy
    into a leaf that requires grad would raise)."""
    model = torch.nn.Linear(64, 32)
    arrayckpt.save({"model": model}, tmp_path / "c")
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.zero_()
    arrayckpt.load({"model": dict(model.named_parameters())}, tmp_path / "c")
    assert all(torch.equal(model.state_dict()[k], v) for k, v in saved.items())
    assert all(p.requires_grad for p in model.parameters())


def test_pinned_size_classes_are_what_torch_pins_and_batches_fit_them():
    """torch's pinned allocator reserves powers of two; the pool's counts must be that memory, and a full batch
    (its tensors at 64-byte offsets) must fit the batch size, not spill into the next power of two."""
    assert [transfer._size_class(n, pinned=True) for n in (1, 65537, 256 << 20, (256 << 20) + 1)] == \
        [64 << 10, 128 << 10, 256 << 20, 512 << 20]
    sizes = [1000, 3000, 60_000, 100]  # aligned: 1024, 3008, 60032, 128
    assert all(sum(transfer.aligned(n) for n in group) <= 64 << 10
               for group in pools.batches(sizes, transfer.aligned, 64 << 10))


def test_row_pieces_fit_the_budget_at_whole_multiples():
    from arrayckpt._layout.box import Box, row_pieces

    box = Box((8, 0), (100, 4))
    assert row_pieces(box, 16, 10_000) == [box]  # fits
    pieces = row_pieces(box, 16, 16 * 30, multiple=8)  # 30 rows fit: 24 (3 chunks of 8) per piece
    assert [p.offset[0] for p in pieces] == [8, 32, 56, 80, 104] and pieces[-1].stop[0] == 108
    assert all(p.shape[0] * 16 <= 16 * 30 for p in pieces)
    assert row_pieces(box, 16, 1, multiple=8)[0].shape[0] == 8  # never less than one multiple
    assert row_pieces(Box((), ()), 0, 1) == [Box((), ())]


def test_deepspeed_flat_reads_stage_in_pooled_batches_and_give_them_back(tmp_path, monkeypatch, tuned):
    """``arrayckpt.deepspeed.load`` reads partitions (flat element ranges) through pooled host buffers, a batch at a
    time, handed back after each batch, also when a read fails; one bigger than a batch in a buffer of its own."""
    from arrayckpt._integrations import deepspeed_engine
    from arrayckpt._read.checkpoint import open_checkpoint

    monkeypatch.setattr(transfer, "_pool", transfer.HostPool())
    tuned(deepspeed_read_batch_bytes=BATCH)
    generator = torch.Generator().manual_seed(1)
    state = {"a": torch.randn(96, 512, generator=generator), "s": torch.tensor(3.5),
             "v": torch.arange(5000, dtype=torch.float64)}
    arrayckpt.save(state, tmp_path / "c")
    slices = [("a", 700, 3000), ("a", 0, 0), ("s", 0, 1), ("v", 4999, 1), ("a", 20000, 20000), ("v", 10, 4000)]
    calls = []
    real_read = deepspeed_engine.read

    def read(checkpoint, requests):
        calls.append(len(requests))
        if len(calls) == 3 and failing:
            raise arrayckpt.CorruptCheckpointError("damaged")
        return real_read(checkpoint, requests)

    monkeypatch.setattr(deepspeed_engine, "read", read)
    for failing in (False, True):
        got, calls[:] = {}, []
        reads = deepspeed_engine.FlatReads(open_checkpoint(tmp_path / "c"))
        for key, start, numel in slices:
            reads.add(key, start, numel,
                      lambda piece, at=(key, start, numel), into=got: into.__setitem__(at, piece.clone()))
        if failing:
            with pytest.raises(arrayckpt.CorruptCheckpointError):
                reads.run()
        else:
            reads.run()
            for key, start, numel in slices:
                assert torch.equal(got[key, start, numel], state[key].reshape(-1)[start:start + numel])
            assert len(calls) >= 3  # in batches of at most BATCH (a bigger slice alone)
        assert transfer.host_pool().in_use == 0 and reads.planned == []
    assert transfer.host_pool().allocations <= 3  # the batches' buffers are reused
    assert transfer.host_pool().peak_bytes <= BATCH  # a slice bigger than a batch is not pooled (pinned, rounded up)
