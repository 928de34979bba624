"""``PeerMemory``: the settings of a manager's peer-memory tier, and where each rank's replicas go.

A failure domain (a "node") is a set of ranks lost together: by default ``ranks_per_node`` consecutive ranks (what
``torchrun`` gives: ``LOCAL_WORLD_SIZE``), or an explicit ``nodes`` map (rank -> domain label). Replica ``i`` (1 ..
``replicas``) of rank ``r`` goes to the rank with the same local index on the ``i``-th next domain (wrapping around;
local index modulo that domain's size): neighbouring domains form the replica sets, every rank sends and receives
the same number of replicas, and no two copies of a chunk share a domain while ``replicas`` < number of domains.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from pathlib import Path

from .._errors import StateError

__all__ = ["PeerMemory", "Placement", "default_parent"]


def default_parent() -> Path:
    """Where default memory directories go (one per manager root): ``/dev/shm/arrayckpt-<uid>``, one per user, made
    private (mode 0700) and checked to be this user's on every open (``private.py``), so that no other user can plant
    a step or a link in it; predictable, so that a restarted job finds its memory again."""
    return Path(f"/dev/shm/arrayckpt-{os.geteuid()}")


@dataclass(frozen=True)
class PeerMemory:
    """The peer-memory tier of a :class:`arrayckpt.CheckpointManager`: every ``every_steps`` steps the state is saved
    into node-local shared memory and replicated to ``replicas`` other nodes; :meth:`CheckpointManager.restore`
    takes the newest step the surviving nodes hold whole (onto any number of ranks), before the durable tiers.

    Host memory per node = (chunks its ranks write + replicas it holds) x ``keep``.

    Args:
        every_steps: save into memory at every step that is a multiple of it.
        replicas: how many other nodes hold a copy of each node's chunks.
        keep: how many memory steps each node keeps.
        ranks_per_node: says which ranks are lost together (default: ``LOCAL_WORLD_SIZE`` from ``torchrun``).
        nodes: instead of ``ranks_per_node``, one failure-domain label per rank.
        directory: this node's memory directory (default ``/dev/shm/arrayckpt-<uid>/<hash of the manager's root>``:
            a restarted job finds it again); it must be yours and writable by you alone (made so when missing), else
            the manager refuses it (:class:`UntrustedDirectoryError`).
        max_bytes: a save that would need more host memory than this per node is refused.

    Raises:
        ValueError: a count that is not a positive int, or both ``ranks_per_node`` and ``nodes``.

    Examples:
        >>> import arrayckpt
        >>> arrayckpt.PeerMemory(every_steps=100, ranks_per_node=8, max_bytes=64 << 30).replicas
        1
    """

    every_steps: int
    replicas: int = 1
    keep: int = 1
    ranks_per_node: int | None = None
    nodes: Sequence[Hashable] | None = None
    directory: str | os.PathLike[str] | None = None
    max_bytes: int | None = None

    def __post_init__(self) -> None:
        for name in ("every_steps", "keep"):
            value = getattr(self, name)
            if not (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
                raise ValueError(f"PeerMemory: {name} must be a positive int, got {value!r}")
        if not (isinstance(self.replicas, int) and not isinstance(self.replicas, bool) and self.replicas >= 1):
            raise ValueError(f"PeerMemory: replicas must be a positive int (copies on other nodes), got "
                             f"{self.replicas!r}")
        rpn = self.ranks_per_node
        if rpn is not None and not (isinstance(rpn, int) and not isinstance(rpn, bool) and rpn >= 1):
            raise ValueError(f"PeerMemory: ranks_per_node must be a positive int, got {rpn!r}")
        if rpn is not None and self.nodes is not None:
            raise ValueError("PeerMemory: give ranks_per_node or nodes, not both")
        limit = self.max_bytes
        if limit is not None and not (isinstance(limit, int) and not isinstance(limit, bool) and limit > 0):
            raise ValueError(f"PeerMemory: max_bytes must be a positive int, got {limit!r}")

    def node_directory(self, root: str) -> Path:
        """This node's memory directory for a manager (``directory``, else one under ``/dev/shm`` named by ``root``).

        Args:
            root: the manager's root.

        Returns:
            The absolute path (not created here).

        Examples:
            >>> import arrayckpt
            >>> str(arrayckpt.PeerMemory(every_steps=10, directory="/dev/shm/mine").node_directory("ckpt"))
            '/dev/shm/mine'
        """
        if self.directory is not None:
            return Path(self.directory).expanduser().absolute()
        return default_parent() / hashlib.sha256(root.encode()).hexdigest()[:16]

    def placement(self, world_size: int) -> Placement:
        """The failure domains of ``world_size`` ranks and where their replicas go.

        Args:
            world_size: the number of ranks of the job.

        Returns:
            Each rank's failure domain (``domain_of``) and the number of replicas.

        Raises:
            StateError: ``nodes`` does not name ``world_size`` ranks, the ranks per node are unknown, or there are
                no more failure domains than replicas.

        Examples:
            >>> import arrayckpt
            >>> arrayckpt.PeerMemory(every_steps=10, ranks_per_node=2).placement(4).domain_of
            (0, 0, 1, 1)
        """
        if self.nodes is not None:
            labels = list(self.nodes)
            if len(labels) != world_size:
                raise StateError(f"PeerMemory: nodes names {len(labels)} rank(s) but the job has {world_size}")
        else:
            rpn = self.ranks_per_node or _local_world_size()
            labels = [rank // rpn for rank in range(world_size)]
        order = list(dict.fromkeys(labels))  # domains in order of their first rank
        domain_of = tuple(order.index(label) for label in labels)
        if len(order) <= self.replicas:
            raise StateError(f"PeerMemory: replicas={self.replicas} needs more than {self.replicas} node(s) (failure "
                             f"domains), but the {world_size} rank(s) form {len(order)}; set ranks_per_node (or nodes) "
                             "to the ranks each machine runs, or lower replicas")
        return Placement(domain_of, self.replicas)


def _local_world_size() -> int:
    value = os.environ.get("LOCAL_WORLD_SIZE")
    if value is None or not value.isdigit() or int(value) < 1:
        raise StateError("PeerMemory: the ranks per node are unknown (no LOCAL_WORLD_SIZE from torchrun); pass "
                         "ranks_per_node= or nodes=")
    return int(value)


@dataclass(frozen=True)
class Placement:
    """Which failure domain each rank is in, and which ranks hold each rank's replicas."""

    domain_of: tuple[int, ...]  # rank -> domain index (0 .. domains - 1, in order of first rank)
    replicas: int

    @property
    def domains(self) -> list[list[int]]:
        """The ranks of each domain, ascending."""
        out: list[list[int]] = [[] for _ in range(max(self.domain_of) + 1)]
        for rank, domain in enumerate(self.domain_of):
            out[domain].append(rank)
        return out

    def partners(self, rank: int) -> list[int]:
        """The ranks that hold ``rank``'s replicas, one per next domain."""
        domains = self.domains
        mine = self.domain_of[rank]
        local = domains[mine].index(rank)
        out = []
        for i in range(1, self.replicas + 1):
            there = domains[(mine + i) % len(domains)]
            out.append(there[local % len(there)])
        return out

    def sources(self, rank: int) -> list[int]:
        """The ranks whose replicas ``rank`` holds."""
        return [r for r in range(len(self.domain_of)) if rank in self.partners(r)]

    def leader(self, rank: int) -> bool:
        """Whether ``rank`` is the lowest rank of its domain (the one that writes and removes the node's files)."""
        return self.domains[self.domain_of[rank]][0] == rank
