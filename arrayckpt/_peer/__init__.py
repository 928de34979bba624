"""The peer-memory tier of a checkpoint manager: the newest steps kept in node-local shared memory, replicated to
other nodes over the job's process group, restored from the survivors onto any number of ranks.

A memory step is an ordinary arrayckpt checkpoint tree (the chunk files, keys, checksums and root document a
durable save of the same state writes), spread over the nodes: each node's directory holds the chunks its own ranks
wrote plus the replicas it received, and every node holds the documents. Design: ``docs/PEER_MEMORY.md``; on disk:
``spec/FORMAT.md`` §15.

- ``config.py``: :class:`PeerMemory` (the user's settings) and the placement of replicas over failure domains;
- ``private.py``: the memory directory made private and checked to be (no other user may change it);
- ``record.py``: a memory step's record (every chunk file with what its bytes must be) and the check of a file;
- ``node.py``: one node's directory (its steps, what it holds intact, retention; nothing read or written through a
  link);
- ``sweep.py``: memory directories of ended jobs, removed whole or not at all;
- ``wire.py``: chunk files sent between ranks over ``torch.distributed`` point-to-point calls;
- ``save.py``: a memory save (staged on the host; in the background, the ordinary save path into node-local
  directories, then the replication);
- ``restore.py``: a restore from the survivors (survey, choice of step, fetches, the ordinary load), with
  ``needs.py``: which chunk files a rank's targets read;
- ``flush.py``: the flush: a memory step made durable, its chunk files copied as stored to the local tier;

This package may use torch.distributed and every layer below the manager; the manager calls it through
:class:`MemoryTier` only (``tier.py``: one of the manager's tiers, over :func:`start_memory_save`,
:func:`memory_restore`, :func:`flush_memory_step`, :meth:`NodeMemory.clean_up`).
"""
