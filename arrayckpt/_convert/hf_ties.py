"""Tied weights in a Hugging Face export: the names an export leaves out because another name holds the same
tensor, as ``save_pretrained`` leaves them out (safetensors has no aliases; ``from_pretrained`` ties them back).

A tie is ``alias -> target``: the alias is not written, the target is. Ties come from where they are declared,
each marked by its origin, and are resolved together by :func:`resolve_ties`:

- ``option``: named by the caller (``--tie lm_head.weight=transformer.wte.weight``). It must hold: both names in
  the export, the same dtype and shape, the same bytes; anything else is an error.
- ``config``: named by the transformers model a ``config.json`` describes (:func:`model_check`). transformers
  builds that model on the meta device (no memory, no weights) and its ``all_tied_weights_keys``, which
  ``save_pretrained`` and ``from_pretrained`` use, says which names are tied (``tie_word_embeddings`` included).
  A config tie is applied where both names hold the same bytes, as ``save_pretrained`` drops only tensors that
  share storage; where they differ both are written, with a note (transformers then warns and leaves them untied).
- ``manifest``: a checkpoint that stores a tied tensor once names its aliases in its manifest (spec §4.3); those
  join the same list and hold by construction (one stored array), so they need no comparison.

Values are compared block by block (``tie_compare_bytes`` of each tensor at a time, ``_settings.py``), so looking for
ties adds about a batch to the export's memory, not a tensor. No torch at import; :func:`model_check` imports
transformers (and so torch) when called, and does without them, with a note, where they are missing.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Literal, NamedTuple

from .._errors import StateError
from .._read.checkpoint import Checkpoint
from .._settings import settings

if TYPE_CHECKING:
    from torch.nn import Module

__all__ = ["ModelCheck", "Tie", "TieResolution", "model_check", "option_ties", "resolve_ties"]

SHOWN = 5  # names listed in a note before "..."
# The transformers auto classes tried, in order, for a config.json that names no architecture: the first whose
# model has exactly the export's names is taken as the model the export is for.
AUTO_CLASSES = ("AutoModelForCausalLM", "AutoModelForMaskedLM", "AutoModelForSeq2SeqLM", "AutoModel")

TieOrigin = Literal["option", "config", "manifest"]


class Tie(NamedTuple):
    """``alias`` holds the same tensor as ``target``: the export writes ``target`` and leaves ``alias`` out."""

    alias: str
    target: str
    origin: TieOrigin


@dataclass(frozen=True)
class ModelCheck:
    """What the transformers model a ``config.json`` describes says about an export: its ties, and notes for the
    caller (names the model lacks or has no place for, why nothing could be looked up)."""

    architecture: str | None
    ties: tuple[Tie, ...] = ()
    notes: tuple[str, ...] = ()


@dataclass(frozen=True)
class TieResolution:
    """The ties that hold (alias -> the name it is written as) and notes on those that do not."""

    aliases: dict[str, str]
    notes: tuple[str, ...] = ()


def option_ties(tie: Mapping[str, str] | None) -> list[Tie]:
    """The caller's ties (``{"lm_head.weight": "transformer.wte.weight"}``), checked to name two names each."""
    out = []
    for alias, target in (tie or {}).items():
        if not (isinstance(alias, str) and isinstance(target, str) and alias and target) or alias == target:
            raise StateError(f"tie {alias!r}={target!r}: a tie names two different tensors of the export, as "
                             "ALIAS=TARGET (lm_head.weight=transformer.wte.weight)")
        out.append(Tie(alias, target, "option"))
    return out


def resolve_ties(checkpoint: Checkpoint, tensors: Mapping[str, str], ties: Sequence[Tie]) -> TieResolution:
    """The ties of ``ties`` that hold among ``tensors`` (name in the export -> key in the checkpoint).

    A chain (``a=b``, ``b=c``) resolves to what is written (``a`` and ``b`` as ``c``); a tie already implied by
    others is skipped. An ``option`` tie that does not hold is an error; a ``config`` one is left out with a note.
    """
    aliases: dict[str, str] = {}
    notes = []
    for tie in ties:
        problem = None if tie.origin == "manifest" else _why_not_tied(checkpoint, tensors, tie)
        if problem is not None:
            if tie.origin == "option":
                raise StateError(f"{checkpoint.location}: tie {tie.alias}={tie.target}: {problem}")
            if tie.alias in tensors and tie.target in tensors:  # else the model check notes the missing name
                notes.append(f"the model ties {tie.alias} to {tie.target}, but {problem}: both are written and "
                             "from_pretrained leaves them untied (set tie_word_embeddings to false in config.json "
                             "to say so)")
            continue
        target = aliases.get(tie.target, tie.target)
        if tie.alias in aliases or target == tie.alias:
            continue  # implied by the ties before it
        aliases = {a: target if t == tie.alias else t for a, t in aliases.items()}
        aliases[tie.alias] = target
    return TieResolution(aliases, tuple(notes))


