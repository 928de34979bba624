"""Requests to a TensorStore kvstore (an object-storage prefix), each naming the checkpoint in its errors.

Shared by the object-storage location and writer (``object.py``) and the leases of live saves and managers
(``liveness.py``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .._errors import StorageError

if TYPE_CHECKING:
    import tensorstore as ts

__all__ = ["delete_keys", "list_keys", "read_key", "wait_all", "write_key"]


def read_key(store: ts.KvStore, key: str, where: object) -> bytes | None:
    """The object's bytes (``None``: no such object)."""
    try:
        result = store.read(key).result()
    except Exception as e:
        raise StorageError(f"{where}: reading {key} failed: {e}") from e
    return result.value if result.state == "value" else None


def write_key(store: ts.KvStore, key: str, data: bytes,
              where: object) -> ts.Future[ts.KvStore.TimestampedStorageGeneration]:
    """Start writing one object; the future of its write."""
    try:
        return store.write(key, data)
    except Exception as e:
        raise StorageError(f"{where}: writing {key} failed: {e}") from e


def list_keys(store: ts.KvStore, where: object) -> list[str]:
    """Every key below the store's path (one LIST per 1,000 objects on S3)."""
    try:
        return [k.decode() for k in store.list().result()]
    except Exception as e:
        raise StorageError(f"{where}: listing failed: {e}") from e


def delete_keys(store: ts.KvStore, keys: list[str], where: object) -> None:
    """Delete these objects. One DELETE per object: writing None deletes a single key (``delete_range`` over a
    one-key range would first LIST that range on S3/GCS, doubling the requests of every clean-up)."""
    wait_all([(key, store.write(key, None)) for key in keys], where, "deleting")


def wait_all(pending: list[tuple[str, ts.Future[Any]]], where: object, what: str) -> None:
    """Wait for every (name, future), then raise one error naming the first failure and how many failed."""
    errors = []
    for name, future in pending:
        try:
            future.result()
        except Exception as e:
            errors.append(f"{name or '/'}: {e}")
    if errors:
        raise StorageError(f"{where}: {what} failed: {errors[0]} ({len(errors)} object(s) failed)")
