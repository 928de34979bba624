"""Why a state's keys miss a checkpoint's, when a key prefix is all that stands between them: the sentence a
:class:`KeyMismatchError` of ``load`` adds.

The usual cause: a checkpoint converted from a Hugging Face directory names the weights as the model does
(``model.layers.0.mlp.up_proj.weight``), and ``load({"model": model}, ckpt)`` looks for them under ``model.``; or a
checkpoint saved as ``{"model": model}`` is loaded into a state named otherwise. A *match* is a pair of prefixes
(the state's, the checkpoint's) such that a missing key of the state, its prefix replaced by the checkpoint's, is a
key of the checkpoint; the pair that matches the most missing keys (at least half of them) is named with its fix.
Pure: no torch, no IO.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import NamedTuple

__all__ = ["PrefixMatch", "find_prefix_match", "prefix_hint"]

PROBES = 3  # missing keys whose prefixes are tried
CANDIDATES = 10  # prefix pairs tried per probe


class PrefixMatch(NamedTuple):
    """The state's keys start with ``state`` where the checkpoint's start with ``checkpoint`` (each ``""`` or ending
    in a dot); ``matched`` missing keys meet that way."""

    state: str
    checkpoint: str
    matched: int


def _pairs(key: str, held: Collection[str]) -> list[tuple[str, str]]:
    """The prefix pairs under which the state's ``key`` is a key of ``held``: from the longest common rest down to
    the first rest that any key of ``held`` ends with."""
    cuts = [0, *(i + 1 for i, c in enumerate(key) if c == ".")]
    for cut in cuts:
        rest = key[cut:]
        found = [(key[:cut], k[:len(k) - len(rest)]) for k in held if k == rest or k.endswith(f".{rest}")]
        if found:
            return found[:CANDIDATES]
    return []


def find_prefix_match(missing: Sequence[str], held: Collection[str]) -> PrefixMatch | None:
    """The prefix pair that makes the most of ``missing`` (state keys) keys of ``held`` (the checkpoint's), if it
    makes at least half of them.

    >>> find_prefix_match(["model.model.norm.weight", "model.lm_head.weight"], {"model.norm.weight", "lm_head.weight"})
    PrefixMatch(state='model.', checkpoint='', matched=2)
    >>> find_prefix_match(["net.w"], {"model.w"})
    PrefixMatch(state='net.', checkpoint='model.', matched=1)
    """
    best: PrefixMatch | None = None
    keys = held if isinstance(held, (set, frozenset, dict)) else set(held)
    for probe in missing[:PROBES]:
        for state, checkpoint in _pairs(probe, keys):
            matched = sum(1 for key in missing if key.startswith(state) and checkpoint + key[len(state):] in keys)
            if best is None or matched > best.matched:
                best = PrefixMatch(state, checkpoint, matched)
    return best if best is not None and best.matched * 2 >= len(missing) else None


def prefix_hint(missing: Sequence[str], held: Collection[str], key_prefix: str) -> str:
    """A clause naming the prefix that separates ``missing`` from ``held`` and its fix (``""`` when none does);
    ``key_prefix``: the one the load was given (the state's keys are then the checkpoint's with it in front)."""
    match = find_prefix_match(missing, held)
    if match is None:
        return ""
    state, checkpoint = match.state, match.checkpoint
    count = "all of them" if match.matched == len(missing) else f"{match.matched} of them"
    example = next(key for key in missing if key.startswith(state) and checkpoint + key[len(state):] in held)
    seen = f"{checkpoint + example[len(state):]!r} for the state's {example!r}"
    if not checkpoint and not state:
        return f"; {count} are in the checkpoint as the state names them: load without key_prefix={key_prefix!r}"
    if not checkpoint:
        return (f"; {count} are in the checkpoint without the prefix {state!r} ({seen}): pass "
                f"key_prefix={state.rstrip('.')!r}")
    if not state:
        return (f"; {count} are in the checkpoint under the prefix {checkpoint!r}, which the state's keys lack "
                f"({seen}): nest the state under it as it was saved ({{{checkpoint.rstrip('.')!r}: ...}})")
    return (f"; {count} are in the checkpoint under the prefix {checkpoint!r} where the state has {state!r} ({seen}): "
            "name the state's entry as it was saved")