def _why_not_tied(checkpoint: Checkpoint, tensors: Mapping[str, str], tie: Tie) -> str | None:
    """Why ``tie`` does not hold (a name not in the export, another dtype or shape, other bytes), or ``None``."""
    absent = [name for name in (tie.alias, tie.target) if name not in tensors]
    if absent:
        return f"{' and '.join(absent)} {'is' if len(absent) == 1 else 'are'} not in the export"
    a, b = checkpoint[tensors[tie.alias]], checkpoint[tensors[tie.target]]
    if a.entry.dtype.name != b.entry.dtype.name or a.shape != b.shape:
        return (f"{tie.alias} is {a.entry.dtype.name}{list(a.shape)} and {tie.target} is "
                f"{b.entry.dtype.name}{list(b.shape)}")
    if not a.shape:
        return None if a.numpy().tobytes() == b.numpy().tobytes() else "their values differ"
    rows = max(1, settings().tie_compare_bytes // max(1, a.nbytes // max(1, a.shape[0])))
    for start in range(0, a.shape[0], rows):
        if a[start:start + rows].tobytes() != b[start:start + rows].tobytes():
            return f"their values differ (first in rows {start}..{min(start + rows, a.shape[0]) - 1})"
    return None


# ------------------------------------------------------------------ the model a config.json describes


def model_check(config: str | os.PathLike[str], names: Sequence[str]) -> ModelCheck:
    """The ties of the transformers model ``config`` describes, and notes where the export's ``names`` are not
    that model's weights (``from_pretrained`` would initialise what is missing randomly).

    The model is the config's ``architectures[0]`` (a transformers class; custom code is never run), or, where it
    names none, the first of :data:`AUTO_CLASSES` whose model has exactly ``names``. It is built on the meta
    device: nothing is allocated or initialised. Where transformers is missing or cannot build it, there are no
    config ties, and a note says why.
    """
    try:
        import torch
        import transformers
    except ImportError:
        return ModelCheck(None, notes=("transformers is not installed, so the model's tied weights were not "
                                       "looked up: tied weights are written as separate copies unless a tie "
                                       "names them",))
    try:
        hf_config = transformers.AutoConfig.from_pretrained(os.fspath(config))
    except Exception as e:  # advisory: the export stands without it, and the note says why
        return ModelCheck(None, notes=(f"transformers cannot read {config} ({_brief(e)}): tied weights were not "
                                       "looked up, and from_pretrained will fail the same way",))
    expected = set(names)
    architectures = getattr(hf_config, "architectures", None) or []
    if architectures:
        found = _build(torch, lambda: getattr(transformers, architectures[0])(hf_config))
        if isinstance(found, str):
            return ModelCheck(architectures[0], notes=(f"config.json's architecture {architectures[0]} could not "
                                                       f"be built by transformers ({found}): tied weights were not "
                                                       "looked up",))
        return _checked(architectures[0], found, expected)
    tried = []
    for auto in AUTO_CLASSES:
        found = _build(torch, lambda auto=auto: getattr(transformers, auto).from_config(hf_config))
        if not isinstance(found, str):
            if set(found.state_dict()) == expected:
                return _checked(type(found).__name__, found, expected)
            tried.append(found)
    closest = min(tried, key=lambda m: len(set(m.state_dict()) ^ expected), default=None)
    if closest is None:
        return ModelCheck(None, notes=(f"transformers has no model for config.json's model_type "
                                       f"{getattr(hf_config, 'model_type', None)!r}: tied weights were not looked up",))
    checked = _checked(type(closest).__name__, closest, expected)
    return ModelCheck(None, notes=("config.json names no architecture, and no transformers model for its "
                                   f"model_type has exactly the export's names; the closest is "
                                   f"{type(closest).__name__}", *checked.notes))


def _build(torch: ModuleType, make: Callable[..., Module]) -> Module | str:
    """A model built on the meta device by ``make()``, or the reason it could not be (one line)."""
    try:
        with torch.device("meta"):
            return make()
    except Exception as e:  # a model's constructor may raise anything; the caller notes it
        return _brief(e)


def _checked(architecture: str, model: Module, names: set[str]) -> ModelCheck:
    """The model's ties, and notes on names it has that the export lacks, or the other way round."""
    keys = set(model.state_dict())
    tied = dict(getattr(model, "all_tied_weights_keys", None) or {})  # {target: source} in transformers 5
    notes = []
    # a tied name the export leaves out is no loss: from_pretrained ties it back from the other one
    missing = sorted(k for k in keys - names
                     if not any((t == k and s in names) or (s == k and t in names) for t, s in tied.items()))
    if missing:
        notes.append(f"{architecture} has {len(missing)} weight(s) the export lacks ({_shown(missing)}): "
                     "from_pretrained would initialise them randomly; is the selection (--select) right?")
    unexpected = sorted(names - keys)
    if unexpected:
        notes.append(f"{len(unexpected)} tensor(s) of the export are not weights of {architecture} "
                     f"({_shown(unexpected)}): from_pretrained would report them as unexpected")
    if not hasattr(model, "all_tied_weights_keys"):
        notes.append("this transformers version does not say which weights are tied (transformers 5 does): tied "
                     "weights are written as separate copies unless a tie names them")
    return ModelCheck(architecture, tuple(Tie(target, source, "config") for target, source in tied.items()),
                      tuple(notes))


def _shown(names: Sequence[str]) -> str:
    return ", ".join(names[:SHOWN]) + (", ..." if len(names) > SHOWN else "")


def _brief(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__
