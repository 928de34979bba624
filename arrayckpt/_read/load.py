"""``load``: read a checkpoint in place into the tensors of a state, then hand state dicts back.

An alias (a tensor the saved state held under two keys, stored once: tied weights) fills the state's leaf of its key
from its target's array. Where the state's leaves of the alias and of its target are themselves one tensor (the
model being loaded ties them too), the alias's leaf is filled by the target's read and not read again; where they
are distinct tensors, each is filled.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, cast

import numpy as np
import torch

from .._errors import ArrayckptError, CorruptCheckpointError, KeyMismatchError, StateError
from .._format.dtypes import dtype_of_numpy
from .._format.jsontypes import JSON
from .._format.keys import Key, dotted, prefix_parts
from .._format.manifest import AliasEntry, ArrayEntry, Entry, PerRankEntry, PickleEntry, ValueEntry
from .._format.values import decode_value
from .._io.arrays import ArrayIO, collector_paused, read_into
from .._layout.box import Box
from .._read.checkpoint import open_location, stored_of
from .._read.reader import ChainRead, Execute, Request, read
from .._read.stored import StoredCheckpoint
from .._storage import Location, parse_location, parse_roots
from .._storage.base import Opened
from .._storage.shared import opened_from_bytes, read_root_bytes, shares_root
from .._torch.aliases import same_tensor
from .._torch.dist import Group, resolve_group
from .._torch.dtypes import torch_dtype
from .._torch.readonce import split_reads
from .._torch.shards import PerRank, Shard, to_local_box
from .._torch.state import Leaf, StatefulNode, Walk, walk
from .._torch.tensors import check_loadable, overlaps_itself, writable_numpy
from .._torch.transfer import is_staged
from .deviceload import DeviceLoads
from .keyhint import prefix_hint
from .perrank import PerRankPolicy, check_policy, choose

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

    from .._io.arrays import StoreContext

__all__ = ["LoadResult", "load"]


class Settles(Protocol):
    """What an atomic load on several ranks settles between its reads and the first change to its state (see
    ``together.py``): ``settle(error)`` reports this rank's outcome and raises if any rank failed."""

    def settle(self, error: ArrayckptError | None) -> None: ...


@dataclass(frozen=True)
class LoadResult:
    """What ``load`` could not match (with ``strict=True`` a missing key raises instead).

    Attributes:
        missing_keys: keys of the state absent from the checkpoint (left as they were).
        unexpected_keys: keys of the checkpoint the state does not hold (not read).

    Examples:
        >>> import arrayckpt, torch, tempfile, os
        >>> path = os.path.join(tempfile.mkdtemp(), "ckpt")
        >>> arrayckpt.save({"w": torch.ones(2), "b": torch.ones(1)}, path)
        >>> arrayckpt.load({"w": torch.zeros(2), "v": torch.zeros(1)}, path, strict=False).missing_keys
        ['v']
    """

    missing_keys: list[str]
    unexpected_keys: list[str]


