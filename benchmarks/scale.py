"""Planning a save at scale, simulated: a Llama-3-405B-like training state on 64 to 16,384 ranks, arrayckpt vs DCP.

Run from the repository root::

    python benchmarks/scale.py                            # 64, 1,024, 4,096 and 16,384 ranks
    python benchmarks/scale.py --ranks 64,1024            # a quicker run
    python benchmarks/scale.py --ranks 16384 --json scale.json
    python benchmarks/scale.py --no-dcp                   # arrayckpt only

What it simulates
-----------------
The state of one rank of a Llama-3-405B-like run (126 layers of attention ``wq``/``wk``/``wv``/``wo``, MLP
``w1``/``w2``/``w3`` and two norms; the token embedding, the final norm and the output layer; hidden 16,384, FFN
53,248, 8 KV heads of 128 so ``wk``/``wv`` are 1,024 wide, vocabulary 128,256): bf16 parameters and fp32 AdamW
``exp_avg``/``exp_avg_sq``, the optimizer's ``param_groups``, a step, and per rank an RNG state (a uint8 tensor)
and a data-loader position (``arrayckpt.PerRank``). Sharding is TP x PP x DP (rank = (pp * DP + dp) * TP + tp):
TP splits column-parallel matrices (``wq``, ``wk``, ``wv``, ``w1``, ``w3``, embedding, output) on dim 0 and
row-parallel ones (``wo``, ``w2``) on dim 1, ``torch.chunk``-style; PP gives each stage a contiguous run of layers
(the embedding to the first, final norm and output to the last); FSDP then shards every piece on dim 0 over DP;
norms are replicated over TP (replica id = tp). World sizes: 64 = TP 8 x PP 4 x DP 2, then TP 8 x PP 16 x DP
8, 32 and 128 (16,384 is Llama 3's own TP 8 x PP 16 x DP 128). At 16,384 ranks that is ~3.5 million pieces.

Every rank's state is built of ``arrayckpt.Shard``s over meta tensors (no data) and described by the code a
rank runs in ``arrayckpt.save`` (``_write/describe.py::describe_local``); its description is pickled as
``gather_object`` would send it. The coordinator's side then runs, timed one step at a time:

- ``decode``: unpickling every rank's report (what ``gather_object`` does on the coordinator);
- ``plan``: validate and plan (``_layout/saveplan.py``: ``plan_layout`` and ``assemble``) and every rank's part
  of the plan (``_layout/rankplan.py::rank_layouts``, the replies of the scatter);
- ``encode``: pickling every rank's reply (what ``scatter_object_list`` sends; it pads every rank's message to
  the largest, so "plan bytes per rank" is the largest reply);
- ``peak``: the peak of Python allocations during ``plan`` (``tracemalloc``, a second run);
- ``root``: the manifest with chunk digests of fabricated checksums and the root document (its bytes);
- ``replan``: a second save with the same layout: every rank reports its fingerprint and its values only; the
  coordinator finds the cached layout, adds the values and answers every rank "reuse your part".

DCP, the same layout: per rank a ``SavePlan`` of the ``WriteItem``\\ s DCP's ``DefaultSavePlanner`` makes (a
``SHARD`` item per piece as ``_create_write_items_for_dtensor`` builds it, ``TENSOR`` items for the per-rank RNG
state, ``BYTE_IO`` items for the step, the flattened ``param_groups`` and the loader position, and the
flattening mappings as ``planner_data``), pickled; then ``decode``, ``plan`` =
``DefaultSavePlanner.create_global_plan`` (deduplication, the global plan, the metadata and its validation, all
torch's own code), ``encode`` (pickling each rank's plan), ``peak``, ``root`` (the pickled ``Metadata``, DCP's
``.metadata`` file) and ``replan`` (``enable_plan_caching=True``, second call with every rank's plan unchanged).

Output: one table per system and the ratios (DCP / arrayckpt, > 1: arrayckpt is faster or smaller); ``--json``
writes everything; the last line, for scripts, is ``scale: ranks=... plan_s=... dcp_plan_s=... ratio=...
peak_mib=... plan_bytes_per_rank=... replan_s=...`` for the largest world size.
"""

