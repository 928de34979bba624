"""``arrayckpt report``'s charts on a training run: "which tensors moved" leads with the model's weights (its
optimizer's moments, which move far more, have a group of their own), and the delta's pictures show the model's
tensors first; the overview's labels never overlap, however many and long the keys and however many the ranks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from policies import small_chunks  # noqa: E402
from thread_ranks import run_thread_ranks  # noqa: E402

import arrayckpt
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


def _long_keys() -> list[str]:
    keys = [f"language_model.encoder.transformer_block_stack.layers.{i}.{part}" for i in range(4)
            for part in ("self_attention.linear_query_key_value.weight", "mlp.dense_h_to_4h_gated_activation.weight",
                         "self_attention.linear_projection_output.weight", "mlp.dense_4h_to_h_projection_back.weight")]
    return keys + [f"a_very_long_top_level_component_name_{j}.with.a.deeply_nested_parameter_block.weight"
                   for j in range(6)]


def _save_on_ranks(path: Path, world: int, scale: float) -> None:
    """Every long-named tensor and its moment split by rows over ``world`` ranks; layer 2 scaled by ``scale``."""
    g = torch.Generator().manual_seed(0)
    full = {key: torch.randn(4 * world, 8, generator=g) for key in _long_keys()}

    def rank(r: int, group) -> None:
        state = {}
        for key, value in full.items():
            value = value * scale if ".layers.2." in key else value
            rows = slice(4 * r, 4 * (r + 1))
            state[f"model.{key}"] = arrayckpt.Shard(value[rows].clone(), tuple(value.shape), (4 * r, 0))
            state[f"optimizer_states.0.state.{key}.exp_avg"] = arrayckpt.Shard(
                (value[rows] * 0.1 * scale).clone(), tuple(value.shape), (4 * r, 0))
        CHUNKS.save(state, path, process_group=group)

    run_thread_ranks(world, rank)


def test_the_overview_s_labels_never_overlap(tmp_path):
    """Many tensors with long keys saved by 12 ranks: the bar chart's keys, the rank keys under the chunk grids, the
    treemap's labels and the heat map's rows each get a place of their own (measured as matplotlib draws them)."""
    _save_on_ranks(tmp_path / "a", 12, 1.0)
    _save_on_ranks(tmp_path / "b", 12, 1.01)
    with open_checkpoint(tmp_path / "b") as b, open_checkpoint(tmp_path / "a") as a:
        data = collect(b, a, histograms=2, grids=2)
    figure = report_figures.overview_figure(data)
    renderer = figure.canvas.get_renderer()
    texts = report_figures.shown_texts(figure)
    boxes = [text.get_window_extent(renderer) for text in texts]
    overlapping = [(texts[i].get_text(), texts[j].get_text()) for i in range(len(boxes))
                   for j in range(i + 1, len(boxes)) if boxes[i].overlaps(boxes[j])]
    assert not overlapping
    (changes,) = [ax for ax in figure.axes if ax.get_title() == "which tensors moved"]
    labels = changes.get_yticklabels()
    assert all(label.get_visible() for label in labels) and len(labels) == 22  # 2 headings, 20 keys: all shown
    assert any(text.get_text() == "rank 11" for text in texts)  # the rank keys are there
    figure.savefig(tmp_path / "overview.png")