def load(
    state: Mapping[str, Any],
    path: str | os.PathLike[str],
    *,
    strict: bool = True,
    allow_pickle: bool = False,
    process_group: ProcessGroup | Group | None = None,
    read_once: bool = False,
    storage_options: Mapping[str, Any] | None = None,
    atomic: bool = False,
    share_root: bool = True,
    base_roots: Sequence[str | os.PathLike[str]] | None = None,
    key_prefix: str = "",
    per_rank: PerRankPolicy | None = None,
) -> LoadResult:
    """Load the checkpoint at ``path`` into ``state`` in place.

    Tensors are filled in place (read straight into their memory when on the CPU); plain values are
    replaced in their dicts and lists; objects with ``load_state_dict`` get their filled state dict
    back. Optimizers and other non-module stateful objects get state they lack created from the
    checkpoint (a fresh optimizer has no per-parameter state yet). Shapes and dtypes must match
    exactly. Everything is checked before the first byte is read, so a mismatch leaves ``state`` untouched. Damage
    found while reading (a failed checksum) is found after the bytes were read: CPU tensors, read in place, may
    then hold some of the new bytes; the error lists their keys (in its message and as
    ``error.overwritten_keys``). With several ranks, every rank calls ``load`` with its own targets and reads only
    the slices they hold.

    Args:
        state: the targets, as given to :func:`arrayckpt.save` (tensors, DTensors, :class:`arrayckpt.Shard`,
            :class:`arrayckpt.PerRank`, plain values, objects with ``load_state_dict``), nested in dicts and lists.
        path: a directory or an object-storage URL.
        strict: keys of ``state`` missing from the checkpoint raise :class:`KeyMismatchError`; ``False``: they are
            left as they are and listed in the result.
        allow_pickle: unpickle pickled values (runs the checkpoint writer's code: only for checkpoints you trust).
        process_group: the ranks that load together (default: the default group, if initialised).
        read_once: (collective) data that several ranks need — replicated tensors, data-parallel copies of a shard
            — is read from storage by one of them and sent to the others over the process group, so storage serves
            each byte once.
        storage_options: for object storage, as for :func:`arrayckpt.save`.
        atomic: every read goes to fresh host buffers and the state is touched only once every read and check has
            passed, so a failed load leaves ``state`` exactly as it was (at the cost of a host copy of the data read
            and one more copy into the tensors).
        share_root: with several ranks, the coordinator reads the root document once and sends it to the others,
            each checking its checksum; ``False``: every rank reads it itself (either way every rank must call
            ``load``, as for any collective).
        base_roots: where a delta checkpoint's bases may be read besides the directory (prefix) holding it (as for
            :func:`arrayckpt.open`).
        key_prefix: the prefix the state's keys have in front of the checkpoint's: ``"model"`` loads a checkpoint
            converted from a Hugging Face directory (``model.layers.0...``) into ``{"model": model}``
            (``model.model.layers.0...``); ``unexpected_keys`` still names the checkpoint's keys as it does.
        per_rank: how a value saved per rank (an :class:`arrayckpt.PerRank`, or a plain value that differed between
            the ranks that saved it) is resumed at another world size, where no saved value is this rank's (without
            one such a load raises): ``"rank0"`` (saved rank 0's on every rank), ``"keep"`` (the state's value
            stays), or a function ``(key, values_by_saved_rank, rank, world_size) -> value``; one for every key, or
            a dict of them by ``fnmatch`` pattern of the checkpoint's key (``{"loader.*": "rank0"}``). At the
            world size it was saved at, each rank takes its own value whatever this says.

    Returns:
        The keys that did not match, either way.

    Raises:
        CheckpointNotFoundError: nothing is at ``path``.
        IncompleteCheckpointError: a save at ``path`` never committed.
        KeyMismatchError: ``strict`` and keys of ``state`` are missing from the checkpoint (where a key prefix is
            all that separates them, the message names it and the fix: ``key_prefix``, or the state's nesting).
        StateError: a target's shape or dtype differs from the checkpoint's; a value saved per rank is loaded at
            another world size and ``per_rank`` names no policy for it.
        PickleNotAllowedError: a value needs unpickling and ``allow_pickle`` was not given.
        BaseNotAllowedError: a delta's base is outside the delta's directory and ``base_roots``.
        CorruptCheckpointError: stored bytes are damaged or missing (``error.overwritten_keys``: tensors already
            partly filled).
        CollectiveError: another rank failed or hung (with several ranks).

    Examples:
        >>> import arrayckpt, torch, tempfile, os
        >>> path = os.path.join(tempfile.mkdtemp(), "ckpt")
        >>> arrayckpt.save({"w": torch.ones(3), "step": 5}, path)
        >>> state = {"w": torch.zeros(3), "step": 0}
        >>> arrayckpt.load(state, path)
        LoadResult(missing_keys=[], unexpected_keys=[])
        >>> state
        {'w': tensor([1., 1., 1.]), 'step': 5}
    """
    check_policy(per_rank)
    group = resolve_group(process_group)
    location = parse_location(path, storage_options)
    opened = _shared_root(location, group) if share_root and group.size > 1 and shares_root(location) else None
    with open_location(location, allow_pickle=allow_pickle, opened=opened,
                       base_roots=parse_roots(base_roots, storage_options)) as checkpoint:
        return _load(state, stored_of(checkpoint), group, strict=strict, read_once=read_once, atomic=atomic,
                     key_prefix=key_prefix, per_rank=per_rank)


