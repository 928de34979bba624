"""The format layer: what the bytes of a checkpoint mean, with no IO and no torch.

The manifest and the root document (``manifest.py``), Zarr v3 node metadata and chunk keys (``zarr.py``), state
keys and their array paths (``keys.py``), plain values as typed JSON (``values.py``), the dtype table
(``dtypes.py``), codec pipelines (``codecs.py``), quantized delta rows (``quant.py``), aliases (``alias.py``), which
rank wrote each chunk (``writers.py``), the root checksum and chunk digests (``integrity.py``), stored chunk files
checked without decoding (``stored.py``), the packed layout's chunk table, index file and kerchunk references
(``packs.py``), the DCP marker that DCP-based trainers find a checkpoint by (``marker.py``) and the type of a JSON
object (``jsontypes.py``). Everything above reads and writes through these definitions; ``spec/FORMAT.md`` is
their normative description.
"""
