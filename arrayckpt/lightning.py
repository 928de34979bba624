"""arrayckpt for PyTorch Lightning: ``Trainer(plugins=[ArrayckptIO()])`` saves every checkpoint as an arrayckpt
checkpoint, and ``Trainer.fit(ckpt_path=...)`` resumes from one.

Needs ``pytorch_lightning`` (``pip install 'arrayckpt[lightning]'``) or the ``lightning`` package; the plug-in is a
``CheckpointIO`` of whichever is installed (of both, where both are). See
:class:`~arrayckpt._integrations.lightning_io.ArrayckptIO` for what is saved, how paths, pickle, asynchronous saves
and removals work.

>>> from arrayckpt.lightning import ArrayckptIO
>>> ArrayckptIO(asynchronous=True).asynchronous
True
"""

from __future__ import annotations

from ._integrations.lightning_io import ArrayckptIO

__all__ = ["ArrayckptIO"]
