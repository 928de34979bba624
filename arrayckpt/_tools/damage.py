"""One problem :func:`arrayckpt.verify` found: :class:`Damage` (its own module, so that the checks of a packed
checkpoint, ``verify_packs.py``, report damage the same way without importing ``verify.py``)."""

from __future__ import annotations

from dataclasses import dataclass

from .._format.jsontypes import JSON

__all__ = ["Damage"]


@dataclass(frozen=True)
class Damage:
    """One problem :func:`verify` found.

    Attributes:
        key: the entry it affects (``None``: the checkpoint as a whole).
        file: the path inside the checkpoint, e.g. ``model/w/c.1.0`` or ``zarr.json``.
        problem: what is wrong, in words.

    Examples:
        >>> import arrayckpt, torch, tempfile, os
        >>> path = os.path.join(tempfile.mkdtemp(), "ckpt")
        >>> arrayckpt.save({"w": torch.ones(4)}, path)
        >>> os.remove(os.path.join(path, "w", "zarr.json"))
        >>> damage = arrayckpt.verify(path).damage[0]
        >>> damage.key, damage.file
        ('w', 'w/zarr.json')
    """

    key: str | None
    file: str
    problem: str

    def to_dict(self) -> JSON:
        return {"key": self.key, "file": self.file, "problem": self.problem}
