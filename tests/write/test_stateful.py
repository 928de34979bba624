"""DCP's ``Stateful`` protocol: objects with ``state_dict()`` / ``load_state_dict()`` in the state.

``arrayckpt.save`` stores what ``state_dict()`` returns (called once); ``arrayckpt.load`` fills that dict (tensors in
place, plain values replaced) and hands it back through ``load_state_dict`` — the dict itself, so an object whose
``state_dict()`` returns a fresh dict (or copies of its tensors) is restored too. As DCP:

- only keys the checkpoint has are loaded, and the object receives the dict it returned (``dcp.load`` does the same
  for top-level ``Stateful`` values);
- objects satisfying ``torch.distributed.checkpoint.stateful.Stateful`` (modules, optimizers, user classes,
  subclasses of the protocol) are walked, other objects are plain values.

Where arrayckpt goes further than DCP (checked against ``dcp.save``/``dcp.load(no_dist=True)`` below):

- a stateful nested in a dict or a list is walked through its ``state_dict()`` too (DCP does that at the top level
  only; it pickles a nested object and replaces it by the unpickled copy on load);
- a non-module stateful whose current ``state_dict()`` lacks keys the checkpoint has gets them as well (a fresh
  optimizer has no per-parameter state yet); DCP loads only the keys asked for.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.stateful import Stateful

import arrayckpt
from arrayckpt._torch.state import is_stateful, walk

pytestmark = pytest.mark.usefixtures("storage_layout")  # every test holds in both layouts (spec §2, §16)


class Counter:
    """A user-defined stateful object (not a module): plain values and a tensor, a fresh dict on every call."""

    def __init__(self, count: int = 0, name: str = "", buf: torch.Tensor | None = None, **extra: object) -> None:
        self.count, self.name = count, name
        self.buf = torch.zeros(3) if buf is None else buf
        self.extra = dict(extra)
        self.received: list[dict] = []  # every dict load_state_dict was given

    def state_dict(self) -> dict:
        return {"count": self.count, "name": self.name, "buf": self.buf, **self.extra}

    def load_state_dict(self, state_dict: dict) -> None:
        self.received.append(state_dict)
        self.count, self.name, self.buf = state_dict["count"], state_dict["name"], state_dict["buf"]
        self.extra = {k: v for k, v in state_dict.items() if k not in ("count", "name", "buf")}


class Copying:
    """Returns copies of its tensors: filling them in place changes nothing until ``load_state_dict`` copies back."""

    def __init__(self, w: torch.Tensor) -> None:
        self.w = w

    def state_dict(self) -> dict:
        return {"w": self.w.clone(), "meta": {"shape": list(self.w.shape)}}

    def load_state_dict(self, state_dict: dict) -> None:
        self.w.copy_(state_dict["w"])
        self.meta = state_dict["meta"]


class Declared(Stateful):
    """Subclasses DCP's protocol explicitly."""

    def __init__(self, value: float) -> None:
        self.value = torch.tensor([value])
        self.steps = 0

    def state_dict(self) -> dict:
        return {"value": self.value, "steps": self.steps}

    def load_state_dict(self, state_dict: dict) -> None:
        self.value.copy_(state_dict["value"])
        self.steps = state_dict["steps"]


def test_user_stateful_with_plain_values_and_tensors(ckpt):
    saved = Counter(7, "run-a", torch.arange(3.0), history=[1, 2, 3], cfg={"betas": (0.9, 0.99)}, blob=b"\x00\xff")
    arrayckpt.save({"counter": saved}, ckpt)
    with arrayckpt.open(ckpt) as opened:
        assert sorted(opened) == ["counter.buf"]
        assert opened.plain_values["counter.count"] == 7 and opened.plain_values["counter.cfg.betas"] == (0.9, 0.99)

    fresh = Counter(history=[], cfg={"betas": (0.0, 0.0)}, blob=b"")
    assert arrayckpt.load({"counter": fresh}, ckpt) == arrayckpt.LoadResult([], [])
    assert len(fresh.received) == 1
    assert (fresh.count, fresh.name, fresh.extra) == (7, "run-a", {"history": [1, 2, 3], "cfg": {"betas": (0.9, 0.99)},
                                                                    "blob": b"\x00\xff"})
    assert torch.equal(fresh.buf, torch.arange(3.0))


