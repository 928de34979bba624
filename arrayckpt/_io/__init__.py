"""The array IO layer: moving array bytes between memory and storage through TensorStore (``arrays.py``),
with a positional-IO fast path for uncompressed local chunks (``fastio.py``), decoding a chunk file held in memory
(``decode.py``), the chunk files of packed arrays staged in memory for TensorStore to decode (``staged.py``;
of a shard, only the inner chunks a read needs: ``shards.py``),
niced workers for background IO (``priority.py``) and worker threads kept for the process
(``pools.py``), and small files read whole only as regular files of bounded size, never through a link inside a
checkpoint (``smallfiles.py``). Specs in, bytes out; it knows nothing of checkpoints, manifests or torch.
"""
