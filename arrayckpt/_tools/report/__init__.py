"""``report``: a picture of a checkpoint as one self-contained HTML file (:func:`arrayckpt.report`).

- ``build.py``: :func:`report`, :func:`collect` (one pass over the tensors, bounded memory) and the writing;
- ``data.py``: what a report shows, as values (statistics, histograms, chunk grids, the chain, the tree of sizes);
- ``layout.py``: where the bytes are, from metadata (chunk grids and their writers, the chain, what a delta stores);
- ``figures.py``, ``grids.py``, ``style.py``: the pictures (matplotlib, an optional extra, imported when drawing);
- ``page.py``: the HTML page.

The command line's side is ``arrayckpt/_cli/report.py``. This ``__init__`` imports nothing.
"""