def _shared_root(location: Location, group: Group) -> Opened:
    """The coordinator reads the root document (one GET) and sends its bytes to every rank, which checks them and
    opens the checkpoint from them; a failed read is raised on every rank."""
    payload: Any = None
    if group.is_coordinator:
        try:
            payload = read_root_bytes(location)
        except ArrayckptError as e:
            payload = e
    payload = group.broadcast(payload)
    if isinstance(payload, BaseException):
        raise payload
    return opened_from_bytes(location, *payload)


def _load(state: Mapping[str, Any], checkpoint: StoredCheckpoint, group: Group, *, strict: bool, read_once: bool,
          atomic: bool, agreement: Settles | None = None, key_prefix: str = "",
          per_rank: PerRankPolicy | None = None) -> LoadResult:
    """The body of :func:`load`, on the checkpoint it opened (closed when this returns or raises); with an
    ``agreement`` (atomic), the ranks settle it between their reads and the first change to the state. The
    entries are looked up by the state's keys (``key_prefix`` in front of the checkpoint's) and read by their own."""
    where = str(checkpoint.location)
    walked = walk(state)
    prefix = prefix_parts(key_prefix)
    front = dotted(prefix) + "." if prefix else ""
    held = checkpoint.manifest.entries
    entries = {front + key: entry for key, entry in held.items()} if front else held
    created = _create_missing(walked, entries, prefix, held)
    missing = [key for key in walked.leaves if key not in entries]
    unexpected = [key[len(front):] for key in entries if key not in walked.leaves]
    if strict and missing:
        raise KeyMismatchError(
            f"{where}: {len(missing)} key(s) of the state are not in the checkpoint: {_few(missing)}"
            + (f"; the checkpoint has {len(unexpected)} other key(s): {_few(unexpected)}" if unexpected else "")
            + prefix_hint(missing, held, key_prefix) + ". Pass strict=False to load the rest"
        )
    with collector_paused():
        plan = _LoadPlan(checkpoint, group.rank, group.size, atomic, agreement, per_rank)
        for key, leaf in walked.leaves.items():
            if key in entries and not _filled_by_target(entries[key], leaf, walked.leaves, front):
                plan.add(entries[key], leaf)
        plan.unpickle_values()
        plan.run(group if read_once and group.size > 1 else None)
    containers = checkpoint.manifest.containers
    _hand_back(walked.statefuls, {front + k: v for k, v in containers.items()} if front else containers, created)
    return LoadResult(missing, unexpected)


def _filled_by_target(entry: Entry, leaf: Leaf, leaves: Mapping[str, Leaf], front: str = "") -> bool:
    """Whether ``entry`` is an alias whose target's leaf in the state (its key with ``front`` before it) is the same
    tensor as ``leaf`` (a tied model): reading the target fills it."""
    if not isinstance(entry, AliasEntry):
        return False
    target = leaves.get(front + entry.target)
    return target is not None and same_tensor(leaf.value, target.value)


def _few(keys: list[str], limit: int = 10) -> str:
    shown = ", ".join(repr(k) for k in keys[:limit])
    return shown + (f", … ({len(keys) - limit} more)" if len(keys) > limit else "")


