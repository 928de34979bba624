"""Files and objects per checkpoint at scale, simulated: a Llama-70B-shaped training state on 8 to 1,024 ranks,
today's layout against the packed layout's projection (issue 35) and PyTorch DCP.

Run from the repository root::

    python benchmarks/files.py                          # 8, 64, 256 and 1,024 ranks
    python benchmarks/files.py --ranks 8,64 --json files.json

What it simulates: the state FSDP2 gives every rank of a Llama-3-70B-shaped model (80 layers of ``q``/``k``/``v``/
``o``, ``gate``/``up``/``down`` and two norms; the embedding, final norm and output layer: 723 parameters; hidden
8,192, FFN 28,672, 8 KV heads of 128, vocabulary 128,256): bf16 parameters and fp32 AdamW ``exp_avg``/``exp_avg_sq``,
each sharded on dim 0 over every rank (``torch.chunk``-style, as ``Shard(0)`` does), and AdamW's 0-d ``step`` tensor
per parameter, replicated: 2,892 arrays. Every rank's state is made of ``arrayckpt.Shard`` s over meta tensors (no
data), described by the code a rank runs in ``arrayckpt.save`` and planned by the coordinator's planner with the
default chunk policy (``plan``: seconds, one process). Then, from the plan:

- ``files``: what today's layout writes: one file per stored chunk (each a shard file, ``sharding_indexed``, or a
  plain chunk), one ``zarr.json`` per array and intermediate group, and the root;
- ``packed_multipart``: what the packed layout (spec §16) writes for the same plan: one pack per rank that writes
  anything (one file, or one object uploaded in parts), the index, the root, and ``refs.json`` up to
  ``refs_max_chunks`` stored chunks; ``packed`` and ``packed_objects``: the first pack writer's bounded segments
  (``SEGMENT_BYTES``: 1 GiB files, 64 MiB objects), kept to show why it was replaced;
- ``dcp``: DCP's ``FileSystemWriter`` with its defaults (one ``.distcp`` file per rank, ``thread_count=1``, and
  ``.metadata``);
- ``load_gets`` (max per rank) and ``load_gets_spread``: the GETs a load at the same sharding issues on object
  storage per rank, from the plan (the formula that ``s3_ranks.py`` measures at 2 and 4 real ranks): the root, the
  sections of the index it needs (merged into GETs of at most ``object_part_bytes``), its own pack (likewise), and one
  GET per other rank's pack that holds replicated pieces it holds (AdamW's 0-d steps; a writer's small pieces lie
  together at the end of its pack). ``load_gets`` with small replicated pieces gathered on one writer (the planner's
  ``gather_piece_bytes``), ``load_gets_spread`` with them spread one per rank by load (before);
- ``root_mib``: today's root document (manifest, chunk digests, ``created.writers``, consolidated metadata), and
  ``index_mib``: the packed layout's chunk table (24 bytes per stored chunk and a crc32c per array,
  ``_format/packs.py``), which a loader reads by array, not whole.

The target of issue 35: at 256 and 1,024 ranks the packed layout writes at most 2 x ranks data files plus a
constant.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from scale import _chunk, _meta, _no_data, _reported_chunks  # noqa: E402

import arrayckpt  # noqa: E402
from arrayckpt._format.manifest import encode_root_document  # noqa: E402
from arrayckpt._format.packs import ROW_SIZE  # noqa: E402
from arrayckpt._layout import saveplan  # noqa: E402
from arrayckpt._layout.chunking import DEFAULT_CHUNKING, ChunkPolicy  # noqa: E402
from arrayckpt._settings import settings  # noqa: E402
from arrayckpt._write.describe import describe_local  # noqa: E402
from arrayckpt._write.save import Record, build_manifest  # noqa: E402

SEGMENT_BYTES = (1 << 30, 64 << 20)  # the first pack writer's segments (local, object storage), measured against

HIDDEN, FFN, KV, VOCAB, LAYERS = 8192, 28672, 1024, 128256, 80
DEFAULT_RANKS = (8, 64, 256, 1024)
MIB = 2**20


def parameters() -> list[tuple[str, tuple[int, ...]]]:
    out = [("model.embed_tokens.weight", (VOCAB, HIDDEN))]
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        out += [(p + "self_attn.q_proj.weight", (HIDDEN, HIDDEN)), (p + "self_attn.k_proj.weight", (KV, HIDDEN)),
                (p + "self_attn.v_proj.weight", (KV, HIDDEN)), (p + "self_attn.o_proj.weight", (HIDDEN, HIDDEN)),
                (p + "mlp.gate_proj.weight", (FFN, HIDDEN)), (p + "mlp.up_proj.weight", (FFN, HIDDEN)),
                (p + "mlp.down_proj.weight", (HIDDEN, FFN)), (p + "input_layernorm.weight", (HIDDEN,)),
                (p + "post_attention_layernorm.weight", (HIDDEN,))]
    return out + [("model.norm.weight", (HIDDEN,)), ("lm_head.weight", (VOCAB, HIDDEN))]


def rank_state(rank: int, ranks: int, params: list[tuple[str, tuple[int, ...]]]) -> dict[str, Any]:
    """What ``get_state_dict`` gives one rank of FSDP2 (every parameter ``Shard(0)`` over all ranks)."""
    model, optim = {}, {}
    for name, shape in params:
        a, b = _chunk(shape[0], ranks, rank)
        local, offset = (b - a, *shape[1:]), (a, *[0] * (len(shape) - 1))
        model[name] = arrayckpt.Shard(_meta(local, torch.bfloat16), shape, offset)
        step = torch.empty((), dtype=torch.float32, device="meta")  # one per parameter, as AdamW keeps it
        optim[name] = {"step": step, **{m: arrayckpt.Shard(_meta(local, torch.float32), shape, offset)
                                        for m in ("exp_avg", "exp_avg_sq")}}
    groups = [{"lr": 1e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1, "params": [n for n, _ in params]}]
    return {"model": model, "optim": {"state": optim, "param_groups": groups}}


def _groups(paths: list[str]) -> int:
    """The intermediate groups above these array paths (each a ``zarr.json`` today)."""
    return len({"/".join(p.split("/")[:i]) for p in paths for i in range(1, p.count("/") + 1)})


def _plan(descriptions: list[Any], policy: ChunkPolicy) -> Any:
    layout = saveplan.plan_layout(descriptions, tuple(saveplan.fingerprint(d) for d in descriptions), None, policy)
    return saveplan.assemble(layout, [(d.values, d.per_rank) for d in descriptions])


def load_gets(plan: Any, descriptions: list[Any], index_bytes: int) -> int:
    """The most GETs one rank's load at the same sharding issues on object storage (module docstring: the root, the
    index sections, its own pack, one GET per other writer of replicated pieces it holds)."""
    part = settings().object_part_bytes
    holders: dict[str, set[int]] = {}  # a key held whole, identically, by several ranks: replicated
    boxes: dict[str, set[Any]] = {}
    for rank, description in enumerate(descriptions):
        for item in description.arrays:
            holders.setdefault(item.key, set()).add(rank)
            boxes.setdefault(item.key, set()).add(item.box)
    replicated = {key for key, ranks in holders.items() if len(ranks) > 1 and len(boxes[key]) == 1}
    writers_of: dict[str, set[int]] = {}
    for writer, tasks in enumerate(plan.tasks):
        for task in tasks:
            if task.key in replicated:
                writers_of.setdefault(task.key, set()).add(writer)
    worst = 0
    for rank, load in enumerate(plan.bytes_by_rank):
        others = {w for key, ws in writers_of.items() if rank in holders[key] for w in ws} - {rank}
        worst = max(worst, 1 + math.ceil(index_bytes / part) + math.ceil(load / part) + len(others))
    return worst


def measure(ranks: int) -> dict[str, Any]:
    params = parameters()
    descriptions = [describe_local(rank_state(r, ranks, params), r, False, _no_data).description
                    for r in range(ranks)]
    started = time.perf_counter()
    plan = _plan(descriptions, DEFAULT_CHUNKING)
    plan_s = time.perf_counter() - started
    spread = _plan(descriptions, dataclasses.replace(DEFAULT_CHUNKING, gather_piece_bytes=1))
    chunks = {path: math.prod(-(-n // c) for n, c in zip(a.shape, a.outer_chunk, strict=True))
              for path, a in plan.arrays.items()}
    stored = sum(chunks.values())
    written = [({}, sums) for sums in _reported_chunks(plan)]
    root = encode_root_document(build_manifest(plan, Record(1000), ranks, None, written, "files"),
                                plan.consolidated_json)
    loads = np.asarray(plan.bytes_by_rank, np.int64)
    local, remote = SEGMENT_BYTES
    packed_local = int(np.ceil(loads / local).sum()) + 3  # + index, root, refs.json
    packed_object = int(np.ceil(loads / remote).sum()) + 3
    # the packed layout as written (spec §16): a pack per rank that writes anything (one file, or one multipart
    # object), the index and the root, and refs.json up to refs_max_chunks stored chunks
    one_per_rank = int((loads > 0).sum()) + 2 + (stored <= settings().refs_max_chunks)
    index_bytes = stored * ROW_SIZE + 4 * len(chunks)
    return {"ranks": ranks, "arrays": len(plan.arrays), "plan_s": round(plan_s, 2),
            "files": stored + len(plan.arrays) + _groups(list(plan.arrays)) + 1, "chunk_files": stored,
            "packed_files": packed_local, "packed_objects": packed_object, "packed_multipart": one_per_rank,
            "dcp_files": ranks + 1,
            "bytes_per_rank_gib": round(float(loads.max()) / 2**30, 2),
            "root_mib": round(len(root) / MIB, 2), "index_mib": round(index_bytes / MIB, 2),
            "load_gets": load_gets(plan, descriptions, index_bytes),
            "load_gets_spread": load_gets(spread, descriptions, index_bytes)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", default=",".join(map(str, DEFAULT_RANKS)))
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    rows = []
    columns = ("ranks", "arrays", "files", "packed_files", "packed_objects", "packed_multipart", "dcp_files",
               "bytes_per_rank_gib", "root_mib", "index_mib", "load_gets", "load_gets_spread", "plan_s")
    print(" ".join(f"{c:>12}" for c in columns))
    for ranks in (int(r) for r in args.ranks.split(",")):
        row = measure(ranks)
        rows.append(row)
        print(" ".join(f"{row[c]!s:>12}" for c in columns), flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    last = rows[-1]
    print(f"files: ranks={last['ranks']} files={last['files']} packed={last['packed_files']} "
          f"packed_objects={last['packed_objects']} dcp={last['dcp_files']}")


if __name__ == "__main__":
    main()
