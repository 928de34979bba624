"""The write layer: ``save`` and its options (``save.py``, ``options.py``), describing a rank's state
(``describe.py``), the planning exchange with the coordinator (``exchange.py``), the one commit sequence every
writer uses (``transaction.py``), a synchronous save of device tensors copied to host buffers a batch at a time
while the previous batch is written (``devicewrite.py``), asynchronous saves (``asynchronous.py``; the reusable
host buffers they and peer-memory saves stage into: ``hostcopies.py``), streaming writes for converters
(``stream.py``), a rank's pack and the chunk table of a packed save (``packed.py``), incremental change
detection (``changes.py``) and compaction of delta chains (``compact.py``).
"""