class _LoadPlan:
    """How every entry reaches its leaf; built (and validated) before any array data is read."""

    def __init__(self, checkpoint: StoredCheckpoint, rank: int, world_size: int, atomic: bool = False,
                 agreement: Settles | None = None, per_rank: PerRankPolicy | None = None) -> None:
        self.checkpoint = checkpoint
        self.per_rank = per_rank  # how values saved per rank resume at another world size (``perrank.py``)
        self.agreement = agreement  # settled after every read (atomic: one read call), before the state changes
        self.where = str(checkpoint.location)
        self.rank = rank
        self.world_size = world_size
        self.atomic = atomic  # stage every read in fresh host buffers, even where the target could take it
        self.requests: list[Request] = []  # the reads into host targets (with the device targets' reads: one call)
        self.device = DeviceLoads()  # device targets, read through pooled host buffers
        self.in_place: list[str] = []  # keys read straight into the state's memory (not staged)
        self.copies: list[tuple[torch.Tensor | np.ndarray, torch.Tensor | np.ndarray]] = []  # (target, staged)
        self.replacements: list[tuple[Leaf, object]] = []
        self.pickled: list[tuple[Leaf, str]] = []  # (leaf, key) of the pickled values the state takes

    def run(self, share_with: Group | None = None) -> None:
        """Read everything concurrently (with ``share_with``: only what this rank must read, the rest
        arriving from other ranks), then copy staged data into its targets and replace plain values (only
        once every read has passed its checks)."""
        execute = read_into if share_with is None else _read_once(share_with)

        def read_batch(requests: list[Request]) -> None:
            try:
                read(self.checkpoint, requests, execute=execute)
            except ArrayckptError as e:
                if self.agreement is not None:
                    self.agreement.settle(e)
                raise
            if self.agreement is not None:
                self.agreement.settle(None)

        try:
            self.device.run(self.requests, read_batch, whole=self.atomic or share_with is not None,
                            touched=self.in_place)
        except ArrayckptError as e:
            _note_overwritten(e, sorted(set(self.in_place)))
            raise
        for target, staged in self.copies:
            if isinstance(target, np.ndarray):
                np.copyto(target, staged)
            else:
                target.copy_(cast(torch.Tensor, staged))  # staged as its target is: a tensor
        for leaf, value in self.replacements:
            leaf.parent[leaf.slot] = value

    def add(self, entry: Entry, leaf: Leaf) -> None:
        target = leaf.value
        if isinstance(entry, AliasEntry):  # its target's array (parsed: a tensor), read under the alias's name
            entry = dataclasses.replace(self.checkpoint.manifest.entries[entry.target], key=entry.key,
                                        parts=entry.parts)
        if isinstance(entry, PerRankEntry) or isinstance(target, PerRank):
            self._per_rank(entry, leaf)
        elif isinstance(entry, ArrayEntry) and isinstance(target, (torch.Tensor, Shard, np.ndarray)):
            self._array(entry, None, target)
        elif isinstance(entry, ArrayEntry):  # a plain value in the state: replace it with a new array
            self._replace(leaf, self._fresh(entry, None))
        elif isinstance(target, (torch.Tensor, Shard, np.ndarray)):
            raise StateError(
                f"{self.where}: {entry.key!r} is a plain value in the checkpoint but an array in the state"
            )
        elif isinstance(entry, PickleEntry):  # unpickled together, with one warning (see unpickle_values)
            self._replaceable(leaf)
            self.pickled.append((leaf, entry.key))
        else:
            self._replace(leaf, self.checkpoint.value(entry.key))

    def unpickle_values(self) -> None:
        """Unpickle every pickled value the state takes in one call: one :class:`arrayckpt.PickleWarning` naming
        them all (a refusal without ``allow_pickle=True`` comes before anything is read)."""
        values = self.checkpoint.unpickle([key for _, key in self.pickled])
        for leaf, key in self.pickled:
            self._replace(leaf, values[key])

    def _replace(self, leaf: Leaf, value: object) -> None:
        self._replaceable(leaf)
        self.replacements.append((leaf, value))

    def _replaceable(self, leaf: Leaf) -> None:
        if isinstance(leaf.parent, tuple):
            raise StateError(f"{self.where}: cannot replace {dotted(leaf.parts)!r} inside a tuple; use a list")

    def _fresh(self, entry: ArrayEntry, spec: JSON | None) -> torch.Tensor | np.ndarray:
        fresh = _empty_like_entry(entry)
        self._array(entry, spec, fresh)
        return fresh

    def _array(self, entry: ArrayEntry, spec: JSON | None,
               target: torch.Tensor | Shard | np.ndarray) -> None:
        """Read the part of ``entry`` that ``target`` holds (a DTensor's or Shard's box, else everything);
        ``spec`` names the array (``None``: the checkpoint's array of that key, through its chain of bases)."""
        key = entry.key
        if isinstance(target, np.ndarray):
            self._check(entry, dtype_of_numpy(target.dtype), entry.dtype, target.shape)
            if not target.flags.writeable:
                raise StateError(f"{self.where}: numpy array {key!r} in the state is read-only")
            if overlaps_itself(target.shape, target.strides, target.itemsize):
                raise StateError(f"{self.where}: numpy array {key!r} in the state has elements sharing memory (an "
                                 "overlapping view); load into an array with its own memory: .copy() it first")
            if self.atomic:
                staged_array = np.empty(target.shape, target.dtype)
                self._read(entry, spec, Box.whole(entry.shape), staged_array)
                self.copies.append((target, staged_array))
            else:
                self._read(entry, spec, Box.whole(entry.shape), target)
                self.in_place.append(key)
            return
        global_shape, box, local = to_local_box(target, key)
        self._check(entry, local.dtype, torch_dtype(entry.dtype), global_shape)
        try:
            check_loadable(local, key)
        except StateError as e:
            raise StateError(f"{self.where}: {e}") from None
        if box.size == 0 and math.prod(entry.shape) != 0:
            return  # this rank holds no part of the tensor
        if is_staged(local):  # on a device: through pooled host buffers, in batches
            self.device.add(key, local, box, entry.dtype, lambda part, out: self._request(entry, spec, part, out))
        elif local.device.type == "cpu" and not self.atomic:
            self._read(entry, spec, box, writable_numpy(local, entry.dtype, key))
            self.in_place.append(key)
        else:
            staged = torch.empty(box.shape, dtype=torch_dtype(entry.dtype))
            self._read(entry, spec, box, writable_numpy(staged, entry.dtype, key))
            self.copies.append((local, staged))

    def _read(self, entry: ArrayEntry, spec: JSON | None, box: Box, out: np.ndarray) -> None:
        self.requests.append(self._request(entry, spec, box, out))

    @staticmethod
    def _request(entry: ArrayEntry, spec: JSON | None, box: Box, out: np.ndarray) -> Request:
        if spec is None:
            return ChainRead(entry.key, box, out)
        return ArrayIO(entry.key, spec, out, box.slices() if box.shape else None)

    def _check(self, entry: ArrayEntry, have: object, want: object, shape: tuple[int, ...]) -> None:
        if have != want or tuple(shape) != entry.shape:
            raise StateError(
                f"{self.where}: tensor {entry.key!r} is {entry.dtype.name}{list(entry.shape)} in the checkpoint but "
                f"{_dtype_name(have)}{list(shape)} in the state; arrayckpt never casts or reshapes silently: load "
                "into a matching tensor and convert"
            )

    def _per_rank(self, entry: Entry, leaf: Leaf) -> None:
        """A per-rank entry goes to its leaf (a ``PerRank`` target, or a plain value's) from this rank's saved value,
        the one a ``PerRank`` target names, or what the ``per_rank`` policy chooses (``perrank.py``)."""
        key, target = entry.key, leaf.value
        explicit = isinstance(target, PerRank)
        if not isinstance(entry, PerRankEntry) or not (explicit or _takes_values(entry, target)):
            raise StateError(
                f"{self.where}: {key!r} is {'per-rank' if isinstance(entry, PerRankEntry) else 'not per-rank'} in "
                f"the checkpoint but {'a PerRank' if explicit else 'not a PerRank'} in the state; "
                "wrap it in arrayckpt.PerRank on save and on load"
            )
        saved = len(entry.items)
        source = target.rank if explicit else None
        if source is None:
            choice = choose(self.per_rank, self.where, key, entry.items, self.rank, self.world_size, explicit)
            if choice == "keep":
                return
            if callable(choice):
                if any(isinstance(item, ArrayEntry) for item in entry.items):
                    raise StateError(f"{self.where}: per-rank value {key!r} holds arrays; a per_rank function takes "
                                     "plain values only: choose 'rank0', or PerRank(value, rank=r) in the state")
                values = [decode_value(item.value, key) if isinstance(item, ValueEntry) else None
                          for item in entry.items]
                chosen = choice(key, values, self.rank, self.world_size)
                self._replace(leaf, PerRank(chosen, None) if explicit else chosen)
                return
            source = choice
        if not 0 <= source < saved or entry.items[source] is None:
            raise StateError(f"{self.where}: per-rank value {key!r} has no value saved by rank {source}")
        item = entry.items[source]
        assert item is not None  # checked above
        if isinstance(item, ArrayEntry):
            spec = self.checkpoint.per_rank_spec(key, source)
            if isinstance(target.value, (torch.Tensor, np.ndarray)):
                self._array(item, spec, target.value)
            else:
                self._replace(leaf, PerRank(self._fresh(item, spec), target.rank))
        else:
            value = decode_value(item.value, key)
            self._replace(leaf, PerRank(value, target.rank) if explicit else value)


