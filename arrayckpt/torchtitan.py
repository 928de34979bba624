"""arrayckpt for TorchTitan: every step saved and resumed as an arrayckpt checkpoint, with one change of the
trainer's configuration::

    from arrayckpt.torchtitan import ArrayckptCheckpointManager
    config.checkpoint = ArrayckptCheckpointManager.Config(enable=True, folder="checkpoint", interval=500)

Needs ``torchtitan``. :class:`~arrayckpt._integrations.torchtitan_manager.ArrayckptCheckpointManager` is TorchTitan's
own ``CheckpointManager`` with arrayckpt as DCP's storage; its module docstring says what changes and what does not.
"""

from __future__ import annotations

from ._integrations.torchtitan_manager import ArrayckptCheckpointManager

__all__ = ["ArrayckptCheckpointManager"]