from __future__ import annotations

import argparse
import gc
import json
import pickle
import platform
import sys
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import arrayckpt  # noqa: E402
from arrayckpt._format.manifest import encode_root_document  # noqa: E402
from arrayckpt._layout import rankplan, saveplan  # noqa: E402
from arrayckpt._layout.chunking import DEFAULT_CHUNKING  # noqa: E402
from arrayckpt._layout.plancache import PlanCache  # noqa: E402
from arrayckpt._write.describe import describe_local  # noqa: E402
from arrayckpt._write.exchange import Reply, Report  # noqa: E402
from arrayckpt._write.save import Record, build_manifest  # noqa: E402

HIDDEN, FFN, KV, VOCAB, LAYERS = 16384, 53248, 1024, 128256, 126
TP = 8
RNG_BYTES = 5056  # torch.get_rng_state() on CPU
MIB = 2**20
DEFAULT_RANKS = (64, 1024, 4096, 16384)

Spec = tuple[str, tuple[int, ...], "int | None", "int | str"]  # name, global shape, TP dim, layer or "first"/"last"


def specs() -> list[Spec]:
    out: list[Spec] = [("tok_embeddings.weight", (VOCAB, HIDDEN), 0, "first")]
    for i in range(LAYERS):
        p = f"layers.{i}."
        out += [(p + "attention.wq.weight", (HIDDEN, HIDDEN), 0, i), (p + "attention.wk.weight", (KV, HIDDEN), 0, i),
                (p + "attention.wv.weight", (KV, HIDDEN), 0, i), (p + "attention.wo.weight", (HIDDEN, HIDDEN), 1, i),
                (p + "feed_forward.w1.weight", (FFN, HIDDEN), 0, i),
                (p + "feed_forward.w2.weight", (HIDDEN, FFN), 1, i),
                (p + "feed_forward.w3.weight", (FFN, HIDDEN), 0, i),
                (p + "attention_norm.weight", (HIDDEN,), None, i), (p + "ffn_norm.weight", (HIDDEN,), None, i)]
    return out + [("norm.weight", (HIDDEN,), None, "last"), ("output.weight", (VOCAB, HIDDEN), 0, "last")]