def _takes_values(entry: PerRankEntry, target: object) -> bool:
    """Whether a leaf that is not a ``PerRank`` takes a per-rank entry: a plain value's leaf, for an entry of plain
    values (a value that differed between the ranks that saved it)."""
    return (not isinstance(target, (torch.Tensor, Shard, np.ndarray))
            and not any(isinstance(item, ArrayEntry) for item in entry.items))


def _read_once(group: Group) -> Execute:
    """The read path's ``execute`` for ``read_once=True`` (collective): this rank reads its share of the plain
    reads, then the ranks exchange the rest; a rank that failed to read fails everyone, before any exchange."""

    def execute(jobs: Sequence[ArrayIO], context: StoreContext, where: str) -> None:
        own, exchange = split_reads(list(jobs), group)
        error: BaseException | None = None
        try:
            read_into(own, context, where)
        except ArrayckptError as e:
            error = e
        failures = [(r, str(e)) for r, e in enumerate(group.all_gather(error)) if e is not None]
        if error is not None:
            raise error
        if failures:  # another rank could not read what it was to send: nobody exchanges
            rank, message = failures[0]
            raise CorruptCheckpointError(f"rank {rank} failed to read data this rank needs: {message}")
        exchange()

    return execute


def _note_overwritten(error: ArrayckptError, keys: list[str]) -> None:
    """Make ``error`` (a read that failed, e.g. a bad checksum) say which keys of the state were read in place and
    may hold some of the new bytes: in its message and as ``error.overwritten_keys``."""
    error.overwritten_keys = keys  # type: ignore[attr-defined]
    if keys:
        note = (f"; the state was not loaded as a whole: {len(keys)} tensor(s) read in place may hold some of the "
                f"checkpoint's bytes: {_few(keys)}; load them again from an intact checkpoint (atomic=True leaves "
                "the state untouched when a load fails)")
        error.args = (f"{error.args[0] if error.args else error}{note}", *error.args[1:])


