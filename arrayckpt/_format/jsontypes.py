"""The one type of a JSON object as arrayckpt builds or parses it: ``zarr.json`` documents, the manifest, a
safetensors header, a report's data.

``JSON`` is ``dict[str, object]``, not ``dict[str, Any]``: a field read from a parsed document is ``object`` until
the reader checks it (``isinstance``, or a ``parse_*`` validator that raises naming the field), so the type checker
holds every reader to the check that a crafted or damaged document needs anyway.
"""

from __future__ import annotations

from typing import TypeAlias

__all__ = ["JSON"]

JSON: TypeAlias = dict[str, object]
