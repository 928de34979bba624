"""``arrayckpt report``: one self-contained HTML file that parses, whose images decode, whose numbers are
``arrayckpt show``'s, which flags NaN and inf, shows the chunk grids of a distributed checkpoint, the chain of a
delta checkpoint and, against another checkpoint, which tensors moved most; in bounded memory, without torch."""

from __future__ import annotations

import argparse
import base64
import io
import json
import math
import re
import subprocess
import sys
import tracemalloc
import xml.etree.ElementTree as ET
from html.parser import HTMLParser
from pathlib import Path

import matplotlib.image as matplotlib_image  # noqa: E402  (matplotlib: the test extra)
import numpy as np
import pytest
import torch
from policies import small_chunks  # noqa: E402
from thread_ranks import run_thread_ranks  # noqa: E402

import arrayckpt  # noqa: E402
from arrayckpt._cli.report import add_report  # noqa: E402
from arrayckpt._read.checkpoint import open_checkpoint  # noqa: E402
from arrayckpt._tools.report.build import collect, report  # noqa: E402

CHUNKS = small_chunks(256, 1024)  # a 64 x 16 float32 tensor split over 2 ranks: 4 outer chunks of 16 rows
WEIRD = 'odd.<b>&"x\''  # a key that HTML must escape
VOID = {"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "source", "track", "wbr"}


def _weights(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for i in range(3):
        out[f"layers.{i}.attn.w"] = torch.randn(16, 16, generator=g)
        out[f"layers.{i}.mlp.w"] = torch.randn(16, 32, generator=g)
    return out


def _bad() -> torch.Tensor:
    bad = torch.arange(16, dtype=torch.float32).reshape(4, 4)
    bad[1, 1], bad[2, 3], bad[3, 0] = float("nan"), float("inf"), -float("inf")
    return bad


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A checkpoint saved by 2 ranks (an embedding split by rows, the rest replicated), a delta checkpoint of a
    later step against it, and the reports of both."""
    root = tmp_path_factory.mktemp("report")
    emb = torch.randn(64, 16, generator=torch.Generator().manual_seed(1))
    weights = _weights(0)
    plain = {"bad": _bad(), "count": torch.arange(10, dtype=torch.int64) - 3, "mask": torch.tensor([True, False] * 3),
             "half": torch.linspace(-2, 2, 9).to(torch.bfloat16), "scalar": torch.tensor(2.5),
             "zeros": torch.zeros(4, 4), WEIRD: torch.ones(3)}

    def save_rank(rank: int, group) -> None:
        piece = arrayckpt.Shard(emb[32 * rank:32 * (rank + 1)].clone(), (64, 16), (32 * rank, 0))
        state = {"model": {**weights, "emb.weight": piece}, **plain, "step": 7,
                 "rng": arrayckpt.PerRank(torch.tensor([rank], dtype=torch.uint8))}
        CHUNKS.save(state, root / "full", process_group=group)

    run_thread_ranks(2, save_rank)
    later = {k: v.clone() for k, v in weights.items()}
    later["layers.2.mlp.w"] += 1.0  # moves most
    later["layers.1.attn.w"][0, 0] += 0.01  # barely (one row: a rows delta)
    later["layers.0.mlp.w"][0:2] += 0.25  # the first inner chunk (2 rows): a chunks delta
    later_emb = emb.clone()
    later_emb[[3, 40]] += 1.0
    CHUNKS.save({"model": {**later, "emb.weight": later_emb}, **plain, "step": 8}, root / "later", base=root / "full",
                changed_rows={"model.emb.weight": torch.tensor([3, 40])})
    report(root / "full", output=root / "full.html", histograms=0, grids=2)
    report(root / "later", against=root / "full", output=root / "later.html", histograms=2, grids=2)
    return {"root": root, "full": root / "full", "later": root / "later", "full.html": root / "full.html",
            "later.html": root / "later.html"}


class _Page(HTMLParser):
    """Checks that every element closes in order, and collects images and table cells."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.stack: list[str] = []
        self.problems: list[str] = []
        self.images: list[str] = []
        self.cells: dict[str, dict[str, dict[str, str]]] = {}  # table id -> row key -> column -> data-value
        self.table: str | None = None
        self.row: str | None = None
        self.tags: list[tuple[str, dict[str, str | None]]] = []
        self.text: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        attributes = dict(attrs)
        self.tags.append((tag, attributes))
        if tag == "img":
            self.images.append(attributes.get("src") or "")
        if tag == "table":
            self.table = attributes.get("id")
        if tag == "tr":
            self.row = attributes.get("data-key")
        if tag == "td" and self.table and self.row is not None and "data-col" in attributes:
            row = self.cells.setdefault(self.table, {}).setdefault(self.row, {})
            row[attributes["data-col"] or ""] = attributes.get("data-value") or ""
        if tag not in VOID:
            self.stack.append(tag)

    def handle_startendtag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.handle_starttag(tag, attrs)
        if tag not in VOID:
            self.problems.append(f"<{tag}/> is not a void element")
            self.stack.pop()

    def handle_endtag(self, tag: str) -> None:
        if tag in VOID:
            self.problems.append(f"</{tag}> closes a void element")
        elif not self.stack or self.stack[-1] != tag:
            self.problems.append(f"</{tag}> closes <{self.stack[-1] if self.stack else None}>")
        else:
            self.stack.pop()
        if tag == "table":
            self.table = None

    def handle_data(self, data: str) -> None:
        self.text.append(data)


def _parse(path: Path) -> tuple[_Page, str]:
    text = path.read_text(encoding="utf-8")
    page = _Page()
    page.feed(text)
    page.close()
    return page, text


def _value(text: str) -> float | int:
    return int(text) if re.fullmatch(r"-?\d+", text) else float(text)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["full.html", "later.html"])
def test_the_report_is_one_html_file_whose_elements_all_close(made, name):
    page, text = _parse(made[name])
    assert text.startswith("<!DOCTYPE html>")
    assert not page.problems, page.problems
    assert page.stack == [], f"unclosed: {page.stack}"
    assert [tag for tag, _ in page.tags].count("html") == 1
    # self-contained: no scripts, no stylesheets or images fetched from anywhere
    assert not any(tag in ("script", "link", "iframe", "object") for tag, _ in page.tags)
    assert not any(value and re.match(r"\s*(https?:|//|file:)", value) for _, attrs in page.tags
                   for name_, value in attrs.items() if name_ in ("src", "href"))


@pytest.mark.parametrize("name", ["full.html", "later.html"])
def test_every_image_decodes(made, name):
    page, text = _parse(made[name])
    assert page.images
    for src in page.images:
        kind, _, payload = src.partition(",")
        assert kind == "data:image/png;base64", kind[:40]
        pixels = matplotlib_image.imread(io.BytesIO(base64.b64decode(payload, validate=True)), format="png")
        assert pixels.ndim == 3 and pixels.shape[0] > 50 and pixels.shape[1] > 50
        assert pixels.std() > 0  # not blank
    for svg in re.findall(r"<svg\b.*?</svg>", text, flags=re.S):  # none today; inline SVG must be XML
        ET.fromstring(svg)


def test_statistics_are_those_of_arrayckpt_show(made):
    page, _ = _parse(made["later.html"])
    rows = page.cells["statistics-table"]
    with open_checkpoint(made["later"]) as checkpoint:
        keys = sorted(checkpoint)
    assert sorted(rows) == keys
    for key in keys:
        shown = arrayckpt.show(made["later"], key)
        row = rows[key]
        for column, expected in [("count", shown.count), ("nan", shown.nan_count), ("inf", shown.inf_count),
                                 ("min", shown.min), ("max", shown.max), ("mean", shown.mean), ("std", shown.std)]:
            got = _value(row[column]) if row.get(column) else None
            assert got == expected and type(got) is type(expected), (key, column, got, expected)
    assert _value(rows["zeros"]["zeros"]) == 1.0 and _value(rows["count"]["zeros"]) == 0.1
    assert _value(rows["mask"]["zeros"]) == 0.5


def test_nan_and_inf_are_flagged_in_red(made):
    page, text = _parse(made["later.html"])
    bad_rows = [attrs for tag, attrs in page.tags if tag == "tr" and "bad" in (attrs.get("class") or "")]
    assert [attrs["data-key"] for attrs in bad_rows] == ["bad"]
    assert re.search(r'<td class="num bad" data-col="nan" data-value="1">', text)
    assert re.search(r'<td class="num bad" data-col="inf" data-value="2">', text)
    alert = text[text.index('<div class="alert"'):]
    assert "1 tensor(s) hold NaN or inf values" in alert and "<code>bad</code>: " in alert


def test_keys_are_escaped(made):
    _, text = _parse(made["full.html"])
    assert "<b>" not in text and "odd.<wbr>&lt;b&gt;&amp;&quot;x&#x27;" in text


def test_a_distributed_checkpoint_colours_its_chunk_grids_by_the_rank_that_wrote_them(made):
    page, text = _parse(made["full.html"])
    assert "saved by 2 ranks" in text
    assert "coloured by the rank that wrote it" in text and "not recorded" not in text
    chunks = text[text.index('<section id="chunks">'):]
    assert chunks.count("<img ") == 1
    assert '<td class="key">model.<wbr>emb.<wbr>weight</td><td>4×1</td><td>16×16</td>' in chunks
    with open_checkpoint(made["full"]) as checkpoint:
        data = collect(checkpoint, histograms=0, grids=3)
        path = checkpoint.manifest.entries["model.emb.weight"].path
        assert checkpoint.manifest.created["writers"][path] == [[0, 1, 2, 2]]  # ranks 0, 1: 2 chunks each
    assert data.world_size == 2
    grid = next(g for g in data.grids if g.key == "model.emb.weight")
    assert grid.counts == (4, 1) and grid.chunk == (16, 16)  # the 2 shards' boundary (row 32) is a chunk boundary
    assert grid.writers == (0, 0, 1, 1)  # rows 0-31 from rank 0, rows 32-63 from rank 1


def test_without_a_writers_record_the_report_says_so(tmp_path):
    """A checkpoint that does not record writers (older ones; here the record is taken out) is drawn chunk by chunk
    and the page says why."""
    from helpers import write_root

    def save_rank(rank: int, group) -> None:
        piece = arrayckpt.Shard(torch.ones(32, 16) * rank, (64, 16), (32 * rank, 0))
        CHUNKS.save({"emb": piece}, tmp_path / "c", process_group=group)

    run_thread_ranks(2, save_rank)
    document = json.loads((tmp_path / "c" / "zarr.json").read_text())
    del document["attributes"]["arrayckpt"]["created"]["writers"]
    write_root(tmp_path / "c", document)
    report(tmp_path / "c", output=tmp_path / "c.html", histograms=0, grids=1)
    _, text = _parse(tmp_path / "c.html")
    assert "Which rank wrote each chunk is not recorded" in text
    with open_checkpoint(tmp_path / "c") as checkpoint:
        assert collect(checkpoint, histograms=0, grids=1).grids[0].writers is None


def test_a_delta_checkpoint_shows_its_chain_and_what_it_stores(made):
    page, text = _parse(made["later.html"])
    chain = text[text.index('<section id="chain">'):]
    assert chain.count("<img ") == 2  # the chain, and what the largest deltas store
    layers = re.findall(r'<tr><td class="key">([^<]*)</td><td>(\d+)</td><td>(\w+)</td>', chain)
    assert [(Path(path).name, step, kind) for path, step, kind in layers] == [("later", "8", "delta"),
                                                                             ("full", "7", "full")]
    with open_checkpoint(made["later"]) as checkpoint:
        data = collect(checkpoint, histograms=0, grids=6)
        stored = checkpoint.manifest.stored_bytes
    parts = {p.key: p for p in data.deltas}
    assert parts["model.emb.weight"].mode == "rows" and parts["model.emb.weight"].stored == "2 rows"
    density = parts["model.emb.weight"].row_density
    assert density is not None and math.isclose(density.sum() * 64 / len(density), 2)  # 2 rows of 64
    assert (parts["model.layers.0.mlp.w"].mode, parts["model.layers.0.mlp.w"].stored) == ("chunks", "1/8 chunks")
    assert parts["model.layers.0.mlp.w"].present == {0} and parts["model.layers.0.mlp.w"].stored_bytes == 256
    assert parts["model.layers.0.mlp.w"].grid is not None and parts["model.layers.0.mlp.w"].grid.counts == (8, 1)
    assert (parts["model.layers.2.mlp.w"].mode, parts["model.layers.2.mlp.w"].stored_bytes) == ("whole", 2048)
    assert parts["model.layers.0.attn.w"].stored == "unchanged" and parts["model.layers.0.attn.w"].stored_bytes == 0
    assert sum(p.stored_bytes for p in data.deltas) == stored  # the manifest's count: no pickles, no per-rank arrays
    assert '<tr data-key="model.emb.weight"><td class="key">model.<wbr>emb.<wbr>weight</td><td>rows</td>' in chain


def test_against_ranks_the_tensor_that_changed_most_first_and_maps_layers(made):
    page, text = _parse(made["later.html"])
    ranked = list(page.cells["change-table"])
    assert ranked[:2] == ["model.layers.2.mlp.w", "model.emb.weight"]
    assert _value(page.cells["change-table"]["model.layers.0.attn.w"]["change"]) == 0.0
    assert _value(page.cells["change-table"]["bad"]["change"]) == 0.0  # NaN and inf where they were: no change
    b = _weights(0)["layers.2.mlp.w"]
    a = b + 1.0
    expected = float(torch.linalg.norm(a.double() - b.double()) / torch.linalg.norm(b.double()))
    assert math.isclose(_value(page.cells["change-table"]["model.layers.2.mlp.w"]["change"]), expected, rel_tol=1e-12)
    change = text[text.index('<section id="change">'):text.index('<section id="statistics">')]
    assert change.count("<img ") == 2  # the bar chart and the layer heat map


def test_nan_appearing_is_a_change_and_ranks_first(tmp_path):
    arrayckpt.save({"w": torch.ones(8), "v": torch.ones(8)}, tmp_path / "a")
    w = torch.ones(8)
    w[2] = float("nan")
    arrayckpt.save({"w": w, "v": torch.full((8,), 3.0)}, tmp_path / "b")
    with open_checkpoint(tmp_path / "b") as b, open_checkpoint(tmp_path / "a") as a:
        data = collect(b, a, histograms=0, grids=0)
    assert [c.key for c in data.changes] == ["w", "v"]
    assert math.isnan(data.changes[0].relative) and data.changes[1].relative == 2.0


def test_memory_stays_bounded_by_the_block_size(tmp_path, monkeypatch, tuned):
    tuned(inspect_block_bytes=256 << 10)
    big = torch.randn(4096, 1024, generator=torch.Generator().manual_seed(0))  # 16 MiB, 64 blocks
    arrayckpt.save({"w": big}, tmp_path / "a")
    arrayckpt.save({"w": big * 1.5}, tmp_path / "b")
    with open_checkpoint(tmp_path / "b") as b, open_checkpoint(tmp_path / "a") as a:
        tracemalloc.start()
        try:
            data = collect(b, a, histograms=1, grids=1)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
    assert data.tensors[0].count == big.numel() and math.isclose(data.changes[0].relative, 0.5, rel_tol=1e-6)
    assert data.histograms[0].sampled <= 1 << 16
    assert peak < 8 << 20, f"peak {peak / 2**20:.1f} MiB for a 16 MiB tensor read in 256 KiB blocks"


@pytest.mark.slow
def test_the_command_runs_without_torch(made, tmp_path):
    script = f"""
import sys, argparse, json
sys.modules["torch"] = None
from arrayckpt._cli.report import add_report
parser = argparse.ArgumentParser()
add_report(parser.add_subparsers(dest="command", required=True))
args = parser.parse_args(["report", {str(made['full'])!r}, "-o", {str(tmp_path / 'r.html')!r}, "--json",
                          "--histograms", "1", "--grids", "1", "--png", {str(tmp_path / 'o.png')!r}])
code = args.func(args)
print(json.dumps({{"code": code, "torch": sys.modules.get("torch") is not None}}))
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    written, result = (json.loads(line) for line in done.stdout.strip().splitlines()[-2:])
    assert result == {"code": 0, "torch": False}
    assert written["output"] == str(tmp_path / "r.html") and written["bytes"] == (tmp_path / "r.html").stat().st_size
    assert matplotlib_image.imread(tmp_path / "o.png").shape[1] > 1000


def test_missing_matplotlib_is_an_error_that_says_what_to_install(made, tmp_path, monkeypatch, capsys):
    parser = argparse.ArgumentParser()
    add_report(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["report", str(made["full"]), "-o", str(tmp_path / "r.html")])
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert args.func(args) == 2
    assert "pip install 'arrayckpt[report]'" in capsys.readouterr().err
    assert not (tmp_path / "r.html").exists()
    with pytest.raises(SystemExit):
        parser.parse_args(["report", str(made["full"]), "--grids", "-1"])


def _drawn(monkeypatch: pytest.MonkeyPatch, data) -> dict:
    """The matplotlib figures of a report's pictures by section, caught as each is saved to PNG."""
    from arrayckpt._tools.report import figures as report_figures

    caught: list = []
    save = report_figures._png
    monkeypatch.setattr(report_figures, "_png", lambda figure: caught.append(figure) or save(figure))
    images = report_figures.figures(data)
    assert len(images) == len(caught)
    return dict(zip(images, caught, strict=True))


def _grid_axes(figure) -> dict[str, object]:
    """The chunk grid pictures of a figure by tensor key (the first line of each title)."""
    return {ax.get_title().split("\n")[0]: ax for ax in figure.axes if ax.get_visible() and ax.collections}


def _cell_colours(ax) -> set[tuple[float, ...]]:
    return {tuple(np.round(c, 3)) for c in ax.collections[0].get_facecolor()}


def test_chunk_grids_have_a_key_from_colour_to_rank(made, monkeypatch):
    with open_checkpoint(made["full"]) as checkpoint:
        figure = _drawn(monkeypatch, collect(checkpoint, histograms=0, grids=3))["grids"]
    (legend,) = figure.legends
    assert legend.get_title().get_text() == "chunk colour: the rank that wrote it"
    assert [text.get_text() for text in legend.get_texts()] == ["rank 0", "rank 1"]
    swatches = [tuple(np.round(patch.get_facecolor(), 3)) for patch in legend.legend_handles]
    emb = _grid_axes(figure)["model.emb.weight"]  # rows 0-31 from rank 0, rows 32-63 from rank 1
    assert [tuple(np.round(c, 3)) for c in emb.collections[0].get_facecolor()] == [swatches[0]] * 2 + [swatches[1]] * 2


def test_a_delta_saved_by_one_rank_shows_who_wrote_the_chunks_its_bases_store(made, monkeypatch):
    """``later`` (saved by one rank against ``full``, saved by two) stores a few chunks: the others are drawn in
    their base's writer's colour, lighter, never all grey."""
    from matplotlib.colors import to_rgba

    with open_checkpoint(made["later"]) as checkpoint:
        data = collect(checkpoint, histograms=0, grids=6)
    grids = {g.key: g for g in data.grids}
    partly = grids["model.layers.0.mlp.w"]  # a chunks delta storing its first (read) chunk of 8
    assert partly.counts == (8, 1) and partly.in_base == frozenset(range(1, 8))
    assert partly.writers == (0, 1, 1, 1, 0, 0, 0, 0)  # chunk 0 by the delta's rank; the base's 2 outer chunks: 1, 0
    unchanged = grids["model.layers.1.mlp.w"]
    assert unchanged.in_base == frozenset(range(8)) and unchanged.writers == (0, 0, 0, 0, 1, 1, 1, 1)
    figure = _drawn(monkeypatch, data)["grids"]
    (legend,) = figure.legends
    assert [text.get_text() for text in legend.get_texts()] == ["rank 0", "rank 1",
                                                                "lighter: stored by a base checkpoint"]
    grey = tuple(np.round(to_rgba("#dddddd"), 3))  # a chunk whose writer is unknown
    for key, ax in _grid_axes(figure).items():
        assert _cell_colours(ax) != {grey}, f"{key} is all grey"
    assert len(_cell_colours(_grid_axes(figure)["model.layers.0.mlp.w"])) == 3  # rank 0 here, ranks 1, 0 in base


def test_the_colour_bar_reads_when_one_tensor_changed(tmp_path, monkeypatch):
    """One changed tensor made a log colour scale spanning nothing (labels such as 4.906×10⁻¹ over each other):
    a few plain, distinct labels instead."""
    weights = {f"layers.{i}.w": torch.full((4, 4), float(i + 1)) for i in range(3)}
    arrayckpt.save(weights, tmp_path / "a")
    arrayckpt.save({**weights, "layers.1.w": weights["layers.1.w"] * 1.5}, tmp_path / "b")
    with open_checkpoint(tmp_path / "b") as b, open_checkpoint(tmp_path / "a") as a:
        figure = _drawn(monkeypatch, collect(b, a, histograms=0, grids=0))["layers"]
    figure.canvas.draw()
    bar = figure.axes[-1]
    labels = [t.get_text() for t in bar.get_yticklabels() if t.get_text()]
    assert all(len(label) <= 5 and "times" not in label for label in labels), labels
    assert len(labels) >= 3 and len(set(labels)) == len(labels) and not bar.get_yticklabels(minor=True)
    assert bar.get_ylabel() == "relative change"