def _dtype_name(dtype: object) -> str:
    name = getattr(dtype, "name", None)
    return name if isinstance(name, str) else str(dtype).removeprefix("torch.")


def _empty_like_entry(entry: ArrayEntry) -> torch.Tensor | np.ndarray:
    if entry.kind == "ndarray":
        return np.empty(entry.shape, entry.dtype.numpy)
    return torch.empty(entry.shape, dtype=torch_dtype(entry.dtype))


def _create_missing(walked: Walk, entries: Mapping[str, Entry], prefix: tuple[str, ...] = (),
                    held: Mapping[str, Entry] | None = None) -> set[int]:
    """Create, inside non-module stateful objects' state dicts, entries the checkpoint has and they lack.

    A fresh optimizer has an empty ``state`` until its first step; its ``load_state_dict`` accepts the
    full state, so the checkpoint's tensors are materialised into its state dict. Modules have a fixed
    set of keys, so for them extra checkpoint keys stay unexpected. Returns the ids of the dicts created on the
    way (:func:`_hand_back` turns those standing for the checkpoint's lists and tuples back into them).
    ``entries`` are by the state's keys: the checkpoint's (``held``) with the parts ``prefix`` in front.
    """
    created: set[int] = set()
    for node in walked.statefuls:
        if isinstance(node.obj, torch.nn.Module):
            continue
        depth = len(node.parts)
        for key, entry in entries.items():
            parts = (*prefix, *entry.parts)
            if key in walked.leaves or parts[:depth] != node.parts or len(parts) == depth:
                continue
            _insert(walked, node, key, parts, created, _array_of(entry, entries if held is None else held))
    return created


