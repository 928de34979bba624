"""What every picture of ``report`` shares: resolution, font size, colour maps, how a long key is shortened.

Imported only where the pictures are drawn (matplotlib is an optional extra; each function imports it when called).
"""

from __future__ import annotations

from typing import Any, cast

__all__ = ["DPI", "FONT", "colormap", "lighten", "short_key"]

DPI = 90
FONT = 7


def lighten(colour: Any, amount: float) -> tuple[float, float, float]:
    """``colour`` moved ``amount`` (0..1) of the way to white, as RGB."""
    from matplotlib.colors import to_rgb

    return cast("tuple[float, float, float]", tuple(c + (1 - c) * amount for c in to_rgb(colour)))


def colormap(name: str, bad: str | None = None) -> Any:
    """matplotlib's colour map ``name``, drawing masked (invalid) values in ``bad``."""
    from matplotlib import colormaps

    return colormaps[name] if bad is None else colormaps[name].with_extremes(bad=bad)


def short_key(key: str, width: int = 38) -> str:
    """``key`` in at most ``width`` characters: its first part, an ellipsis and as much of its end as fits.

    >>> short_key("optim.state.layers.*.mlp.down_proj.weight.exp_avg", 31)
    'optim.…down_proj.weight.exp_avg'
    """
    if len(key) <= width:
        return key
    head = key.split(".", 1)[0][:width // 3] + "."
    return head + "…" + key[-(width - len(head) - 1):]
