"""The read layer: a committed checkpoint opened as lazy arrays (``checkpoint.py``: the public ``Checkpoint``;
``lazy.py``: ``LazyArray``), what an opened checkpoint holds on storage and every check its reads need
(``stored.py``: ``StoredCheckpoint``, which the tools and converters reach through ``checkpoint.stored_of``), the one
read path every read goes through (``reader.py``), reads through a chain of delta checkpoints (``chain.py``),
where a packed checkpoint's chunk files lie (``packed.py``), and
``load`` into a training state (``load.py``; its device targets are filled through pooled host buffers, a batch
copied while the next is read: ``deviceload.py``; the only modules here that need torch at import, with
``together.py``: an atomic load on several ranks that restores all of them or none; ``keyhint.py``: the key prefix a
mismatch names; ``perrank.py``: the ``per_rank`` policy of a load at another world size than the save's). The
modules below ``stored.py`` see an opened checkpoint through the protocol in ``source.py``.
"""
