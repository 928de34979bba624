"""How a load resumes a value saved per rank at another world size: the ``per_rank=`` policy of ``load``.

A per-rank entry (an ``arrayckpt.PerRank`` value, or a plain value that differed between the ranks that saved it:
spec §5.3) holds one value per saved rank. At the world size it was saved at, each rank takes its own. At another,
no rank's value is obviously the right one (a data loader's position saved by 2 data-parallel ranks, resumed by 1:
keeping rank 0's skips rank 1's samples), so the load refuses unless the caller names a policy, per key pattern:

- ``"rank0"``: every rank takes saved rank 0's value;
- ``"keep"``: the state's value stays as it is (e.g. a data loader that starts its epoch afresh);
- a function ``(key, values_by_saved_rank, rank, world_size) -> value``: the value this rank takes, from every saved
  rank's (``None`` for a rank that saved none; plain values only, as decoded).

Patterns are ``fnmatch`` patterns on the checkpoint's keys (``"loader.*"``); the first that matches wins; one
policy alone applies to every per-rank key.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Mapping
from typing import Any, Literal, TypeAlias

from .._errors import StateError

__all__ = ["PerRankChoice", "PerRankPolicy", "choice_for", "check_policy", "refusal"]

PerRankChoice: TypeAlias = Literal["rank0", "keep"] | Callable[[str, list[Any], int, int], Any]
"""What a rank takes of a value saved per rank at another world size (see the module docstring)."""
PerRankPolicy: TypeAlias = PerRankChoice | Mapping[str, PerRankChoice]
"""One choice for every per-rank key, or choices by ``fnmatch`` pattern of the key (the first that matches)."""

NAMED_CHOICES = ("rank0", "keep")


def check_policy(policy: PerRankPolicy | None) -> None:
    """Refuse a policy that names no known choice before anything is read."""
    if policy is None:
        return
    choices = policy.items() if isinstance(policy, Mapping) else [("*", policy)]
    for pattern, choice in choices:
        if not isinstance(pattern, str) or not (callable(choice) or choice in NAMED_CHOICES):
            raise StateError(f"per_rank={policy!r}: each choice must be one of {NAMED_CHOICES} or a function "
                             "(key, values_by_saved_rank, rank, world_size) -> value, by key pattern (a str)")


def choice_for(policy: PerRankPolicy | None, key: str) -> PerRankChoice | None:
    """The choice ``policy`` makes for ``key`` (``None``: it names none)."""
    if policy is None or not isinstance(policy, Mapping):
        return policy
    return next((choice for pattern, choice in policy.items() if fnmatch.fnmatchcase(key, pattern)), None)


def refusal(where: str, key: str, saved: int, world: int, rank: int, explicit: bool) -> StateError:
    """The error of a per-rank entry that this rank cannot take its own value of, with the fixes."""
    why = (f"was saved per rank at world size {saved} and is loaded at world size {world}" if saved != world
           else f"was saved per rank and rank {rank} saved no value of it")
    also = ", or PerRank(value, rank=r) in the state" if explicit else ""
    return StateError(
        f"{where}: {key!r} {why}, so no saved value is this rank's; name which it takes: load(..., "
        f"per_rank={{{key!r}: 'rank0'}}) takes saved rank 0's ('keep' leaves the state's value; a function "
        f"(key, values_by_saved_rank, rank, world_size) returns it){also}; every saved rank's value: "
        f"arrayckpt.open(path).per_rank({key!r})")