def test_load_state_dict_receives_the_dict_state_dict_returned_filled(ckpt):
    """A stateful returning a fresh dict (and copies of its tensors) each call: the loaded dict is handed back."""
    arrayckpt.save({"c": Copying(torch.arange(4.0))}, ckpt)
    target = Copying(torch.zeros(4))
    calls = []
    original = target.state_dict
    target.state_dict = lambda: calls.append(1) or original()  # type: ignore[method-assign]
    arrayckpt.load({"c": target}, ckpt)
    assert len(calls) == 1, "state_dict() is called once; the dict it returned is filled and handed back"
    assert torch.equal(target.w, torch.arange(4.0)) and target.meta == {"shape": [4]}


def test_stateful_lacking_keys_gets_what_the_checkpoint_has(ckpt, tmp_path):
    """DCP loads only the keys the current state dict asks for; arrayckpt hands a non-module stateful every key of
    the checkpoint below it (the keys both load agree)."""
    saved = Counter(3, "x", torch.ones(3), note="kept")
    arrayckpt.save({"c": saved}, ckpt)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process"
        dcp.save({"c": saved}, checkpoint_id=tmp_path / "dcp", no_dist=True)

    ours, theirs = Counter(), Counter()
    ours.state_dict = lambda: {"buf": ours.buf}  # type: ignore[method-assign]
    theirs.state_dict = lambda: {"buf": theirs.buf}  # type: ignore[method-assign]
    ours.load_state_dict = lambda sd: ours.received.append(sd)  # type: ignore[method-assign]
    theirs.load_state_dict = lambda sd: theirs.received.append(sd)  # type: ignore[method-assign]
    assert arrayckpt.load({"c": ours}, ckpt) == arrayckpt.LoadResult([], [])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to load in a single process"
        dcp.load({"c": theirs}, checkpoint_id=tmp_path / "dcp", no_dist=True)

    (got,), (dcp_got,) = ours.received, theirs.received
    assert set(dcp_got) == {"buf"} and torch.equal(dcp_got["buf"], torch.ones(3))
    assert set(got) == {"buf", "count", "name", "note"}
    assert (got["count"], got["name"], got["note"]) == (3, "x", "kept") and torch.equal(got["buf"], torch.ones(3))


def test_keys_created_for_a_stateful_keep_their_lists_and_tuples(ckpt):
    saved = Counter(1, "a", torch.ones(3), items=[torch.ones(2), torch.zeros(1)], pair=(torch.ones(1), 5))
    arrayckpt.save({"c": saved}, ckpt)
    fresh = Counter()
    fresh.state_dict = lambda: {"buf": fresh.buf}  # type: ignore[method-assign]
    arrayckpt.load({"c": fresh}, ckpt)
    items, pair = fresh.extra["items"], fresh.extra["pair"]
    assert isinstance(items, list) and [t.tolist() for t in items] == [[1.0, 1.0], [0.0]]
    assert isinstance(pair, tuple) and pair[1] == 5 and torch.equal(pair[0], torch.ones(1))


def test_stateful_nested_in_a_dict_and_a_list(ckpt):
    """Walked through ``state_dict()`` wherever it sits (DCP does so at the top level only); the objects in the
    state stay the same objects and get their state through ``load_state_dict``."""
    a, b = Counter(1, "a", torch.full((3,), 1.0)), Counter(2, "b", torch.full((3,), 2.0))
    inner = Declared(4.0)
    holder = Counter(9, "outer", torch.full((3,), 9.0), child=inner)  # a stateful inside a stateful's state dict
    arrayckpt.save({"by_name": {"a": a}, "in_list": [b, 5], "holder": holder}, ckpt)
    with arrayckpt.open(ckpt) as opened:
        assert {"by_name.a.buf", "in_list.0.buf", "holder.buf", "holder.child.value"} == set(opened)

    fa, fb, finner = Counter(), Counter(), Declared(0.0)
    fholder = Counter(child=finner)
    state = {"by_name": {"a": fa}, "in_list": [fb, 0], "holder": fholder}
    assert arrayckpt.load(state, ckpt) == arrayckpt.LoadResult([], [])
    assert state["by_name"]["a"] is fa and state["in_list"][0] is fb and state["in_list"][1] == 5
    assert (fa.count, fa.name, fb.count, fb.name) == (1, "a", 2, "b")
    assert torch.equal(fa.buf, torch.full((3,), 1.0)) and torch.equal(fb.buf, torch.full((3,), 2.0))
    assert torch.equal(finner.value, torch.tensor([4.0])) and fholder.count == 9
    assert fholder.extra["child"] is finner, "the inner stateful is loaded (first) and handed back as itself"


