"""Tools on committed checkpoints: ``verify`` (every byte checked), ``show`` and ``diff`` (``inspect.py``),
chunk-by-chunk access with bounded memory (``chunkwise.py``), and back-of-the-envelope sizing and checkpoint
intervals (``estimate.py``, ``interval.py``).
"""
