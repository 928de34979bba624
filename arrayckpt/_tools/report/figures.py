"""The pictures of ``report``, drawn with matplotlib (an optional extra) and returned as base64 PNGs.

Every picture is drawn by a ``draw_*`` function into given axes (the chunk pictures' in ``grids.py``), so
that a report's section figures and its one-image overview (``report(..., overview=...)``) draw the same things.
Figures are made with ``matplotlib.figure.Figure`` and saved through the Agg canvas: no pyplot, no global state, no
display needed.
"""

from __future__ import annotations

import base64
import io
import math
import os
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from .data import Change, Histogram, ReportData, SizeNode, change_groups, human_bytes, printable, size_tree, squarify
from .grids import draw_delta, draw_grid, draw_rank_legend, top_rank
from .style import DPI, FONT, colormap, lighten, short_key

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure
    from matplotlib.text import Text
    from matplotlib.transforms import Bbox

__all__ = ["MATPLOTLIB_EXTRA", "figures", "overview", "overview_figure", "require_matplotlib", "separate_labels",
           "shown_texts"]

MATPLOTLIB_EXTRA = "pip install 'arrayckpt[report]'"
MAX_BARS = 40  # tensors in the relative-change bar chart
OVERVIEW_KEY = 34  # characters of a key in the overview's bar chart (its column is a quarter of the picture)
MAX_HEAT_ROWS = 60  # parameter names in the layer heat map
LOG_SPAN = 10.0  # the heat map's colour scale is logarithmic when the changes span this factor or more
MAX_CHAIN = 30  # checkpoints of a chain drawn (the newest; the table lists them all)
LEGEND_BAND = 0.55  # inches above a figure's panels for their shared legend
TREE_DEPTH = 3  # key parts the treemap nests


def require_matplotlib() -> None:
    """Raise ``ModuleNotFoundError`` that says how to install matplotlib, when it is not installed."""
    try:
        import matplotlib  # noqa: F401
    except ModuleNotFoundError as e:
        raise ModuleNotFoundError(f"arrayckpt report draws its pictures with matplotlib, which is not installed: "
                                  f"{MATPLOTLIB_EXTRA}", name="matplotlib") from e


def _figure(width: float, height: float) -> Figure:
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height), dpi=DPI, layout="constrained")


def _png(figure: Figure) -> str:
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=DPI)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def _panels(count: int, columns: int, draw: Callable[[Axes, int], None], width: float = 3.4,
            height: float = 2.6, legend: Callable[[Figure, float], None] | None = None) -> str:
    """``count`` small pictures in rows of ``columns``, as one PNG (laid out by hand: constrained layout costs
    more than the drawing); ``legend(figure, top)``, when given, draws a legend for all of them in a band of
    ``LEGEND_BAND`` inches above them (``top``: the band's lower edge, in figure coordinates)."""
    from matplotlib.figure import Figure

    rows = math.ceil(count / columns)
    columns = min(columns, count)
    band = LEGEND_BAND if legend is not None else 0.0
    total = height * rows + band
    figure = Figure(figsize=(width * columns, total), dpi=DPI)
    top = 1 - (0.45 + band) / total
    figure.subplots_adjust(left=0.75 / (width * columns), right=1 - 0.15 / (width * columns),
                           bottom=0.5 / total, top=top, wspace=0.42, hspace=0.62)
    axes = figure.subplots(rows, columns, squeeze=False)
    for i, ax in enumerate(axes.flat):
        if i < count:
            draw(ax, i)
            _few_ticks(ax)
        else:
            ax.set_visible(False)
    if legend is not None:
        legend(figure, 1 - band / total)
    return _png(figure)


def _few_ticks(ax: Axes) -> None:
    """Three or four ticks per axis and no minor ones: small panels read better, and ticks are most of the cost
    of drawing them."""
    from matplotlib.ticker import FixedLocator, LogLocator, MaxNLocator, NullLocator

    for axis in (ax.xaxis, ax.yaxis):
        if axis.get_scale() == "log":
            axis.set_major_locator(LogLocator(numticks=4))
            axis.set_minor_locator(NullLocator())
        elif not isinstance(axis.get_major_locator(), (FixedLocator, NullLocator)):  # labelled ticks stay
            axis.set_major_locator(MaxNLocator(4))


