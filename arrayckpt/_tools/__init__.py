"""Tools on committed checkpoints, as a library (their command line is ``arrayckpt/_cli/``):

- ``verify.py``: :func:`verify`, every stored byte read and checked, all the damage reported (``damage.py``: what
  it reports; ``verify_packs.py``: what it checks of a packed checkpoint's packs and index);
- ``inspect.py``: :func:`show` and :func:`diff`, values and comparisons without loading whole tensors;
- ``chunkwise.py``: chunk-by-chunk access with bounded memory (what ``verify`` and ``diff`` walk);
- ``copy.py``: :func:`copy`, a checkpoint and its chain of bases copied as stored between locations;
  ``copy_files.py``: its chunk files copied, checked on the way, at a bounded rate; ``copy_packs.py``: a packed
  checkpoint's packs copied whole, every chunk in them checked;
- ``refs.py``: :func:`write_refs`, a packed checkpoint's kerchunk references written on demand (and the one way
  ``copy`` makes them too);
- ``estimate.py``: back-of-the-envelope sizing, and :func:`human_bytes`;
- ``report/``: :func:`report`, a picture of a checkpoint as one HTML file.

How often to checkpoint (Young/Daly) is a manager policy: ``_manage/policy.py``.
"""
