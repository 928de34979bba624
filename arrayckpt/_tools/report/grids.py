"""The chunk pictures of ``report``: a tensor's outer chunk grid coloured by the rank that wrote each chunk (with a
key from colour to rank), and what a delta checkpoint stores of a tensor (its chunks, or its rows).

Drawn into given axes, like every ``draw_*`` function of ``figures.py``; matplotlib is imported when drawing.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import numpy as np

from .data import MAX_CELLS, ChunkGrid, DeltaPart, human_bytes
from .style import FONT, colormap, lighten, short_key

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

__all__ = ["draw_delta", "draw_grid", "draw_rank_legend", "grid_view", "top_rank"]

LISTED_RANKS = 20  # ranks a legend names one by one (more: a colour bar)
UNKNOWN = "#dddddd"  # a chunk whose writer is not recorded
LEGEND_DROP = 0.4  # inches from a picture's lower edge to its legend: room for tick labels and the axis label
BASE_TINT = 0.6  # how much lighter a chunk a base checkpoint stores is drawn (towards white)


def grid_view(grid: ChunkGrid) -> tuple[tuple[int, ...], list[np.ndarray], int]:
    """How a chunk grid is drawn (:attr:`ChunkGrid.view`): the dimensions drawn, the cell edges along each (in
    elements; chunks grouped ``group`` at a time when there are more than ``MAX_CELLS``), and ``group``."""
    dims, group = grid.view
    edges = [np.append(np.arange(0, grid.shape[d], grid.chunk[d] * group), grid.shape[d]) for d in dims]
    return dims, edges, group


def _mesh(ax: Axes, edges: list[np.ndarray], values: np.ndarray, **kwargs: Any) -> None:
    if len(edges) == 1:  # one dimension: a strip (``values``: a value or an RGBA colour per cell)
        ax.pcolormesh(edges[0], [0, 1], values[np.newaxis], **kwargs)
        ax.set_yticks([])
    else:
        ax.pcolormesh(edges[1], edges[0], values, **kwargs)
        ax.invert_yaxis()
    ax.tick_params(labelsize=FONT - 1)


def _axis_labels(ax: Axes, grid: ChunkGrid, dims: tuple[int, ...]) -> None:
    if len(dims) == 1:
        ax.set_xlabel(f"dim {dims[0]} ({grid.shape[dims[0]]})", fontsize=FONT)
    else:
        ax.set_ylabel(f"dim {dims[0]} ({grid.shape[dims[0]]})", fontsize=FONT)
        ax.set_xlabel(f"dim {dims[1]} ({grid.shape[dims[1]]})", fontsize=FONT)


def _rank_scale(top: int) -> tuple[Any, Any]:
    """The colour map and normalisation that give each rank up to ``top`` its colour: one of ten or twenty distinct
    colours for small jobs, a continuous scale (read from a colour bar) for larger ones."""
    from matplotlib.colors import Normalize

    if top < 10:
        return colormap("tab10"), Normalize(-0.5, 9.5)
    if top < 20:
        return colormap("tab20"), Normalize(-0.5, 19.5)
    return colormap("turbo"), Normalize(0, top)


def top_rank(grids: list[ChunkGrid]) -> int:
    """The largest rank any of ``grids`` shows (at least 1, so one rank still gets the first colour)."""
    return max([max(g.writers) for g in grids if g.writers] + [1])


def _writer_colours(grid: ChunkGrid, cells: list[int], top: int) -> np.ndarray:
    """RGBA per drawn cell: the writer's colour, lighter where a base checkpoint stores the chunk, grey where the
    writer is not recorded."""
    from matplotlib.colors import to_rgba

    cmap, norm = _rank_scale(top)
    ranks = np.asarray(grid.writers, np.int64).reshape(cells)
    colours = cmap(norm(np.maximum(ranks, 0)))
    if grid.in_base:
        tint = np.zeros(ranks.size, bool)
        tint[list(grid.in_base)] = True
        tint = tint.reshape(cells)
        colours[tint, :3] += (1 - colours[tint, :3]) * BASE_TINT
    colours[ranks < 0] = to_rgba(UNKNOWN)
    return colours


def _rank_handles(ranks: list[int], top: int, in_base: bool, unknown: bool) -> list[Any]:
    """Legend entries: a swatch per rank, then what lighter and grey chunks mean (where there are such)."""
    from matplotlib.patches import Patch

    cmap, norm = _rank_scale(top)
    handles = [Patch(facecolor=cmap(norm(r)), label=f"rank {r}") for r in ranks]
    if in_base:
        handles.append(Patch(facecolor=lighten("C7", BASE_TINT), label="lighter: stored by a base checkpoint"))
    if unknown:
        handles.append(Patch(facecolor=UNKNOWN, label="writer unknown"))
    return handles


def draw_rank_legend(figure: Figure, grids: list[ChunkGrid], top: float) -> None:
    """The key from colour to rank for chunk grid pictures, above them (``top``: the lower edge of its band): a
    swatch per rank for up to ``LISTED_RANKS`` ranks, else a colour bar."""
    recorded = [g for g in grids if g.writers is not None]
    ranks = sorted({r for g in recorded for r in g.writers if r >= 0})  # type: ignore[union-attr]
    in_base = any(g.in_base for g in recorded)
    unknown = any(r < 0 for g in recorded for r in g.writers)  # type: ignore[union-attr]
    high = top_rank(recorded)
    if len(ranks) <= LISTED_RANKS:
        handles = _rank_handles(ranks, high, in_base, unknown)
        figure.legend(handles=handles, loc="lower center", bbox_to_anchor=(0.5, top), ncols=min(len(handles), 8),
                      fontsize=FONT + 1, frameon=False, title="chunk colour: the rank that wrote it",
                      title_fontsize=FONT + 1)
        return
    from matplotlib.cm import ScalarMappable

    cmap, norm = _rank_scale(high)
    band = 1 - top  # its tick labels below the bar, its title above, all inside the band
    bar = figure.add_axes((0.3, top + 0.4 * band, 0.4, 0.18 * band))
    figure.colorbar(ScalarMappable(norm, cmap), cax=bar, orientation="horizontal")
    bar.set_title("chunk colour: the rank that wrote it" + ("; lighter: stored by a base checkpoint" if in_base
                                                            else ""), fontsize=FONT + 1)
    bar.tick_params(labelsize=FONT)


def draw_grid(ax: Axes, grid: ChunkGrid, top: int, legend: bool = False) -> None:
    """A tensor's outer chunks coloured by the rank that wrote each (lighter: stored by a base checkpoint; grey:
    not recorded), or, when the checkpoint does not record it, each chunk in a colour of its own. ``top``: the
    largest rank of the figure's grids (:func:`top_rank`: the same rank, the same colour in every one of them).
    ``legend``: a key from colour to rank below it (a figure of several grids draws one for all:
    :func:`draw_rank_legend`)."""
    dims, edges, group = grid_view(grid)
    cells = [len(e) - 1 for e in edges]
    edge = {"edgecolor": "white" if max(cells) <= 48 else "face", "linewidth": 0.6}
    if grid.writers is not None:
        _mesh(ax, edges, _writer_colours(grid, cells, top), **edge)
        shown = sorted({int(r) for r in grid.writers if r >= 0})
        by = f"rank{'s' if len(shown) != 1 else ''} " + (", ".join(map(str, shown)) if len(shown) <= 8 else
                                                         f"{shown[0]}–{shown[-1]}") if shown else "not recorded"
        if grid.in_base and len(grid.in_base) == len(grid.writers):
            by += " (all in a base)"
        if legend and len(shown) <= LISTED_RANKS:  # below the axis label, whatever the picture's height
            from matplotlib.transforms import ScaledTranslation

            below = ax.transAxes + ScaledTranslation(0, -LEGEND_DROP, ax.figure.dpi_scale_trans)
            ax.legend(handles=_rank_handles(shown, top, bool(grid.in_base), -1 in grid.writers), loc="upper center",
                      bbox_to_anchor=(0.5, 0), bbox_transform=below, ncols=4, fontsize=FONT, frameon=False)
    else:
        index = np.arange(math.prod(cells)).reshape(cells)
        colours = (index % cells[-1] + 7 * (index // cells[-1])) % 10 if len(cells) == 2 else index % 10
        _mesh(ax, edges, colours, cmap=colormap("tab10"), vmin=-0.5, vmax=9.5, **edge)
        by = "writers not recorded"
    if grid.inner and group == 1:  # inner chunks (the read unit) as thin lines, when few enough to see
        for position, d in enumerate(dims):
            cuts = np.setdiff1d(np.arange(0, grid.shape[d], grid.inner[d]), edges[position])
            if not 0 < len(cuts) <= 4 * MAX_CELLS:
                continue
            if len(dims) == 2 and position == 0:
                ax.hlines(cuts, 0, grid.shape[dims[1]], color="white", linewidth=0.3)
            else:
                ax.vlines(cuts, 0, 1 if len(dims) == 1 else grid.shape[dims[0]], color="white", linewidth=0.3)
    counts = "×".join(map(str, grid.counts))
    inner = f", inner {'×'.join(map(str, grid.inner))}" if grid.inner else ""
    grouped = f"; {group} per cell" if group > 1 else ""
    ax.set_title(f"{short_key(grid.key, 34)}\n{counts} chunks of {'×'.join(map(str, grid.chunk))}{inner}{grouped}"
                 f"\nby writer: {by}", fontsize=FONT)
    _axis_labels(ax, grid, dims)


def draw_delta(ax: Axes, part: DeltaPart) -> None:
    """What a delta stores of one tensor: its stored chunks (coloured; grey ones are read from the base), or the
    fraction of rows it stores along the rows."""
    title = f"{short_key(part.key, 34)}\n{part.stored}, {human_bytes(part.stored_bytes)} stored"
    if part.row_density is not None:
        bins = len(part.row_density)
        ax.stairs(part.row_density, np.linspace(0, 1, bins + 1), fill=True,
                  color="C3", edgecolor="C3", linewidth=0.8)
        ax.set_xlabel("position along dim 0 (fraction)", fontsize=FONT)
        ax.set_ylim(0, max(float(part.row_density.max(initial=0.0)) * 1.15, 1e-9))
        ax.set_ylabel("fraction of rows stored", fontsize=FONT)
        ax.tick_params(labelsize=FONT - 1)
        ax.set_title(title, fontsize=FONT)
        return
    assert part.grid is not None
    dims, edges, group = grid_view(part.grid)
    counts = part.grid.counts
    stored = np.zeros([len(e) - 1 for e in edges])
    for flat in part.present:
        position = np.unravel_index(flat, counts)
        stored[tuple(position[d] // group for d in dims)] += 1
    per_cell = math.prod(counts) / max(1, stored.size)
    shown = np.ma.masked_equal(stored / per_cell, 0)
    cmap = colormap("Reds", bad="#e4e4e4")
    _mesh(ax, edges, shown, cmap=cmap, vmin=0, vmax=1, edgecolor="white" if max(stored.shape) <= 48 else "face",
          linewidth=0.6)
    ax.set_title(title, fontsize=FONT)
    _axis_labels(ax, part.grid, dims)
