"""Which chunk files a rank's restore reads: the outer chunks its targets' boxes meet (the same geometry ``load``
reads by), so that a node fetches from its peers only what its own ranks will read, not the whole step.

Tensors (plain, DTensor, :class:`arrayckpt.Shard`), numpy arrays and aliases of them need the chunks their box
meets; anything else stored as an array (per-rank arrays, pickled values, an array loaded into a plain value) needs
every chunk of the arrays below its key's path. Keys the checkpoint lacks need nothing (``load`` reports them).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from .._format.alias import AliasEntry
from .._format.jsontypes import JSON
from .._format.keys import array_path
from .._format.manifest import ArrayEntry, Manifest, ValueEntry
from .._format.zarr import array_shape, chunk_keys, grid_counts, outer_chunk_shape
from .._layout.box import Box, grid_cells
from .._torch.shards import Shard, to_local_box
from .._torch.state import walk

__all__ = ["needed_files"]


def needed_files(state: Mapping[str, Any], manifest: Manifest, nodes: Mapping[str, JSON]) -> dict[str, set[str]]:
    """Array path -> the chunk keys a ``load`` of ``state`` from this checkpoint reads on this rank."""
    arrays = {p: m for p, m in nodes.items() if isinstance(m, dict) and m.get("node_type") == "array"}
    out: dict[str, set[str]] = {}
    for key, leaf in walk(dict(state)).leaves.items():
        entry = manifest.entries.get(key)
        if isinstance(entry, AliasEntry):
            entry = manifest.entries.get(entry.target)
        if entry is None or isinstance(entry, ValueEntry):
            continue
        target = leaf.value
        if isinstance(entry, ArrayEntry) and entry.path in arrays and isinstance(target, (torch.Tensor, Shard)):
            box = to_local_box(target, key)[1]
            _add_box(out, entry.path, arrays[entry.path], box)
        elif isinstance(entry, ArrayEntry) and entry.path in arrays and isinstance(target, np.ndarray):
            _add_box(out, entry.path, arrays[entry.path], Box.whole(tuple(array_shape(arrays[entry.path]))))
        else:
            prefix = array_path(key)
            for path, metadata in arrays.items():
                if path == prefix or path.startswith(prefix + "/"):
                    _add_box(out, path, metadata, Box.whole(tuple(array_shape(metadata))))
    return out


def _add_box(out: dict[str, set[str]], path: str, metadata: JSON, box: Box) -> None:
    """The keys of the outer chunks of the array at ``path`` that ``box`` meets."""
    shape = tuple(array_shape(metadata))
    if box.size == 0 and shape:
        return
    grid = tuple(outer_chunk_shape(metadata))
    counts = grid_counts(metadata)
    cells = grid_cells(box, grid, shape) if shape else [(0, box)]
    indices = [tuple(int(i) for i in np.unravel_index(flat, counts)) if counts else () for flat, _ in cells]
    out.setdefault(path, set()).update(chunk_keys(metadata, indices))
