"""The layout layer: where each byte goes, decided from metadata alone (pure functions, no IO, no torch).

Boxes and chunk grids (``box.py``), the chunking policy and each array's Zarr metadata (``chunking.py``), the
coordinator's save plan — validation of the global picture, writer assignment (``saveplan.py``) — and the delta
plan of incremental saves (``delta.py``).
"""
