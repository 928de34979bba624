"""The layout layer: where each byte goes, decided from metadata alone (pure functions: no IO, no torch). It keeps
state in one object only, a ``PlanCache``, which its caller holds: the coordinator's last Layout and the RankLayout
each rank of the process received, so that a save laid out as the last one reuses them.

- ``box.py``: boxes (n-dimensional ranges) and chunk grids;
- ``chunking.py``: the chunking policy and each array's Zarr metadata (``ArrayPlan``);
- ``pieces.py``: what each rank describes of its state (``LocalDescription``, its pieces as columns), and its
  fingerprint;
- ``planner.py``: a Layout's arrays from every rank's pieces (tiling checked, chunk grids, one writer per chunk);
- ``saveplan.py``: the coordinator's save plan (``SavePlan``, its reusable ``Layout``): validation, values,
  documents;
- ``tasks.py``: what a rank writes (``WriteTask``, ``RowsTask``: a ``Task``);
- ``rankplan.py``: each rank's part of a plan (``RankLayout``, ``RankPlan``);
- ``plancache.py``: ``PlanCache``, what a caller keeps to plan its next save faster;
- ``delta.py``: the delta plan of incremental saves;
- ``digests.py``: which chunks each array's digest covers, and who wrote each chunk.
"""
