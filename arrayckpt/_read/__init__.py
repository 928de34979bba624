"""The read layer: a committed checkpoint opened as lazy arrays (``checkpoint.py``, ``lazy.py``), the one read
path every read goes through (``reader.py``), reads through a chain of delta checkpoints (``chain.py``), and
``load`` into a training state (``load.py``, the only module here that needs torch at import). The modules below
``checkpoint.py`` see an opened checkpoint through the protocol in ``source.py``.
"""
