"""Hostile root metadata: any mutation of a valid root document gives a clear arrayckpt error or a
checkpoint that still reads correctly — never a crash with a foreign exception, never a file outside
the checkpoint."""

from __future__ import annotations

import copy
import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import write_root
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import arrayckpt

_json = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=8,
)
_interesting = st.sampled_from(["../../etc/passwd", "/abs", "..", "", "%", "w", -1, 2**63, [2**40, 2**40],
                                "bfloat16", "pickle", "per_rank", "tensor", {"$tuple": 1}, 99])


def _paths(node: Any, prefix: tuple = ()) -> list[tuple]:
    """Every location in a JSON document."""
    found = [prefix]
    if isinstance(node, dict):
        for k, v in node.items():
            found += _paths(v, (*prefix, k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            found += _paths(v, (*prefix, i))
    return found


def _set(document: Any, path: tuple, value: Any) -> Any:
    if not path:
        return value
    node = document
    for part in path[:-1]:
        node = node[part]
    node[path[-1]] = value
    return document


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("hostile") / "ckpt"
    arrayckpt.save({"w": torch.arange(6.0), "m": {"b": torch.ones(2, dtype=torch.bfloat16)}, "step": 1,
                    "r": arrayckpt.PerRank(torch.zeros(2))}, path)
    return path


@pytest.mark.slow
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_mutated_root_documents_fail_clearly(pristine, data):
    document = json.loads((pristine / "zarr.json").read_text())
    where = data.draw(st.sampled_from(_paths(document)))
    value = data.draw(_json | _interesting)
    mutated = _set(copy.deepcopy(document), where, value)
    root = Path(tempfile.mkdtemp())
    try:
        target = root / "ckpt"
        shutil.copytree(pristine, target)
        write_root(target, mutated)
        before = sorted(root.rglob("*"))
        try:
            opened = arrayckpt.open(target)
            for key in opened:
                opened[key].numpy()
            for key in opened.plain_values:
                opened.plain_values[key]
            state = {"w": torch.zeros(6), "m": {"b": torch.zeros(2, dtype=torch.bfloat16)}, "step": 0,
                     "r": arrayckpt.PerRank(None)}
            arrayckpt.load(state, target, strict=False)
        except arrayckpt.ArrayckptError:
            pass  # a clear, typed refusal
        assert sorted(root.rglob("*")) == before  # reading wrote nothing, in or beside the checkpoint
    finally:
        shutil.rmtree(root)
