"""``arrayckpt report``'s charts on a training run: "which tensors moved" leads with the model's weights (its
optimizer's moments, which move far more, have a group of their own), and the delta's pictures show the model's
tensors first; the overview's labels never overlap, however many and long the keys and however many the ranks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from policies import small_chunks  # noqa: E402

from arrayckpt._read.checkpoint import open_checkpoint
from arrayckpt._tools.report import figures as report_figures
from arrayckpt._tools.report.build import collect
from arrayckpt._tools.report.data import MODEL, OPTIMIZER, change_groups, optimizer_state

CHUNKS = small_chunks(256, 1024)  # several chunks per tensor: the delta stores chunks, as big tensors' deltas do


def _train(model: torch.nn.Module, optim: torch.optim.Optimizer, steps: int) -> None:
    for _ in range(steps):
        optim.zero_grad()
        model(torch.randn(8, 16)).square().mean().backward()
        optim.step()


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A model and its AdamW state saved, trained three more steps, saved again as a delta against the first."""
    root = tmp_path_factory.mktemp("trained")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    _train(model, optim, 2)
    CHUNKS.save({"model": model, "optim": optim}, root / "step-2", step=2)
    _train(model, optim, 3)
    CHUNKS.save({"model": model, "optim": optim}, root / "step-5", step=5, base=root / "step-2")
    return root / "step-5", root / "step-2"


def _figures(monkeypatch: pytest.MonkeyPatch, data) -> dict:
    """The matplotlib figures of a report's pictures by section, caught as each is saved to PNG."""
    caught: list = []
    save = report_figures._png
    monkeypatch.setattr(report_figures, "_png", lambda figure: caught.append(figure) or save(figure))
    images = report_figures.figures(data)
    return dict(zip(images, caught, strict=True))


def test_which_tensors_moved_leads_with_the_model(trained, monkeypatch):
    later, earlier = trained
    with open_checkpoint(later) as b, open_checkpoint(earlier) as a:
        data = collect(b, a, histograms=0, grids=0)
    assert optimizer_state(data.changes[0].key)  # ranked together, a moment moved most
    groups = change_groups(data.changes, report_figures.MAX_BARS)
    assert [g.name for g in groups] == [MODEL, OPTIMIZER]
    assert groups[0].changes[0].key.startswith("model.")
    assert {c.key for c in groups[0].changes} == {k for k in (c.key for c in data.changes) if k.startswith("model.")}
    figure = _figures(monkeypatch, data)["changes"]
    labels = [t.get_text() for t in figure.axes[0].get_yticklabels()][::-1]  # top to bottom
    assert labels[0] == MODEL and labels[1] == groups[0].changes[0].key
    assert labels.index(OPTIMIZER) == len(groups[0].changes) + 1


def test_the_delta_pictures_show_the_model_first(tmp_path):
    """A delta whose optimizer state stores more bytes than its weights (fp32 moments, bf16 weights) still pictures
    the weights first; its table stays in order of stored bytes."""
    weight = torch.randn(64, 16).to(torch.bfloat16)
    moments = {"exp_avg": torch.randn(64, 16), "exp_avg_sq": torch.rand(64, 16)}
    CHUNKS.save({"model": {"emb.weight": weight}, "optim": {"state": {"emb.weight": moments}}}, tmp_path / "a")
    weight[:4] += 1
    moments = {name: value.clone() for name, value in moments.items()}
    for value in moments.values():
        value[:8] += 1
    CHUNKS.save({"model": {"emb.weight": weight}, "optim": {"state": {"emb.weight": moments}}}, tmp_path / "b",
                base=tmp_path / "a")
    with open_checkpoint(tmp_path / "b") as checkpoint:
        data = collect(checkpoint, histograms=0, grids=1)
    assert data.deltas[0].key.startswith("optim.") and data.deltas[0].stored_bytes > data.deltas[-1].stored_bytes
    assert [part.key for part in data.deltas if part.drawn] == ["model.emb.weight"]


def test_change_groups_share_the_bars():
    from arrayckpt._tools.report.data import Change

    model = [Change(f"model.layers.{i}.w", 1e-3, None) for i in range(30)]
    moments = [Change(f"optim.state.{i}.exp_avg", 1.0, None) for i in range(30)]
    groups = change_groups(moments + model, 40)
    assert [(g.name, len(g.changes), g.total) for g in groups] == [(MODEL, 20, 30), (OPTIMIZER, 20, 30)]
    groups = change_groups(moments + model[:3], 40)
    assert [(g.name, len(g.changes)) for g in groups] == [(MODEL, 3), (OPTIMIZER, 30)]
    assert [g.name for g in change_groups(model, 40)] == [MODEL]
