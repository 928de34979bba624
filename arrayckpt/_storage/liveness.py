"""How a live save or a live manager is recognised, so that gc and clean-up never remove what it holds (spec §9.4).

Locally, through advisory ``flock(2)`` locks, which die with their process (nothing to expire after a crash):

- a save's temporary directory ``T`` (``.<name>.arrayckpt-tmp-*``): the save's coordinator holds a *shared* lock on
  the directory itself from right after creating it until its commit renamed it into place or its abort removed it
  (:func:`hold_directory`). gc and clean-up remove ``T`` only while they hold the *exclusive* lock (taken without
  waiting: :func:`exclusive_directory`), so never a directory a live save holds, whatever the minimum age. A save
  whose ``T`` was removed between its ``mkdir`` and its lock sees it (the directory's identity) and takes another.
- a manager's root: an exclusive lock on the file ``ROOT/.arrayckpt-manager.lock``, which names its holder (host,
  pid) for the error the next manager gets (:class:`RootLock`).

On object storage, through *lease* objects (:class:`Lease`): a small JSON object naming the holder and when the lease
expires (``expires``, epoch seconds by the holder's clock), rewritten every ``lease_renew_s`` seconds (``_settings.py``)
by a background thread (conditionally on the generation it last wrote, so a holder that lost its lease to another learns
it) and deleted when the holder is done; a crashed holder's lease expires ``lease_ttl_s`` seconds after its last
renewal.

- ``P/.arrayckpt-lease``: a save to a prefix ``P`` that holds no committed checkpoint (a first save; gc never touches
  a committed prefix). gc keeps ``P`` while the lease is live.
- ``ROOT/.arrayckpt-manager-lease``: a manager's root.

A lease object is untrusted input like any other: one that does not parse, or claims to be live for longer than
:data:`MAX_LEASE_S`, counts as expired.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import fcntl
import json
import os
import shutil
import socket
import threading
import time
import uuid
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, cast

from .._errors import CheckpointBusyError, StorageError
from .._settings import settings
from .base import LEASE_NAME, TEMP_MARKER, Claim

if TYPE_CHECKING:
    import tensorstore as ts

    from .base import Location

__all__ = ["LEASE_NAME", "MANAGER_LEASE", "MANAGER_LOCK", "MAX_LEASE_S",
           "DirectoryHold", "HeldRoot", "Holder", "Lease", "RootLock", "create_held_directory", "exclusive_directory",
           "hold_directory", "live_holder"]

MANAGER_LOCK = ".arrayckpt-manager.lock"  # local manager root: the file its coordinator holds an exclusive flock on
MANAGER_LEASE = ".arrayckpt-manager-lease"  # object-storage manager root: its lease object
MAX_LEASE_S = 3600.0  # a lease claiming to be live for longer than this was not written by arrayckpt: expired
_UNSUPPORTED = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL, errno.EBADF)  # no flock here


@dataclass(frozen=True)
class Holder:
    """Who holds a lock or lease, as it says itself (shown in errors; a lease's ``expires`` decides if it is live)."""

    host: str
    pid: int
    since: float  # epoch seconds
    id: str = ""
    expires: float | None = None  # leases only: epoch seconds (by the holder's clock)

    @classmethod
    def here(cls, ttl_s: float | None = None) -> Holder:
        now = time.time()
        return cls(socket.gethostname(), os.getpid(), now, uuid.uuid4().hex, None if ttl_s is None else now + ttl_s)

    def renewed(self, ttl_s: float) -> Holder:
        return Holder(self.host, self.pid, self.since, self.id, time.time() + ttl_s)

    def encode(self) -> bytes:
        return json.dumps({"arrayckpt_lease": 1, "host": self.host, "pid": self.pid, "since": self.since,
                           "id": self.id, "expires": self.expires}).encode()

    @classmethod
    def decode(cls, data: bytes | None) -> Holder | None:
        """The holder a lock file or lease object names (``None``: nothing there, or not one arrayckpt wrote)."""
        try:
            document = json.loads(data) if data else None
        except (ValueError, RecursionError):
            return None
        if not isinstance(document, dict) or document.get("arrayckpt_lease") != 1:
            return None
        host, pid, since, ident, expires = (document.get(k) for k in ("host", "pid", "since", "id", "expires"))
        numbers = (pid, since) + (() if expires is None else (expires,))
        if not (isinstance(host, str) and isinstance(ident, str)
                and all(isinstance(n, (int, float)) and not isinstance(n, bool) for n in numbers)):
            return None
        return cls(host[:200], int(cast(float, pid)), float(cast(float, since)), ident[:64],  # numbers, checked above
                   None if expires is None else float(expires))

    def live(self, now: float | None = None) -> bool:
        """Whether a lease still holds: not expired, not claiming more than :data:`MAX_LEASE_S` ahead, and not held
        by a process of this host that is gone (a job restarted on the node where it crashed takes over at once)."""
        now = time.time() if now is None else now
        return self.expires is not None and now < self.expires <= now + MAX_LEASE_S and not self.dead_here()

    def dead_here(self) -> bool:
        """Whether the holder was a process of this host that no longer exists (``kill(pid, 0)``; a reused pid
        only makes a dead holder look alive: its lease then expires as usual), or this process, which no longer
        holds that lease (released, or its save failed and could not delete it)."""
        if self.host != socket.gethostname() or self.pid <= 0:
            return False
        if self.pid == os.getpid():  # this process: alive, but the lease is dead unless it still holds it
            return self.id not in _HELD
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return True
        except OSError:  # alive, someone else's
            return False
        return False

    def __str__(self) -> str:
        since = datetime.datetime.fromtimestamp(self.since, datetime.UTC).isoformat(timespec="seconds")
        text = f"pid {self.pid} on host {self.host!r}, since {since}"
        if self.expires is not None:
            text += f"; its lease expires in {max(0.0, self.expires - time.time()):.0f} s unless renewed"
        return text


_HELD: set[str] = set()  # ids of the leases this process holds now (one of its own that is not here is a dead one)


def live_holder(data: bytes | None) -> Holder | None:
    """The holder of a lease object's bytes when the lease is live (``None``: no lease, or an expired one)."""
    holder = Holder.decode(data)
    return holder if holder is not None and holder.live() else None


# --- local: a save's temporary directory --------------------------------------------------------------------------


class DirectoryHold:
    """A save's shared lock on its temporary directory, and the directory's identity (``(st_dev, st_ino)``)."""

    def __init__(self, fd: int, locked: bool) -> None:
        self._fd: int | None = fd
        self.locked = locked  # False where the filesystem has no flock: gc then goes by age alone
        info = os.fstat(fd)
        self.identity = (info.st_dev, info.st_ino)

    def still_at(self, path: Path) -> bool:
        """Whether ``path`` still names the directory held (one ``stat``): not removed, nor replaced."""
        try:
            info = os.stat(path, follow_symlinks=False)
        except OSError:
            return False
        return (info.st_dev, info.st_ino) == self.identity

    def release(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)  # releases the lock

    def __del__(self) -> None:  # a writer dropped without its commit or abort (a bug) keeps no descriptor open
        self.release()


def hold_directory(path: Path) -> DirectoryHold | None:
    """A shared lock on the directory ``path`` (a save's ``T``), waiting only while a gc holds it exclusively to
    remove it; ``None`` when ``path`` is gone by then (the caller takes another name)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except (FileNotFoundError, NotADirectoryError):
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
        locked = True
    except OSError as e:
        if e.errno not in _UNSUPPORTED:
            os.close(fd)
            raise StorageError(f"{path}: cannot lock the save's temporary directory: {e}") from e
        locked = False
    hold = DirectoryHold(fd, locked)
    if not hold.still_at(path):
        hold.release()
        return None
    return hold


def create_held_directory(path: Path, fresh_marker: str) -> DirectoryHold | None:
    """Create the directory ``path`` (a save's ``T``) already held (spec §9.4): made under a name of its own (its
    ``TEMP_MARKER`` replaced by ``fresh_marker``, which gc leaves alone while it is young), locked, then renamed to
    ``path``, so that no gc ever sees ``path`` unlocked. ``None`` when it was removed before the lock (the caller
    takes another name)."""
    fresh = path.with_name(path.name.replace(TEMP_MARKER, fresh_marker, 1))
    fresh.mkdir()
    hold = hold_directory(fresh)
    if hold is None:
        return None
    try:
        os.rename(fresh, path)
    except BaseException:
        hold.release()
        shutil.rmtree(fresh, ignore_errors=True)
        raise
    if not hold.still_at(path):
        hold.release()
        return None
    return hold


@contextlib.contextmanager
def exclusive_directory(path: Path) -> Iterator[str | None]:
    """For gc: hold the exclusive lock on the temporary directory ``path`` for the block, never waiting. Yields
    ``None`` when it may be removed (no live save holds it; where the filesystem has no flock, only the caller's age
    rule protects a save), or why it must stay."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except (FileNotFoundError, NotADirectoryError):
        yield "gone meanwhile (its save committed or gave up)"
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield "a save is running in it (it holds the directory's lock)"
            return
        except OSError as e:
            if e.errno not in _UNSUPPORTED:
                raise
        info, now = os.fstat(fd), None
        try:
            now = os.stat(path, follow_symlinks=False)
        except OSError:
            pass
        if now is None or (now.st_dev, now.st_ino) != (info.st_dev, info.st_ino):
            yield "gone meanwhile (its save committed or gave up)"
            return
        yield None
    finally:
        os.close(fd)


# --- local: a manager's root -----------------------------------------------------------------------------------


class RootLock(Claim):
    """An exclusive ``flock`` on ``ROOT/.arrayckpt-manager.lock``: the coordinator of the manager of ``ROOT`` holds it
    while the manager is open; it dies with the process (a restarted job is never blocked by a crashed one)."""

    def __init__(self, root: Path) -> None:
        self.path = root / MANAGER_LOCK
        self.holder = Holder.here()
        self._fd: int | None = None
        for _ in range(100):  # a holder's release removes the file: one opened before then is locked in vain
            fd = self._lock(root)
            self._fd, info = fd, os.fstat(fd)
            self._identity = info.st_dev, info.st_ino
            try:
                self.check()
            except CheckpointBusyError:
                self.release(unlink=False)
                continue
            os.ftruncate(fd, 0)
            os.pwrite(fd, self.holder.encode(), 0)
            return
        raise StorageError(f"{self.path}: the lock file kept changing while it was being locked")

    def _lock(self, root: Path) -> int:
        """Open (creating) the lock file and lock it without waiting; its descriptor."""
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        except OSError as e:
            raise StorageError(f"{root}: cannot create the manager's lock file {MANAGER_LOCK}: {e}") from e
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            try:
                other = Holder.decode(os.pread(fd, 4096, 0))
            finally:
                os.close(fd)
            raise CheckpointBusyError(f"{root}: another CheckpointManager holds this root "
                                      f"({other or 'holder unknown'}; lock file {self.path})") from None
        except OSError as e:
            if e.errno not in _UNSUPPORTED:
                os.close(fd)
                raise StorageError(f"{self.path}: cannot lock: {e}") from e
            warnings.warn(f"{self.path}: this filesystem does not support flock ({e}), so a second manager on this "
                          "root would not be noticed", RuntimeWarning, stacklevel=5)
        return fd

    def check(self) -> None:
        """Raise ``CheckpointBusyError`` unless the lock is still held on the file at the path (one ``stat``: a lock
        file removed by hand could let another manager lock a new one)."""
        try:
            info = os.stat(self.path, follow_symlinks=False)
            same = self._fd is not None and (info.st_dev, info.st_ino) == self._identity
        except OSError:
            same = False
        if not same:
            raise CheckpointBusyError(f"{self.path.parent}: this manager no longer holds the root (its lock file "
                                      f"{MANAGER_LOCK} was released, removed or replaced)")

    def release(self, unlink: bool = True) -> None:
        """Remove the lock file, then let the lock go (a manager that opened the removed file before finds, once it
        has the lock, that it is no longer the file at the path, and locks a new one)."""
        fd, self._fd = self._fd, None
        if fd is not None:
            if unlink:
                with contextlib.suppress(OSError):
                    os.unlink(self.path)
            os.close(fd)


# --- object storage: leases ---------------------------------------------------------------------------------------


class Lease(Claim):
    """A lease object at ``key`` of ``store`` (a TensorStore kvstore), taken at construction and renewed in the
    background until :meth:`release` (see the module docstring). Taking it: one GET (refused when another live lease
    is there), one PUT conditional on what the GET saw, one GET to read it back: 3 requests, which also prove the
    store reachable and writable. Raises ``CheckpointBusyError`` naming the holder, or ``StorageError``."""

    def __init__(self, store: ts.KvStore, key: str, where: str, what: str, patience_s: float = 0.0) -> None:
        self.store, self.key, self.where = store, key, where
        self.ttl_s, self.renew_s = settings().lease_ttl_s, settings().lease_renew_s
        self.holder = Holder.here(self.ttl_s)
        seen = self._wait_out(self._read(), patience_s)
        other = live_holder(seen.value if seen is not None else None)
        if other is not None:
            raise CheckpointBusyError(f"{where}: {what} ({other}; lease {key})")
        self._generation = self._put(self.holder, seen.stamp.generation if seen is not None else b"")
        again = self._read()
        found = Holder.decode(again.value if again is not None else None)
        if self._generation is None or found is None or found.id != self.holder.id:
            other = live_holder(again.value if again is not None else None)
            raise CheckpointBusyError(f"{where}: {what} ({other or 'another process took the lease at once'}; "
                                      f"lease {key})")
        _HELD.add(self.holder.id)
        self._renewed = time.monotonic()
        self._lost: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._renew, name="arrayckpt-lease", daemon=True)
        self._thread.start()

    def _wait_out(self, seen: ts.KvStore.ReadResult | None, patience_s: float) -> ts.KvStore.ReadResult | None:
        """Watch a live lease of another holder for up to ``patience_s``: until it expires (its holder is gone) or
        is renewed (its holder is alive: waiting longer is pointless). The lease object as last read."""
        deadline = time.monotonic() + patience_s
        while seen is not None and live_holder(seen.value) is not None and time.monotonic() < deadline:
            time.sleep(min(1.0, self.renew_s / 4, max(0.0, deadline - time.monotonic())))
            again = self._read()
            if again is not None and again.stamp.generation != seen.stamp.generation:
                return again  # renewed (or taken by a third holder): alive
            seen = again
        return seen

    def _read(self) -> ts.KvStore.ReadResult | None:
        """The lease object's read result (``None``: no such object)."""
        try:
            result = self.store.read(self.key).result()
        except Exception as e:
            raise StorageError(f"{self.where}: reading {self.key} failed: {e}") from e
        return result if result.state == "value" else None

    def _put(self, holder: Holder, if_equal: bytes) -> bytes | None:
        """Write the lease if the object is still the generation ``if_equal`` (``b""``: absent); the new generation,
        or ``None`` when it was not (someone else wrote or removed it)."""
        try:
            written = self.store.write(self.key, holder.encode(), if_equal=if_equal).result()
        except Exception as e:
            raise StorageError(f"{self.where}: writing {self.key} failed: {e}") from e
        return written.generation or None

    def _renew(self) -> None:
        while not self._stop.wait(self.renew_s):
            try:
                holder = self.holder.renewed(self.ttl_s)
                generation = self._put(holder, self._generation or b"")
            except StorageError:
                continue  # try again; check() refuses once the lease may have expired
            if generation is None:
                self._lost = "its lease was rewritten or removed by another process"
                return
            self.holder, self._generation, self._renewed = holder, generation, time.monotonic()

    def check(self) -> None:
        """Raise ``CheckpointBusyError`` unless the lease is still this holder's: not lost to another process, renewed
        within its TTL, and (one GET) still the object last written."""
        problem = self._lost
        if problem is None and time.monotonic() - self._renewed > self.ttl_s:
            problem = f"its lease could not be renewed for {self.ttl_s:g} s and may have expired"
        if problem is None:  # (by the id it holds: a renewal may be writing a new generation meanwhile)
            seen = self._read()
            found = Holder.decode(seen.value if seen is not None else None)
            if found is None or found.id != self.holder.id:
                other = live_holder(seen.value if seen is not None else None)
                problem = f"its lease was taken over ({other})" if other else "its lease was removed"
        if problem is not None:
            raise CheckpointBusyError(f"{self.where}: no longer held: {problem}")

    def release(self) -> None:
        """Stop renewing, and delete the lease object if it is still this holder's (a failure only leaves it to
        expire)."""
        self._stop.set()
        _HELD.discard(self.holder.id)
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join()
        generation, self._generation = self._generation, None
        if generation:
            with contextlib.suppress(Exception):
                self.store.write(self.key, None, if_equal=generation).result()


