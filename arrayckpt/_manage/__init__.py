"""The checkpoint manager's wing: which steps to keep, how to store a step, when to save, each in its own module.

- ``policy.py``: the policies, plain values without IO or torch: :class:`Interval` (when to save, with Young's and
  Daly's optimal intervals), :class:`Retention` (which steps to keep), :class:`Incremental` (when a delta chain
  starts over);
- ``tiers.py``: :class:`StepTree` (the step checkpoints under one root: listing, retention in a crash-consistent
  order, clean-up) and :class:`Remote` (the second tier's settings);
- ``uploader.py``: the background thread that copies committed local steps to the remote tier;
- ``restore.py``: resuming from the newest step that reads back whole, from whichever tier holds it;
- ``signals.py``: SIGTERM (preemption): finish the save in flight, save, exit;
- ``manager.py``: :class:`CheckpointManager`, which holds the roots and ties the above together.

Imports run down this list's reverse: ``manager.py`` imports the others, ``uploader.py`` imports ``tiers.py``, which
imports ``policy.py``; nothing here imports ``manager.py``. The peer-memory tier (``arrayckpt._peer``) is a layer
below this one. This ``__init__`` imports nothing, so that ``policy.py`` loads without torch.
"""