def figures(data: ReportData) -> dict[str, str]:
    """Every picture of the report, by section name, as base64 PNG (a section with nothing to show has none)."""
    out: dict[str, str] = {}
    tree = size_tree(data.tensors, TREE_DEPTH)
    if tree.nbytes:
        figure = _figure(10, 5.2)
        left, right = figure.subplots(1, 2, width_ratios=[3, 1])
        draw_treemap(left, tree)
        draw_dtypes(right, data)
        out["sizes"] = _png(figure)
    if data.histograms:
        out["histograms"] = _panels(len(data.histograms), 4, lambda ax, i: draw_histogram(ax, data.histograms[i]),
                                    width=2.6, height=2.0)
    if data.grids:
        recorded = any(g.writers is not None for g in data.grids)
        highest = top_rank(data.grids)  # one colour per rank across the pictures
        key = (lambda fig, edge: draw_rank_legend(fig, data.grids, edge)) if recorded else None
        out["grids"] = _panels(len(data.grids), 3, lambda ax, i: draw_grid(ax, data.grids[i], highest), legend=key)
    if data.changes:
        rows = sum(len(g.changes) + 1 for g in change_groups(data.changes, MAX_BARS))  # bars and headings
        figure = _figure(10, max(2.0, 0.2 * rows + 0.9))
        draw_changes(figure.subplots(), data.changes)
        out["changes"] = _png(figure)
        heat = _heat(data.changes)
        if heat is not None:
            figure = _figure(10, max(2.2, 0.22 * len(heat[0]) + 1.2))
            draw_layers(figure.subplots(), heat)
            out["layers"] = _png(figure)
    if data.chain:
        figure = _figure(10, 0.45 * min(len(data.chain), MAX_CHAIN) + 1.0)
        draw_chain(figure.subplots(), data)
        out["chain"] = _png(figure)
    drawn = [d for d in data.deltas if d.drawn]
    if drawn:
        out["deltas"] = _panels(len(drawn), 3, lambda ax, i: draw_delta(ax, drawn[i]))
    return out


def overview(data: ReportData, path: str | os.PathLike[str]) -> None:
    """The main pictures of a report in one PNG of about 1300 x 850 pixels (a README-sized picture): sizes and a
    histogram at the left; at the right what changed (with ``against``: the bar chart and the layer heat map),
    the delta chain and chunk grids."""
    overview_figure(data).savefig(path, format="png", dpi=DPI)


def overview_figure(data: ReportData) -> Figure:
    """:func:`overview`'s figure, laid out, its labels apart (:func:`separate_labels`)."""
    figure = _figure(14.4, 9.4)
    grid = figure.add_gridspec(4, 4)
    against = f"  against {_tail(data.against)}" if data.against else ""
    figure.suptitle(f"arrayckpt report: {_tail(data.location)}{against}", fontsize=11)
    draw_treemap(figure.add_subplot(grid[0:3, 0:2]), size_tree(data.tensors, TREE_DEPTH))
    draw_dtypes(figure.add_subplot(grid[3, 0]), data)
    if data.histograms:
        ax = figure.add_subplot(grid[3, 1])
        draw_histogram(ax, data.histograms[0])
        _few_ticks(ax)
    drawn = sorted((d for d in data.deltas if d.drawn), key=lambda d: d.grid is None)  # chunk pictures first
    small: list[Callable[[Axes], None]] = []  # the right half's small pictures, most telling first
    if data.chain:
        small.append(lambda ax: draw_chain(ax, data, compact=True))
    small += [partial(draw_delta, part=d) for d in drawn[:1]]
    small += [partial(draw_grid, grid=g, top=top_rank(data.grids[:2]), legend=True) for g in data.grids[:2]]
    small += [partial(draw_histogram, histogram=h) for h in data.histograms[1:3]]
    heat = _heat(data.changes)
    if data.changes:
        places = [grid[0, 2], grid[1, 2]] if heat is not None else [grid[0, 2], grid[0, 3], grid[1, 2], grid[1, 3]]
        draw_changes(figure.add_subplot(grid[2:4, 2] if heat is not None else grid[2:4, 2:4]), data.changes, limit=20,
                     width=OVERVIEW_KEY)
        if heat is not None:
            draw_layers(figure.add_subplot(grid[0:4, 3]), heat, compact=True)
    else:
        places = [grid[0:2, 2], grid[0:2, 3], grid[2:4, 2], grid[2:4, 3]]
    for place, draw in zip(places, small, strict=False):
        ax = figure.add_subplot(place)
        draw(ax)
        _few_ticks(ax)
    separate_labels(figure)
    return figure