class HeldRoot:
    """A writer's hold on one root, taken when free (:meth:`take`) and, while another holds it, tried again by every
    use that writes (:meth:`check`); thread-safe (a remote tier's step copier checks from its own thread)."""

    def __init__(self, location: Location) -> None:
        self.location = location
        self._claim: Claim | None = None
        self._lock = threading.Lock()

    def take(self) -> CheckpointBusyError | None:
        """Take it now, without waiting; the refusal when another holder has it (``StorageError`` when the storage
        fails)."""
        try:
            self.check(patience_s=0.0)
        except CheckpointBusyError as e:
            return e
        return None

    def check(self, patience_s: float | None = None) -> None:
        """Raise ``CheckpointBusyError`` unless it is held, taking it if it is free now, or again once lost. Another
        holder's lease is watched until it is renewed or expires (up to ``patience_s``, default its TTL: a job
        restarted on another host right after a crash waits for the crashed one's lease, then goes on)."""
        with self._lock:
            if self._claim is not None:
                try:
                    self._claim.check()
                    return
                except CheckpointBusyError:
                    self._claim.release()
                    self._claim = None
            self._claim = self.location.claim(settings().lease_ttl_s + settings().lease_renew_s if patience_s is None
                                              else patience_s)

    def release(self) -> None:
        with self._lock:
            claim, self._claim = self._claim, None
        if claim is not None:
            claim.release()