def mesh(ranks: int) -> tuple[int, int, int]:
    """(TP, PP, DP) for a world size: TP 8, PP up to 16, the rest data parallel."""
    pp = min(16, max(1, ranks // 16))
    if ranks % (TP * pp):
        raise SystemExit(f"--ranks {ranks}: must be a multiple of {TP * pp}")
    return TP, pp, ranks // (TP * pp)


def _chunk(n: int, parts: int, i: int) -> tuple[int, int]:
    step = -(-n // parts)
    start = min(i * step, n)
    return start, min(start + step, n)


_META: dict[tuple[tuple[int, ...], torch.dtype], torch.Tensor] = {}


def _meta(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A meta tensor (no data); one per shape and dtype, shared by the pieces that have it."""
    key = (shape, dtype)
    if key not in _META:
        _META[key] = torch.empty(shape, dtype=dtype, device="meta")
    return _META[key]


Piece = tuple[str, tuple[int, ...], tuple[int, ...], tuple[int, ...], int]


def pieces(rank: int, layout: tuple[int, int, int], all_specs: list[Spec]) -> list[Piece]:
    """This rank's pieces: (name, global shape, offset, local shape, replica id)."""
    tp_size, pp_size, dp_size = layout
    tp, dp, pp = rank % tp_size, (rank // tp_size) % dp_size, rank // (tp_size * dp_size)
    stage = set(np.array_split(np.arange(LAYERS), pp_size)[pp].tolist())
    out = []
    for name, shape, tp_dim, where in all_specs:
        if (where == "first" and pp != 0) or (where == "last" and pp != pp_size - 1) or (
                isinstance(where, int) and where not in stage):
            continue
        offset, local = [0] * len(shape), list(shape)
        if tp_dim is not None:
            a, b = _chunk(shape[tp_dim], tp_size, tp)
            offset[tp_dim], local[tp_dim] = a, b - a
        a, b = _chunk(local[0], dp_size, dp)  # FSDP: dim 0 of the TP piece
        offset[0] += a
        local[0] = b - a
        out.append((name, shape, tuple(offset), tuple(local), tp if tp_dim is None else 0))
    return out


def rank_state(rank: int, held: list[Piece]) -> dict[str, Any]:
    model, optim = {}, {}
    for name, shape, offset, local, replica in held:
        model[name] = arrayckpt.Shard(_meta(local, torch.bfloat16), shape, offset, replica)
        optim[name] = {m: arrayckpt.Shard(_meta(local, torch.float32), shape, offset, replica)
                       for m in ("exp_avg", "exp_avg_sq")}
    groups = [{"lr": 1e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1, "params": sorted(model)}]
    return {"model": model, "optim": {"state": optim, "param_groups": groups}, "step": 1000,
            "rng": arrayckpt.PerRank(_meta((RNG_BYTES,), torch.uint8)),
            "loader": arrayckpt.PerRank({"epoch": 3, "offset": 1000 * rank})}


_NO_DATA = np.empty(0, np.uint8)


def _no_data(key: str, path: str, value: Any, dt: Any) -> np.ndarray:
    return _NO_DATA  # meta tensors: nothing to write from


class Measured(dict):
    """The numbers of one system at one world size; :meth:`time` adds ``<name>_s`` (wall) and ``<name>_cpu_s``."""

    def time(self, name: str, fn: Callable[[], Any]) -> Any:
        """``fn()``, timed with the garbage collector off (as ``arrayckpt.save`` runs; it spares DCP's millions of
        objects the collector's passes too). CPU time is reported beside wall time: this machine is shared."""
        gc.collect()
        gc.disable()
        try:
            wall, cpu = time.perf_counter(), time.process_time()
            out = fn()
            self[f"{name}_s"], self[f"{name}_cpu_s"] = time.perf_counter() - wall, time.process_time() - cpu
            return out
        finally:
            gc.enable()


def peak_mib(fn: Callable[[], Any]) -> float:
    """The peak of Python allocations during ``fn()``, MiB (what is allocated before it does not count)."""
    gc.collect()
    gc.disable()
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1] / MIB
    finally:
        tracemalloc.stop()
        gc.enable()


# --------------------------------------------------------------------------------------------- arrayckpt


def run_arrayckpt(ranks: int, layout: tuple[int, int, int], all_specs: list[Spec]) -> dict[str, Any]:
    out = Measured()
    sent: list[bytes] = []
    started, fingerprint_s, total = time.perf_counter(), 0.0, 0
    for rank in range(ranks):  # every rank describes its state and reports it
        description = describe_local(rank_state(rank, pieces(rank, layout, all_specs)), rank, False,
                                     _no_data).description
        total += len(description.table)
        t = time.perf_counter()
        fingerprint = saveplan.fingerprint(description)
        fingerprint_s += time.perf_counter() - t
        sent.append(pickle.dumps(Report(None, fingerprint, None, description, description.values,
                                        description.per_rank, [], None), pickle.HIGHEST_PROTOCOL))
    out.update(pieces=total, describe_s_per_rank=(time.perf_counter() - started) / ranks,
               fingerprint_s_per_rank=fingerprint_s / ranks, report_bytes_per_rank=max(map(len, sent)))
    reports = out.time("decode", lambda: [pickle.loads(b) for b in sent])
    sent.clear()

    def plan() -> tuple[Any, list[Reply]]:
        fingerprints = tuple(r.fingerprint for r in reports)
        planned = saveplan.plan_layout([r.description for r in reports], fingerprints, None, DEFAULT_CHUNKING)
        save_plan = saveplan.assemble(planned, [(r.values, r.per_rank) for r in reports])
        return save_plan, [Reply(planned.plan_id, part, None, "default") for part in rankplan.rank_layouts(planned)]

    save_plan, replies = out.time("plan", plan)
    sizes = [len(b) for b in out.time("encode", lambda: [pickle.dumps(r, pickle.HIGHEST_PROTOCOL) for r in replies])]
    out.update(plan_bytes_per_rank=max(sizes), plan_bytes_mean=sum(sizes) / len(sizes), arrays=len(save_plan.arrays),
               write_tasks=len(save_plan.layout.tasks.source))
    layout_id, parts = save_plan.layout.plan_id, [r.part for r in replies]
    replies.clear()
    out["peak_mib"] = peak_mib(plan)

    # the root document, from fabricated checksums of every chunk as each rank would report them (so the manifest
    # records who wrote what, `created.writers`, as a real save does)
    written = [({}, sums) for sums in _reported_chunks(save_plan)]

    def root() -> bytes:
        manifest = build_manifest(save_plan, Record(1000), ranks, None, written, "scale")
        return encode_root_document(manifest, save_plan.consolidated_json)

    out["root_bytes"] = len(out.time("root", root))

    # the second save: the same layout; every rank claims its part, and sends only its fingerprint and values
    cache = PlanCache()  # what the coordinator keeps between saves
    cache.keep(save_plan.layout)
    claims = [pickle.dumps(Report(None, r.fingerprint, layout_id, None,
                                  tuple(v for v in r.description.values if v.key in parts[i].sent),
                                  r.description.per_rank, [], None), pickle.HIGHEST_PROTOCOL)
              for i, r in enumerate(reports)]
    reports.clear()

    def replan() -> list[bytes]:
        got = [pickle.loads(b) for b in claims]
        cached = cache.reusable(tuple(r.fingerprint for r in got), None, DEFAULT_CHUNKING)
        assert cached is not None and cached.plan_id == layout_id
        saveplan.assemble(cached, [(r.values, r.per_rank) for r in got])
        return [pickle.dumps(Reply(cached.plan_id, None if r.plan_id == cached.plan_id else parts[i], None, "default"),
                             pickle.HIGHEST_PROTOCOL) for i, r in enumerate(got)]

    reuse = out.time("replan", replan)
    out.update(replan_report_bytes_per_rank=max(map(len, claims)), replan_bytes_per_rank=max(map(len, reuse)))
    return dict(out)


# --------------------------------------------------------------------------------------------- DCP


def _dcp_plans(ranks: int, layout: tuple[int, int, int], all_specs: list[Spec]) -> list[bytes]:
    """Every rank's pickled local ``SavePlan``, its write items as DCP's default planner makes them."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
    from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType
    from torch.distributed.checkpoint.planner_helpers import (
        _create_write_item_for_bytesio,
        _create_write_item_for_tensor,
    )

    values = ["step", *(f"optim.param_groups.0.{k}" for k in ("lr", "betas", "eps", "weight_decay", "params"))]
    sent = []
    for rank in range(ranks):
        items, mappings = [], {}
        for name, shape, offset, local, _ in pieces(rank, layout, all_specs):
            for fqn, dtype in ((f"model.{name}", torch.bfloat16), (f"optim.state.{name}.exp_avg", torch.float32),
                               (f"optim.state.{name}.exp_avg_sq", torch.float32)):
                offsets, sizes = torch.Size(offset), torch.Size(local)  # as _create_write_items_for_dtensor
                items.append(WriteItem(index=MetadataIndex(fqn, offsets), type=WriteItemType.SHARD,
                                       tensor_data=TensorWriteData(
                                           chunk=ChunkStorageMetadata(offsets=offsets, sizes=sizes),
                                           properties=TensorProperties.create_from_tensor(_meta(local, dtype)),
                                           size=torch.Size(shape))))
                mappings[fqn] = tuple(fqn.split("."))
        items.append(_create_write_item_for_tensor(f"rng.{rank}", _meta((RNG_BYTES,), torch.uint8)))
        items += [_create_write_item_for_bytesio(fqn, None) for fqn in (*values, f"loader.{rank}")]
        mappings.update({fqn: tuple(fqn.split(".")) for fqn in (*values, f"rng.{rank}", f"loader.{rank}")})
        sent.append(pickle.dumps(SavePlan(items, planner_data=mappings), pickle.HIGHEST_PROTOCOL))
    return sent


def run_dcp(ranks: int, layout: tuple[int, int, int], all_specs: list[Spec], memory: bool) -> dict[str, Any]:
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.checkpoint.planner import SavePlan, SavePlanner

    out = Measured()
    started = time.perf_counter()
    sent = _dcp_plans(ranks, layout, all_specs)
    out.update(build_s_per_rank=(time.perf_counter() - started) / ranks, report_bytes_per_rank=max(map(len, sent)))
    plans = out.time("decode", lambda: [pickle.loads(b) for b in sent])
    sent.clear()

    def plan() -> list[bytes]:
        global_plan, metadata = out.time("plan", lambda: DefaultSavePlanner().create_global_plan(plans))
        blobs = out.time("encode", lambda: [pickle.dumps(p, pickle.HIGHEST_PROTOCOL) for p in global_plan])
        root = out.time("root", lambda: pickle.dumps(metadata, pickle.HIGHEST_PROTOCOL))  # the .metadata file
        out.update(root_bytes=len(root), plan_bytes_per_rank=max(map(len, blobs)),
                   plan_bytes_mean=sum(map(len, blobs)) / len(blobs))
        return blobs

    plan()
    out["peak_mib"] = peak_mib(lambda: DefaultSavePlanner().create_global_plan(plans)) if memory else None
    caching = DefaultSavePlanner(enable_plan_caching=True)
    caching._cached_plans_key = f"scale-{ranks}"
    caching.create_global_plan(plans)
    plans.clear()
    unchanged = [pickle.dumps(SavePlan([], usable=False), pickle.HIGHEST_PROTOCOL)] * ranks
    out.time("replan", lambda: caching.create_global_plan([pickle.loads(b) for b in unchanged]))
    for cache in ("_cached_all_plans", "_cached_global_plan", "_cached_metadata"):
        getattr(SavePlanner, cache).pop(caching._cached_plans_key, None)
    return dict(out)


# --------------------------------------------------------------------------------------------- report


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3g}" if value < 100 else f"{value:,.0f}"
    return f"{value:,}"


COLUMNS = [("ranks", "ranks"), ("pieces", "pieces"), ("decode_s", "decode s"), ("plan_s", "plan s"),
           ("plan_cpu_s", "plan CPU s"), ("encode_s", "encode s"), ("peak_mib", "peak MiB"),
           ("report_bytes_per_rank", "sent B/rank"), ("plan_bytes_per_rank", "plan B/rank"), ("root_bytes", "root B"),
           ("root_s", "root s"), ("replan_s", "replan s"), ("replan_bytes_per_rank", "replan B/rank")]
RATIOS = ["decode_s", "plan_s", "plan_cpu_s", "encode_s", "peak_mib", "plan_bytes_per_rank", "root_bytes", "replan_s"]


def table(rows: list[dict[str, Any]], system: str) -> str:
    lines = [f"{system}", "| " + " | ".join(h for _, h in COLUMNS) + " |", "|" + " --- |" * len(COLUMNS)]
    lines += ["| " + " | ".join(_fmt(row.get(k)) for k, _ in COLUMNS) + " |" for row in rows]
    return "\n".join(lines)


def _reported_chunks(save_plan: Any) -> list[dict[str, dict[int, int]]]:
    """Per rank, the chunks its write tasks cover (by array path, with a fabricated checksum): what each rank's
    ``write_all`` reports in a real save."""
    out: list[dict[str, dict[int, int]]] = []
    for rank_tasks in save_plan.tasks:
        sums: dict[str, dict[int, int]] = {}
        for task in rank_tasks:
            array = save_plan.arrays[task.path]
            counts = [-(-n // c) for n, c in zip(array.shape, array.outer_chunk, strict=True)]
            cells = [np.arange(o // c, -(-(o + n) // c)) for o, n, c in
                     zip(task.box.offset, task.box.shape, array.outer_chunk, strict=True)]
            flat = np.ravel_multi_index(np.meshgrid(*cells, indexing="ij"), counts).ravel() if cells else [0]
            sums.setdefault(task.path, {}).update(dict.fromkeys(np.asarray(flat).tolist(), 0))
        out.append(sums)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", default=",".join(map(str, DEFAULT_RANKS)), help="world sizes, comma-separated")
    parser.add_argument("--no-dcp", action="store_true", help="arrayckpt only")
    parser.add_argument("--dcp-memory-max", type=int, default=16384,
                        help="measure DCP's peak memory (tracemalloc, slow) up to this many ranks")
    parser.add_argument("--json", help="write every number to this file")
    args = parser.parse_args(argv)
    all_specs = specs()
    results = []
    for ranks in (int(r) for r in args.ranks.split(",")):
        layout = mesh(ranks)
        row: dict[str, Any] = {"ranks": ranks, "tp_pp_dp": layout, "arrayckpt": run_arrayckpt(ranks, layout, all_specs)}
        if not args.no_dcp:
            row["dcp"] = run_dcp(ranks, layout, all_specs, ranks <= args.dcp_memory_max)
            row["dcp"]["pieces"] = row["arrayckpt"]["pieces"]
        results.append(row)
        print(f"# {ranks} ranks (TP {layout[0]} x PP {layout[1]} x DP {layout[2]}) done", file=sys.stderr, flush=True)
    print(table([{"ranks": r["ranks"], **r["arrayckpt"]} for r in results], "arrayckpt"))
    if not args.no_dcp:
        print()
        print(table([{"ranks": r["ranks"], **r["dcp"]} for r in results], "dcp"))
        print()
        print("ratios, DCP / arrayckpt (> 1: arrayckpt is faster or smaller)")
        print("| ranks | " + " | ".join(dict(COLUMNS)[k] for k in RATIOS) + " |\n|" + " --- |" * (len(RATIOS) + 1))
        for r in results:
            a, d = r["arrayckpt"], r["dcp"]
            ratio = [d[k] / a[k] if d.get(k) and a.get(k) else None for k in RATIOS]
            print(f"| {r['ranks']:,} | " + " | ".join(_fmt(x) for x in ratio) + " |")
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": platform.platform(), "python": sys.version,
                                               "torch": torch.__version__, "results": results}, indent=1))
    last = results[-1]
    a = last["arrayckpt"]
    dcp_plan = last.get("dcp", {}).get("plan_s")
    ratio = f"{dcp_plan / a['plan_s']:.1f}" if dcp_plan else "nan"
    print(f"scale: ranks={last['ranks']} plan_s={a['plan_s']:.3f} dcp_plan_s="
          f"{'nan' if dcp_plan is None else f'{dcp_plan:.3f}'} ratio={ratio} peak_mib={a['peak_mib']:.0f} "
          f"plan_bytes_per_rank={a['plan_bytes_per_rank']} replan_s={a['replan_s']:.3f}")


if __name__ == "__main__":
    main()
