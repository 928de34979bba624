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
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal, TypeAlias

from .._errors import StateError

__all__ = ["PerRankChoice", "PerRankFunction", "PerRankPolicy", "check_policy", "choice_for", "choose", "refusal"]

PerRankFunction: TypeAlias = Callable[[str, list[Any], int, int], Any]
"""``(key, values_by_saved_rank, rank, world_size) -> value``: the value rank ``rank`` of ``world_size`` takes."""
PerRankChoice: TypeAlias = Literal["rank0", "keep"] | PerRankFunction
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


def choose(policy: PerRankPolicy | None, where: str, key: str, items: Sequence[object | None], rank: int, world: int,
           explicit: bool = False) -> int | Literal["keep"] | PerRankFunction:
    """What rank ``rank`` of ``world`` takes of a per-rank entry whose items are ``items`` (by saved rank; ``None``:
    that rank saved none): the saved rank whose item it takes (its own at the saved world size), or the policy's
    ``"keep"`` or function, which the caller applies. Raises :func:`refusal` where nothing says."""
    if len(items) == world and items[rank] is not None:
        return rank
    choice = choice_for(policy, key)
    if choice is None:
        raise refusal(where, key, len(items), world, rank, explicit)
    if choice == "rank0":
        return 0
    return choice