def _array_of(entry: Entry, entries: Mapping[str, Entry]) -> ArrayEntry | None:
    """The array entry whose data ``entry`` holds: itself, or an alias's target."""
    found = entries.get(entry.target) if isinstance(entry, AliasEntry) else entry
    return found if isinstance(found, ArrayEntry) else None


def _insert(walked: Walk, node: StatefulNode, key: str, parts: Key, created: set[int],
            array: ArrayEntry | None) -> None:
    """Create the leaf ``parts`` (the state's key ``key``) in ``node``'s state dict, with the dicts on its way."""
    container: Any = node.state_dict
    for i in range(len(node.parts), len(parts) - 1):
        part = parts[i]
        if not isinstance(container, dict):
            return
        child = container.get(part)
        if child is None:
            child = container[part] = {}
            created.add(id(child))
        elif isinstance(child, dict) and not child:
            walked.leaves.pop(dotted(parts[: i + 1]), None)  # now a container
        container = child
    slot = parts[-1]
    if not isinstance(container, dict) or slot in container:
        return
    container[slot] = _empty_like_entry(array) if array is not None else None
    walked.leaves[key] = Leaf(parts, container[slot], container, slot)


def _hand_back(statefuls: list[StatefulNode], containers: Mapping[str, str] | None = None,
               created: set[int] | None = None) -> None:
    """Give every stateful object its filled state dict, innermost first; the dicts :func:`_insert` created where
    the checkpoint has a list or a tuple (``containers``, by dotted prefix) become that list or tuple first."""
    for node in statefuls:
        if created:
            _restore_created(node.state_dict, node.parts, containers or {}, created)
        node.obj.load_state_dict(node.state_dict)


def _restore_created(container: dict[Any, Any], parts: tuple[Any, ...], containers: Mapping[str, str],
                     created: set[int]) -> None:
    """Below ``container`` (children first): each dict created by :func:`_insert` at a prefix the checkpoint
    saved as a list or tuple is replaced, in its parent, by that list or tuple of its values in index order."""
    for key, child in list(container.items()):
        if not isinstance(child, dict):
            continue
        _restore_created(child, (*parts, key), containers, created)
        kind = containers.get(dotted((*parts, key))) if id(child) in created else None
        if kind is not None:
            items = [child[i] for i in sorted(child)]
            container[key] = items if kind == "list" else tuple(items)


