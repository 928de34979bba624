"""The read layer: a committed checkpoint opened as lazy arrays (``checkpoint.py``, ``lazy.py``), the one read
path every read goes through (``reader.py``), reads through a chain of delta checkpoints (``chain.py``), and
``load`` into a training state (``load.py``; its device targets are filled through pooled host buffers, a batch
copied while the next is read: ``deviceload.py``; the only two modules here that need torch at import). The
modules below ``checkpoint.py`` see an opened checkpoint through the protocol in ``source.py``.
"""