def test_dcp_stateful_protocol_decides_what_is_walked():
    model = nn.Linear(2, 2)
    optim = torch.optim.Adam(model.parameters())
    statefuls = [model, optim, torch.optim.lr_scheduler.StepLR(optim, 1), Counter(), Copying(torch.ones(1)),
                 Declared(1.0)]
    for obj in statefuls:
        assert isinstance(obj, Stateful) and is_stateful(obj), type(obj).__name__

    class OnlySave:
        def state_dict(self) -> dict:
            return {}

    assert not isinstance(OnlySave(), Stateful)
    for obj in [OnlySave(), {"state_dict": 1}, [], torch.ones(1), 3, "s"]:
        assert not is_stateful(obj), repr(obj)
    assert isinstance(Counter, Stateful) and not is_stateful(Counter)  # a class is a value, never walked
    walked = walk({"d": Declared(2.0), "m": model})
    assert [node.parts for node in walked.statefuls] == [("d",), ("m",)]
    assert set(walked.leaves) == {"d.value", "d.steps", "m.weight", "m.bias"}


class AppState(Stateful):
    """DCP's recommended wrapper (the DCP tutorial): model and optimizer through ``get_state_dict``."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model, self.optimizer = model, optimizer

    def state_dict(self) -> dict:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        return {"model": model_sd, "optim": optim_sd}

    def load_state_dict(self, state_dict: dict) -> None:
        from torch.distributed.checkpoint.state_dict import set_state_dict

        set_state_dict(self.model, self.optimizer, model_state_dict=state_dict["model"],
                       optim_state_dict=state_dict["optim"])


def _dcp_state(seed: int, trained: bool) -> dict:
    """A state as written for ``dcp.save``: an AppState, a module and a user stateful at the top level, plain values,
    and a dict holding a tensor."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if trained:
        for _ in range(3):
            optimizer.zero_grad()
            model(torch.randn(5, 4)).square().mean().backward()
            optimizer.step()
    head = nn.Linear(3, 3)
    return {"app": AppState(model, optimizer), "head": head, "counter": Declared(float(seed)),
            "step": 3 if trained else 0, "extra": {"rng": torch.randint(0, 255, (16,), dtype=torch.uint8)}}


def _materialised(state: dict) -> dict:
    """Everything the state holds, as tensors and plain values (comparable between the two loads)."""
    app = state["app"]
    return {"model": app.model.state_dict(), "optim": app.optimizer.state_dict(), "head": state["head"].state_dict(),
            "counter": state["counter"].state_dict(), "step": state["step"], "extra": state["extra"]}


def _assert_same(a: object, b: object, where: str = "") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), (where, sorted(map(str, a)), sorted(map(str, b)))
        for k in a:
            _assert_same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, list | tuple):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _assert_same(x, y, f"{where}.{i}")
    else:
        assert a == b, (where, a, b)


def test_a_state_written_for_dcp_works_unchanged(tmp_path):
    """The same state dict goes to ``dcp.save``/``dcp.load`` and to ``arrayckpt.save``/``arrayckpt.load``; both
    loads, into fresh objects built from another seed, end with the same state bit for bit — the saved one."""
    source = _dcp_state(0, trained=True)
    expected = _materialised(source)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP's single-process warnings
        dcp.save(source, checkpoint_id=tmp_path / "dcp", no_dist=True)
        arrayckpt.save(source, tmp_path / "arrayckpt")
        by_dcp = _dcp_state(1, trained=False)
        dcp.load(by_dcp, checkpoint_id=tmp_path / "dcp", no_dist=True)
        by_arrayckpt = _dcp_state(1, trained=False)
        result = arrayckpt.load(by_arrayckpt, tmp_path / "arrayckpt")
    assert result == arrayckpt.LoadResult([], [])
    _assert_same(_materialised(by_arrayckpt), _materialised(by_dcp))
    _assert_same(_materialised(by_arrayckpt), expected)
    with arrayckpt.open(tmp_path / "arrayckpt") as opened:
        assert "app.optim.state.0.weight.exp_avg" in opened and "head.weight" in opened
        assert opened.plain_values["app.optim.param_groups"][0]["params"] == ["0.weight", "0.bias", "2.weight",
                                                                              "2.bias"]
