"""Other stacks' plug-in points: arrayckpt as the storage behind their checkpoint APIs.

- ``dcp_storage.py``: :class:`ArrayckptWriter`, a PyTorch Distributed Checkpoint (DCP) ``StorageWriter`` that
  writes what ``torch.distributed.checkpoint.save`` plans as a normal arrayckpt checkpoint, through arrayckpt's
  own planner, write path and commit;
- ``dcp_reader.py``: :class:`ArrayckptReader`, a DCP ``StorageReader`` that loads any arrayckpt checkpoint
  (saved by ``arrayckpt.save``, by the writer above, converted, a delta chain, on object storage) into any
  DCP-planned state through arrayckpt's one read path;
- ``dcp_keys.py``: how DCP's flattened keys and arrayckpt's keys map onto each other, both ways;
- ``dcp_values.py``: DCP's non-tensor items as arrayckpt's plain values (or, with consent, pickles);
- ``dcp_options.py``: what the two make of the arguments of DCP's ``FileSystemWriter``/``FileSystemReader``;
- ``dcp_ties.py``: tied weights through DCP's writer, stored once;
- ``lightning_io.py``: PyTorch Lightning's ``CheckpointIO`` plug-in (see its docstring); ``lightning_callbacks.py``:
  its callbacks' states under readable keys;
- ``deepspeed_engine.py``: fills an initialised DeepSpeed ZeRO engine's partitions from an arrayckpt checkpoint
  (``arrayckpt.deepspeed.load``), each rank reading only its slices;
- ``torchtitan_manager.py``: TorchTitan's ``CheckpointManager`` with arrayckpt as DCP's storage.

The public names are re-exported by ``arrayckpt.dcp``, ``arrayckpt.deepspeed``, ``arrayckpt.lightning`` and
``arrayckpt.torchtitan``. This
layer sits above everything else of the package (``tests/test_architecture.py``): it may use any of it, and
nothing below imports it.
"""
