"""The layout layer: where each byte goes, decided from metadata alone (pure functions: no IO, no torch). It keeps
state in one object only, a ``PlanCache``, which its caller holds: the coordinator's last Layout and the RankLayout
each rank of the process received, so that a save laid out as the last one reuses them.

The nouns of a save's plan, in the order a save meets them (``_write/exchange.py``: who sends what):

================  ====================================  ======================  ================  ======================
noun              what it is                            made by                 held by           travels to
================  ====================================  ======================  ================  ======================
LocalDescription  one rank's state as metadata: its     ``describe_local`` on   the rank          the coordinator, in a
                  pieces (``ArrayTable`` columns),      each rank (DCP: from                      ``Report``
                  values, per-rank values, containers,  its write items)
                  aliases
Fresh             one rank's plain and per-rank values  each rank               the rank          the coordinator, in a
                  of this save                                                                    ``Report``
PieceChange       a delta save's finding: which chunks  ``find_changes`` on     the rank          the coordinator, in a
                  or rows of a piece changed since the  each rank                                 ``Report``
                  base
ArrayPlan         one Zarr array: key, path, dtype,     ``plan_layout``;        Layout,           within those
                  shape, chunk grids, codec             ``plan_array`` (one     SavePlan,
                                                        alone); ``expand``      RankPlan
Layout            the reusable part of a save's plan:   ``plan_layout`` on the  its PlanCache     nowhere (each rank
                  the arrays (ArrayPlans, entries,      coordinator                               gets its RankLayout)
                  TaskTable, each rank's bytes), every
                  key's place, the documents, and what
                  it was planned from (fingerprints,
                  codecs, chunk policy)
TaskTable         every rank's WriteTasks as numpy      ``plan_layout``         Layout.tasks      nowhere
                  columns (``table[r]``: rank r's, as
                  objects)
SavePlan          one save's plan: a Layout with this   ``assemble``,           the coordinator,  nowhere (each rank
                  save's values (a delta's: only what   ``plan_save``;          for one save      gets its part)
                  changed); what the transaction        ``plan_delta``
                  writes
RankLayout        one rank's share of a Layout as       ``rank_layouts`` on     that rank's slot  that rank alone, in
                  numpy arrays: per task the row of     the coordinator         of its PlanCache  its ``Reply``, once
                  its own description, box, chunk                               (``Held``)        per Layout
                  shapes, codec
RankPlan          what one rank writes: its Tasks,      ``expand`` of a         the rank, for     a delta's: that rank,
                  their ArrayPlans (a delta's: and      RankLayout on the       one save          in its ``Reply``
                  their entries)                        rank;
                                                        ``explicit_part`` (a
                                                        delta's)
Task              one write: a ``WriteTask`` (a box of  ``plan_layout``;        TaskTable,        within a RankPlan
                  an array) or a ``RowsTask`` (a rows   ``plan_delta``          SavePlan,
                  delta's rows of a piece)                                      RankPlan
PlanCache         what a caller keeps between saves:    its caller: one per     its caller        nowhere
                  the coordinator's last Layout, and    process group
                  by (rank, world size) the RankLayout  (``plan_cache_for``),
                  each rank of this process holds       manager, DCP writer
================  ====================================  ======================  ================  ======================

- ``box.py``: boxes (n-dimensional ranges), chunk grids, and whether boxes tile an array;
- ``pieces.py``: ``LocalDescription`` (its pieces as columns) and its fingerprint;
- ``chunking.py``: the chunking policy and ``ArrayPlan``;
- ``planner.py``: a Layout's arrays from every rank's pieces (tiling checked, chunk grids, one writer per chunk),
  and ``TaskTable``;
- ``saveplan.py``: ``Layout`` and ``SavePlan`` (``plan_layout``, ``assemble``, ``plan_save``), documents;
- ``plainvalues.py``: ``ValueLayout``: which plain values each rank sends, and one that differs between ranks
  stored per rank;
- ``tasks.py``: ``WriteTask``, ``RowsTask`` (``Task``);
- ``rankplan.py``: ``RankLayout``, ``RankPlan``;
- ``plancache.py``: ``PlanCache``;
- ``delta.py``: ``plan_delta``, the delta SavePlan of incremental saves;
- ``digests.py``: which chunks each array's digest covers, and who wrote each chunk.
"""
