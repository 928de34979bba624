"""The checkpoint manager's wing: which steps to keep, how to store a step, when to save, each in its own module.

- ``policy.py``: the policies, plain values without IO or torch: :class:`Interval` (when to save, with Young's and
  Daly's optimal intervals), :class:`Retention` (which steps to keep), :class:`Incremental` (when a delta chain
  starts over);
- ``steptree.py``: :class:`StepTree`, the step checkpoints under one root (listing, retention in a crash-consistent
  order, clean-up);
- ``restore.py``: resuming from the newest step that reads back whole, from whichever tier's source of it does;
- ``copier.py``: :class:`StepCopier`, the remote tier's background thread that copies committed local steps to it;
- ``tiers.py``: :class:`Tier` (the interface the manager holds every tier by), :class:`LocalTier`,
  :class:`RemoteTier` and :class:`Remote` (the remote tier's configuration);
- ``signals.py``: SIGTERM (preemption): finish the save in flight, save, exit;
- ``manager.py``: :class:`CheckpointManager`, which holds the tiers in one list and ties the above together.

Glossary (one noun per concept):

- **Tier**: a place a manager keeps steps in, named ``"memory"``, ``"local"`` or ``"remote"``; a manager holds its
  tiers in one list, fastest first, and asks each for its steps, a step's restore source, clean-up and close.
- **LocalTier**: the manager's root, where every save commits first (a :class:`StepTree` and the coordinator's
  :class:`HeldRoot` of the root).
- **RemoteTier**: a second root, built from a :class:`Remote`: a :class:`StepTree`, its :class:`HeldRoot` and the
  :class:`StepCopier` that fills it.
- **MemoryTier** (``arrayckpt._peer.tier``): the newest steps in node-local shared memory, replicated to other nodes,
  built from a :class:`PeerMemory` over the node's :class:`NodeMemory`.
- **StepTree**: the ``step-<step:08d>`` checkpoints right below one root.
- **HeldRoot** (``arrayckpt._storage.liveness``): the coordinator's hold on a root (spec §9.4: a ``flock`` locally, a
  lease on object storage) from construction to close.
- **StepCopier**: the remote tier's thread that *copies* each committed local step there (the public API calls these
  copies uploads: ``wait_for_uploads``, ``upload_errors``).
- **Flush**: making a memory step durable in the local tier (``flush_memory``); writing data to disk is *fsync*.
- **Retention**, **Interval**: which steps a tier keeps, and when a save is due (``policy.py``).

Imports run down this list's reverse: ``manager.py`` imports the others, ``tiers.py`` imports ``copier.py``,
``restore.py`` and ``steptree.py``; ``copier.py`` and ``steptree.py`` import ``policy.py``; nothing here imports
``manager.py``. The peer-memory tier (``arrayckpt._peer``) is a layer below this one: its :class:`MemoryTier` meets
:class:`Tier` structurally, without importing it. This ``__init__`` imports nothing, so that ``policy.py`` loads
without torch.
"""