def separate_labels(figure: Figure) -> list[Text]:
    """Lay ``figure`` out, then fix where everything is and hide each text that would overlap a more telling one
    (titles, then legends, axis labels, tick labels, labels inside the pictures), so that no two texts of it
    overlap however many and long the keys; returns the texts hidden. The pictures make room for their texts
    (keys shortened to what fits); this is for what still does not fit, such as a treemap label beside another."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    canvas = FigureCanvasAgg(figure)  # (as savefig's PNG is drawn)
    canvas.draw()  # constrained layout places everything
    figure.set_layout_engine("none")  # what is hidden now must not move the rest
    renderer = canvas.get_renderer()
    kept: list[Bbox] = []
    hidden = []
    for text in sorted(shown_texts(figure), key=partial(_importance, figure)):
        box = text.get_window_extent(renderer).expanded(1.0, 1.0).shrunk(0.98, 0.9)  # glyph boxes' own padding
        if any(box.overlaps(other) for other in kept):
            text.set_visible(False)
            hidden.append(text)
        else:
            kept.append(box)
    return hidden


def shown_texts(figure: Figure) -> list[Text]:
    """Every text of ``figure`` that is drawn: visible and not empty, in a visible axes whose axes are shown (a
    treemap's are not), and, for a tick label, at a tick within the axis's view (matplotlib keeps the others)."""
    from matplotlib.text import Text

    undrawn: set[int] = set()
    for ax in figure.axes:
        for axis in (ax.xaxis, ax.yaxis):
            if not ax.axison or not axis.get_visible():
                undrawn.update(id(t) for t in (axis.label, *axis.get_ticklabels(), *axis.get_ticklabels(minor=True)))
                continue
            low, high = sorted(axis.get_view_interval())
            span = (high - low) * 1e-9
            for tick in (*axis.get_major_ticks(), *axis.get_minor_ticks()):
                if not low - span <= tick.get_loc() <= high + span:
                    undrawn.update((id(tick.label1), id(tick.label2)))
    out = []
    for text in figure.findobj(Text):
        axes = text.axes
        if text.get_visible() and text.get_text().strip() and id(text) not in undrawn and \
                (axes is None or axes.get_visible()):
            out.append(text)
    return out


def _importance(figure: Figure, text: Text) -> int:
    """0 for the most telling texts (titles) to 4 for labels inside the pictures."""
    for ax in figure.axes:
        legend = ax.get_legend()
        if text is ax.title or (legend is not None and text is legend.get_title()):
            return 0
        if legend is not None and text in legend.get_texts():
            return 1
        if text is ax.xaxis.label or text is ax.yaxis.label:
            return 2
        if text in ax.get_xticklabels() or text in ax.get_yticklabels():
            return 3
    return 0 if text is getattr(figure, "_suptitle", None) else 4


def _tail(location: str) -> str:
    """The last two parts of a long location (``…/run/step-200``)."""
    location = printable(location)
    parts = location.rstrip("/").split("/")
    return location if len(location) <= 32 or len(parts) <= 2 else "…/" + "/".join(parts[-2:])


# --------------------------------------------------------------------------------------------- sizes


def draw_treemap(ax: Axes, tree: SizeNode) -> None:
    """Bytes by key prefix: one colour per top-level part, nested rectangles for the next parts."""
    from matplotlib.patches import Patch, Rectangle

    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1)
    ax.set_axis_off()
    ax.set_title(f"bytes by key prefix ({human_bytes(tree.nbytes)}, {tree.tensors} tensors)", fontsize=9)
    palette = [f"C{i}" for i in range(10)]
    handles = []

    def place(node: SizeNode, box: tuple[float, ...], level: int, colour: Any, names: tuple[str, ...]) -> None:
        children = [c for c in node.children if c.nbytes > 0]
        rects = squarify([c.nbytes for c in children], *box)
        for i, (child, (x, y, w, h)) in enumerate(zip(children, rects, strict=True)):
            tone = palette[i % len(palette)] if level == 0 else colour
            if level == 0:
                handles.append(Patch(color=tone, label=f"{child.name}  {human_bytes(child.nbytes)}"))
            ax.add_patch(Rectangle((x, y), w, h, facecolor=lighten(tone, 0.18 * level), edgecolor="white",
                                   linewidth=max(0.4, 2.0 - 0.6 * level)))
            inner = (x + 0.003, y + 0.003, w - 0.006, h - 0.006)
            if child.children and level + 1 < TREE_DEPTH and w > 0.01 and h > 0.01:
                place(child, inner, level + 1, tone, (*names, child.name))
            else:
                label = ".".join((*names, child.name)[1:]) or child.name
                fitted = _fit(f"{label}\n{human_bytes(child.nbytes)}", w * width_px, h * height_px)
                if fitted is not None:
                    ax.text(x + w / 2, y + h / 2, fitted[0], ha="center", va="center", fontsize=fitted[1],
                            clip_on=True)

    box = ax.get_position()
    figure = cast("Figure", ax.figure)  # (not a SubFigure: the report draws none)
    width_px, height_px = (box.width * figure.get_figwidth() * DPI, box.height * figure.get_figheight() * DPI)
    place(tree, (0.0, 0.0, 1.0, 1.0), 0, None, ())
    ax.legend(handles=handles[:10], loc="upper left", bbox_to_anchor=(0, -0.01), ncols=min(4, len(handles) or 1),
              fontsize=FONT, frameon=False)


def _fit(text: str, width: float, height: float) -> tuple[str, float] | None:
    """``text`` (lines) and a font size at which it fits a ``width`` x ``height`` pixel box, its first line cut
    from the left if need be; ``None`` when nothing legible fits."""
    lines = text.split("\n")
    for size in (FONT, FONT - 1, FONT - 2):
        char, line = 0.68 * size * DPI / 72, 1.4 * size * DPI / 72  # a wide glyph's width, a line's height
        if line * len(lines) > height * 0.85:
            continue
        room = int(width * 0.85 / char)
        if room >= max(len(x) for x in lines):
            return text, size
        if room >= max(8, len(lines[-1])):
            return "\n".join(["…" + lines[0][-(room - 1):], *lines[1:]]), size
    return None


def draw_dtypes(ax: Axes, data: ReportData) -> None:
    """Bytes by dtype, as horizontal bars."""
    by_dtype: dict[str, int] = {}
    for tensor in data.tensors:
        by_dtype[tensor.dtype] = by_dtype.get(tensor.dtype, 0) + tensor.nbytes
    names = sorted(by_dtype, key=lambda n: by_dtype[n])
    total = sum(by_dtype.values()) or 1
    ax.barh(names, [by_dtype[n] for n in names], color="C0")
    for i, name in enumerate(names):
        ax.text(by_dtype[name], i, f" {human_bytes(by_dtype[name])} ({100 * by_dtype[name] / total:.0f}%)",
                va="center", fontsize=FONT)
    ax.set_title("bytes by dtype", fontsize=9)
    ax.set_xlim(0, max(by_dtype.values(), default=1) * 1.6)
    ax.set_xticks([])
    ax.tick_params(labelsize=FONT)


# ---------------------------------------------------------------------------------------- values


def draw_histogram(ax: Axes, histogram: Histogram) -> None:
    """A tensor's value histogram (log counts), from its sample."""
    ax.stairs(histogram.counts, histogram.edges, fill=True, color="C0")
    ax.set_yscale("log")
    source = "all values" if histogram.sampled >= histogram.count else f"{histogram.sampled:,} sampled"
    ax.set_title(f"{short_key(histogram.key, 34)}\n{source} of {histogram.count:,}", fontsize=FONT)
    ax.tick_params(labelsize=FONT - 1)


def draw_changes(ax: Axes, changes: list[Change], limit: int = MAX_BARS, width: int = 60) -> None:
    """The tensors that changed most, by ``||a - b|| / ||b||``: the model's, then the optimizer state's
    (:func:`change_groups`: the moments would otherwise fill the chart), each largest at the top, under a heading
    when there are both; NaN and inf in red. Keys are shortened to ``width`` characters."""
    groups = change_groups(changes, limit)
    rows: list[Change | str] = []  # top to bottom: a heading, then its bars
    for group in groups:
        if len(groups) > 1:
            more = f", largest {len(group.changes)} of {group.total}" if len(group.changes) < group.total else ""
            rows.append(f"{group.name}{more}")
        rows += group.changes
    shown = [(len(rows) - 1 - i, row) for i, row in enumerate(rows) if isinstance(row, Change)]  # (y, change)
    finite = [c.relative for _, c in shown if math.isfinite(c.relative)]
    top = max(finite, default=1.0) or 1.0
    values = [c.relative if math.isfinite(c.relative) else top for _, c in shown]
    log = bool(finite) and min(finite) > 0 and top / min(finite) > 100
    ax.barh([y for y, _ in shown], values, color=["C0" if math.isfinite(c.relative) else "red" for _, c in shown])
    for (y, change), value in zip(shown, values, strict=True):
        if not math.isfinite(change.relative):
            ax.text(value, y, " NaN/inf changed", va="center", color="red", fontsize=FONT)
    ax.set_yticks(range(len(rows)), [row if isinstance(row, str) else short_key(row.key, width) for row in rows[::-1]])
    for label, row in zip(ax.get_yticklabels(), rows[::-1], strict=True):
        if isinstance(row, str):
            label.set_fontweight("bold")
    for y, row in enumerate(rows[::-1]):
        if isinstance(row, str) and y < len(rows) - 1:  # a line above every heading but the top one
            ax.axhline(y + 0.5, color="#999999", linewidth=0.6)
    ax.set_ylim(-0.6, len(rows) - 0.4)
    if log:
        ax.set_xscale("log")
    ax.set_xlabel("relative change ||a - b|| / ||b||", fontsize=FONT + 1)
    more = f" (largest {len(shown)} of {len(changes)})" if len(shown) < len(changes) and len(groups) == 1 else ""
    ax.set_title(f"which tensors moved{more}", fontsize=9)
    ax.tick_params(labelsize=FONT)


Heat = tuple[list[str], list[int], np.ndarray]


def _heat(changes: list[Change]) -> Heat | None:
    """(row labels, layer numbers, relative changes [row, layer]: NaN where a layer has no such key, inf where
    the change is not finite), or ``None`` when no key has a layer number."""
    cells = {c.layer: c.relative if math.isfinite(c.relative) else math.inf for c in changes if c.layer is not None}
    if not cells:
        return None
    best: dict[str, float] = {}  # row -> its largest change; rows in order of appearance
    for (row, _), value in cells.items():
        best[row] = max(best.get(row, -1.0), value)
    kept = set(sorted(best, key=lambda r: -best[r])[:MAX_HEAT_ROWS])
    rows = [row for row in best if row in kept]
    layers = sorted({n for _, n in cells})
    grid = np.full((len(rows), len(layers)), np.nan)
    for (row, layer), value in cells.items():
        if row in kept:
            grid[rows.index(row), layers.index(layer)] = value
    return rows, layers, grid


def draw_layers(ax: Axes, heat: Heat, compact: bool = False) -> None:
    """The relative change of every per-layer tensor as a heat map: parameter names by layer number; grey cells
    are unchanged (or absent), red crosses NaN or inf."""
    rows, layers, grid = heat
    positive = grid[np.isfinite(grid) & (grid > 0)]
    shown = np.ma.masked_invalid(np.where(np.isfinite(grid) & (grid > 0), grid, np.nan))
    cmap = colormap("viridis", bad="#dddddd")
    norm, formatter = _change_scale(positive)
    image = ax.imshow(shown, aspect="auto", interpolation="nearest", cmap=cmap, norm=norm)
    bad = np.argwhere(np.isinf(grid))
    if len(bad):
        ax.scatter(bad[:, 1], bad[:, 0], marker="x", color="red", s=20)
    ax.set_xticks(range(len(layers)), [str(n) for n in layers], fontsize=FONT - (1 if len(layers) > 24 else 0))
    ax.set_yticks(range(len(rows)), _row_labels(rows, 44 if compact else 70), fontsize=FONT - (1 if compact else 0))
    ax.set_xlabel("layer", fontsize=FONT + 1)
    ax.set_title("relative change by layer (grey: unchanged)", fontsize=9)
    bar = ax.figure.colorbar(image, ax=ax, shrink=0.8, format=formatter)
    bar.ax.tick_params(labelsize=FONT)
    bar.ax.minorticks_off()
    bar.set_label("relative change", fontsize=FONT)


def _change_scale(positive: np.ndarray) -> tuple[Any, Any]:
    """The colour scale of the heat map and the format of its colour bar's labels: logarithmic when the changes
    span a factor of ``LOG_SPAN`` or more, else linear from 0 (one changed tensor, or changes alike, would make a
    log scale of less than a decade, with labels like 4.906×10⁻¹ crowding each other)."""
    from matplotlib.colors import LogNorm, Normalize
    from matplotlib.ticker import FormatStrFormatter, LogFormatterSciNotation

    low, high = (float(positive.min()), float(positive.max())) if positive.size else (0.0, 1.0)
    if low > 0 and high / low >= LOG_SPAN:
        return LogNorm(vmin=low, vmax=high), LogFormatterSciNotation()
    return Normalize(vmin=0.0, vmax=high), FormatStrFormatter("%.3g")


def _row_labels(rows: list[str], width: int) -> list[str]:
    """Heat map rows by what follows the layer number (``mlp.w``), after the first part of what precedes it
    when that differs between rows (``optim: mlp.w.exp_avg``).

    >>> _row_labels(["model.layers.*.mlp.w", "optim.state.model.layers.*.mlp.w.exp_avg"], 40)
    ['model: mlp.w', 'optim: mlp.w.exp_avg']
    """
    parts = [row.partition("*") for row in rows]
    heads = {head for head, _, _ in parts}
    labels = []
    for head, _, tail in parts:
        tail = tail.lstrip(".") or head
        labels.append(f"{head.split('.', 1)[0]}: {tail}" if len(heads) > 1 else tail)
    return [short_key(label, width) for label in labels]


def draw_chain(ax: Axes, data: ReportData, compact: bool = False) -> None:
    """Stored bytes of each checkpoint of the chain, newest at the top, against the size of the whole state."""
    layers = data.chain[:MAX_CHAIN][::-1]
    total = data.total_bytes or 1
    labels, sizes = [], []
    for layer in layers:
        kind = "unreadable" if layer.error else "delta" if layer.delta else "full"
        labels.append(f"step {layer.step} ({kind})")
        sizes.append(layer.stored_bytes or 0)
    ax.barh(range(len(layers)), sizes, color=["red" if lay.error else "C1" if lay.delta else "C0" for lay in layers])
    share = "%" if compact else "% of the state"
    for i, (layer, size) in enumerate(zip(layers, sizes, strict=True)):
        text = printable(layer.error[:80]) if layer.error else f"{human_bytes(size)} ({100 * size / total:.1f}{share})"
        ax.text(size, i, f"  {text}", va="center", fontsize=FONT)
    ax.set_yticks(range(len(layers)), labels, fontsize=FONT)
    ax.set_xlim(0, max(max(sizes, default=0), total) * (2.2 if compact else 1.5))
    ax.set_xticks([])
    ax.set_title("delta chain: bytes stored" if compact else
                 "delta chain: bytes each checkpoint stores (newest at the top)", fontsize=9)
