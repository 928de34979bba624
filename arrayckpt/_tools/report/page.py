"""The HTML page of ``report``: one file, no scripts, no requests; pictures inline as base64 PNG.

Every text that comes from a checkpoint (keys, paths, values, error messages) goes through ``html.escape``.
Numbers of the statistics and change tables carry their exact value in ``data-value`` (the cell shows six
significant digits), so that a script can read them back.
"""

from __future__ import annotations

import math
from html import escape
from string import Template
from typing import Any

from .data import Change, DeltaPart, ReportData, SizeNode, human_bytes, size_tree

__all__ = ["render"]

TREE_DEPTH = 4  # key parts the tree of sizes lists
TREE_CHILDREN = 40  # children listed per prefix (the others summed in one line)
CHANGES_LISTED = 200  # rows of the relative-change table

PAGE = Template("""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>arrayckpt report: $title</title>
<style>
body { font: 14px/1.45 system-ui, sans-serif; margin: 1.5em auto; max-width: 1400px; padding: 0 1em; color: #222; }
h1 { font-size: 1.5em; margin-bottom: 0.2em; } h2 { border-bottom: 1px solid #ccc; margin-top: 1.8em; }
code, td.key { font-family: ui-monospace, monospace; font-size: 12.5px; }
table { border-collapse: collapse; font-size: 13px; } th, td { padding: 2px 8px; border-bottom: 1px solid #eee; }
th { text-align: left; background: #f4f4f4; position: sticky; top: 0; }
td.num { text-align: right; white-space: nowrap; } td.key { min-width: 18em; }
div.wide { overflow-x: auto; }
.bad { color: #b00000; font-weight: bold; background: #ffe8e8; } .note { color: #555; }
.alert { border: 1px solid #b00000; background: #fff0f0; padding: 0.5em 1em; }
img { max-width: 100%; height: auto; } figure { margin: 1em 0; } figcaption { color: #555; font-size: 13px; }
nav a { margin-right: 1em; } ul.tree { list-style: none; padding-left: 1.2em; } summary { cursor: pointer; }
</style>
</head>
<body>
<h1>arrayckpt report</h1>
<p><code>$location</code></p>
<p class="meta">$meta</p>
<nav>$nav</nav>
$sections
</body>
</html>
""")


def render(data: ReportData, images: dict[str, str]) -> str:
    """The report page for ``data``, with ``images`` (base64 PNG by section name) inline."""
    sections = [("sizes", "Sizes", _sizes(data, images))]
    if data.against is not None:
        sections.append(("change", "Change", _change(data, images)))
    sections.append(("statistics", "Statistics", _statistics(data)))
    if "histograms" in images:
        sections.append(("histograms", "Histograms", _figure(images["histograms"], "value histograms of the largest "
                         "tensors (log counts; from a random sample where a tensor is larger than the sample)")))
    if data.grids:
        sections.append(("chunks", "Chunk grids", _grids(data, images)))
    if data.chain:
        sections.append(("chain", "Delta chain", _chain(data, images)))
    if data.values:
        sections.append(("values", "Values", _values(data)))
    body = [_alerts(data)] + [f'<section id="{name}">\n<h2>{title}</h2>\n{html}\n</section>'
                              for name, title, html in sections]
    return PAGE.substitute(title=escape(data.location), location=escape(data.location), meta=_meta(data),
                           nav="".join(f'<a href="#{name}">{title}</a>' for name, title, _ in sections),
                           sections="\n".join(body))


def _meta(data: ReportData) -> str:
    created = data.created
    parts = [f"format v{data.format_version}", *([f"step {data.step}"] if data.step is not None else []),
             f"{len(data.tensors)} tensors, {human_bytes(data.total_bytes)}"]
    if data.world_size is not None:
        parts.append(f"saved by {data.world_size} rank{'s' if data.world_size != 1 else ''}")
    for name in ("time", "library", "torch", "host", "converted_from"):
        if name in created:
            parts.append(f"{name} {created[name]}")
    if data.chain:
        parts.append(f"delta checkpoint ({len(data.chain)} checkpoints in its chain)")
    if data.against is not None:
        parts.append(f"compared with {data.against}")
    return escape(" · ".join(str(p) for p in parts))


def _figure(image: str, caption: str) -> str:
    return (f'<figure><img src="data:image/png;base64,{image}" alt="{escape(caption)}">'
            f"<figcaption>{escape(caption)}</figcaption></figure>")


def _alerts(data: ReportData) -> str:
    bad = [t for t in data.tensors if t.nonfinite]
    broken = [t for t in data.tensors if t.error]
    items = [f'<li><code>{escape(t.key)}</code>: <span class="bad">{t.nan} NaN, {t.inf} inf</span> of {t.count:,}</li>'
             for t in bad]
    items += [f'<li><code>{escape(t.key)}</code>: <span class="bad">unreadable</span>: {escape(t.error)}</li>'
              for t in broken]
    if not items:
        return ""
    what = "; ".join(([f"{len(bad)} tensor(s) hold NaN or inf values"] if bad else [])
                     + ([f"{len(broken)} tensor(s) could not be read"] if broken else []))
    return f'<div class="alert" id="alerts"><p class="bad">{escape(what)}</p>\n<ul>{"".join(items)}</ul></div>'


# ---------------------------------------------------------------------------------------- sections


def _sizes(data: ReportData, images: dict[str, str]) -> str:
    out = []
    if "sizes" in images:
        out.append(_figure(images["sizes"], "bytes by key prefix (a treemap: area is size) and by dtype"))
    tree = size_tree(data.tensors, TREE_DEPTH)
    out.append(f"<details open><summary>tree of sizes ({human_bytes(tree.nbytes)})</summary>\n"
               f'<ul class="tree">{"".join(_tree_items(tree, 0))}</ul></details>')
    return "\n".join(out)


def _tree_items(node: SizeNode, level: int) -> list[str]:
    out = []
    for child in node.children[:TREE_CHILDREN]:
        text = f"<code>{escape(child.name)}</code> {human_bytes(child.nbytes)}"
        text += f" ({child.tensors} tensors)" if child.tensors > 1 else ""
        if child.children and not (child.tensors == 1 and len(child.children) == 1 and not child.children[0].children):
            inner = "".join(_tree_items(child, level + 1))
            out.append(f'<li><details{" open" if level < 1 else ""}><summary>{text}</summary>'
                       f'<ul class="tree">{inner}</ul></details></li>')
        else:
            out.append(f"<li>{text}</li>")
    rest = node.children[TREE_CHILDREN:]
    if rest:
        out.append(f"<li>… {len(rest)} more, {human_bytes(sum(c.nbytes for c in rest))}</li>")
    return out


def _key(key: str) -> str:
    """A key for a table cell: escaped, with line-break opportunities after its dots."""
    return escape(key).replace(".", ".<wbr>")


def _number(value: Any, column: str, bad: bool = False, title: str = "") -> str:
    """A numeric cell: six significant digits shown, the exact value in ``data-value``."""
    if value is None:
        return f'<td class="num" data-col="{column}"></td>'
    title = f' title="{escape(title)}"' if title else ""
    if isinstance(value, float):
        shown = f"{value:.6g}"
    else:
        shown = f"{value:,}" if isinstance(value, int) and column in ("count", "nan", "inf") else str(value)
    css = "num bad" if bad else "num"
    return f'<td class="{css}" data-col="{column}" data-value="{escape(repr(value))}"{title}>{escape(shown)}</td>'


def _statistics(data: ReportData) -> str:
    delta = bool(data.chain)
    change = {c.key: c.relative for c in data.changes}
    head = ["key", "dtype", "shape", "size", *(["stored"] if delta else []), "count", "min", "max", "mean", "std",
            "zeros", "NaN", "inf", *(["change"] if data.against is not None else [])]
    rows = []
    for t in data.tensors:
        cells = [f'<td class="key">{_key(t.key)}</td>', f"<td>{escape(t.dtype)}</td>",
                 f"<td>{escape('×'.join(map(str, t.shape)) or 'scalar')}</td>", f'<td class="num">'
                 f"{human_bytes(t.nbytes)}</td>", *([f"<td>{escape(t.stored)}</td>"] if delta else [])]
        if t.error:
            cells.append(f'<td class="bad" colspan="{len(head) - len(cells)}">unreadable: {escape(t.error)}</td>')
        elif not t.computed:
            cells.append(f'<td class="note" colspan="{len(head) - len(cells)}">not computed (max_tensors)</td>')
        else:
            zeros = t.zeros / t.count if t.count else None
            cells += [_number(t.count, "count"), _number(t.min, "min"), _number(t.max, "max"),
                      _number(t.mean, "mean"), _number(t.std, "std"),
                      _number(zeros, "zeros", title=f"{t.zeros:,} zeros"),
                      _number(t.nan, "nan", bad=t.nan > 0), _number(t.inf, "inf", bad=t.inf > 0)]
            if data.against is not None:
                value = change.get(t.key)
                cells.append(_number(value, "change", bad=value is not None and not math.isfinite(value)))
        css = ' class="bad"' if t.nonfinite or t.error else ""
        rows.append(f'<tr data-key="{escape(t.key)}"{css}>{"".join(cells)}</tr>')
    note = ("<p class=\"note\">min, max, mean and std are over the finite values, as <code>arrayckpt show</code> "
            "computes them (complex tensors: magnitudes); count is every element; zeros is the fraction of elements "
            "equal to zero." + (" change is ||a - b|| / ||b|| against the other checkpoint." if data.against else "")
            + "</p>")
    header = "".join(f"<th>{escape(h)}</th>" for h in head)
    return f'{note}\n<div class="wide"><table id="statistics-table">\n<thead><tr>{header}</tr></thead>\n<tbody>\n' + \
        "\n".join(rows) + "\n</tbody>\n</table></div>"


def _change(data: ReportData, images: dict[str, str]) -> str:
    out = [f"<p>Relative change of each tensor, ||a - b|| / ||b||, where a is this checkpoint and b "
           f"<code>{escape(str(data.against))}</code>, summed over the whole tensor (NaN when either holds NaN or "
           "inf).</p>"]
    if "changes" in images:
        out.append(_figure(images["changes"], "the tensors that changed most (relative change): the model's, then the "
                                             "optimizer state's, each largest at the top"))
    if "layers" in images:
        out.append(_figure(images["layers"], "relative change by layer: parameter names (layer number as *) by layer"))
    out.append(_change_table(data.changes))
    if data.unmatched:
        items = "".join(f"<li><code>{escape(key)}</code>: {escape(why)}</li>" for key, why in data.unmatched)
        out.append(f"<p>Not compared:</p>\n<ul>{items}</ul>")
    return "\n".join(out)


def _change_table(changes: list[Change]) -> str:
    rows = [f'<tr data-key="{escape(c.key)}"><td class="num">{rank}</td><td class="key">{_key(c.key)}</td>'
            f'{_number(c.relative, "change", bad=not math.isfinite(c.relative))}</tr>'
            for rank, c in enumerate(changes[:CHANGES_LISTED], 1)]
    more = f"<p class=\"note\">… and {len(changes) - CHANGES_LISTED} more.</p>" if len(changes) > CHANGES_LISTED else ""
    return (f"<details><summary>the {len(changes)} compared tensors by relative change</summary>\n"
            '<table id="change-table">\n<thead><tr><th>#</th><th>key</th><th>relative change</th></tr></thead>\n'
            "<tbody>\n" + "\n".join(rows) + "\n</tbody>\n</table>" + more + "</details>")


def _grids(data: ReportData, images: dict[str, str]) -> str:
    ranks = data.world_size
    saved = f"saved by {ranks} rank{'s' if ranks != 1 else ''}" if ranks is not None else "saved by an unknown number"
    recorded = any(g.writers is not None for g in data.grids)
    whom = ("Each chunk is coloured by the rank that wrote it (recorded in the manifest's <code>created.writers"
            "</code>; the key above the pictures gives each rank's colour; lighter: a chunk a base checkpoint stores, "
            "in the colour of the rank that wrote it there; grey: writer unknown), so the picture is the "
            "sharding at save time."
            if recorded else "<strong>Which rank wrote each chunk is not recorded in the checkpoint</strong> (older "
            "checkpoints), so each chunk has a colour of its own rather than a rank's.")
    out = [f"<p>The outer chunk grids (one chunk file each) of the largest tensors; the checkpoint was {saved}. "
           f"{whom} When several ranks saved, arrayckpt aligns the chunks with the ranks' shards (every chunk lies "
           "inside one shard), so the chunk boundaries include the shard boundaries.</p>"]
    if "grids" in images:
        caption = "coloured by writing rank" if recorded else "colours tell chunks apart"
        out.append(_figure(images["grids"], f"outer chunk grids of the largest tensors ({caption})"))
    rows = "".join(f'<tr><td class="key">{_key(g.key)}</td><td>{"×".join(map(str, g.counts))}</td>'
                   f'<td>{"×".join(map(str, g.chunk))}</td><td>{"×".join(map(str, g.inner)) if g.inner else ""}</td>'
                   "</tr>" for g in data.grids)
    out.append("<table>\n<thead><tr><th>key</th><th>chunks</th><th>chunk shape</th><th>inner chunks</th></tr></thead>"
               f"\n<tbody>{rows}</tbody>\n</table>")
    return "\n".join(out)


def _chain(data: ReportData, images: dict[str, str]) -> str:
    out = ["<p>This is a delta checkpoint: it stores only what changed since its base, and reads the rest through "
           "the chain of bases below (newest first).</p>"]
    if "chain" in images:
        out.append(_figure(images["chain"], "bytes each checkpoint of the chain stores"))
    rows = []
    for layer in data.chain:
        stored = human_bytes(layer.stored_bytes) if layer.stored_bytes is not None else "?"
        kind = "delta" if layer.delta else "full"
        if layer.error:
            rows.append(f'<tr><td class="key">{escape(layer.location)}</td><td>{escape(str(layer.step))}</td>'
                        f'<td class="bad" colspan="2">unreadable: {escape(layer.error)}</td></tr>')
        else:
            rows.append(f'<tr><td class="key">{escape(layer.location)}</td><td>{escape(str(layer.step))}</td>'
                        f"<td>{kind}</td><td class=\"num\">{stored}</td></tr>")
    out.append('<table id="chain-table">\n<thead><tr><th>checkpoint</th><th>step</th><th>kind</th><th>stores</th>'
               "</tr></thead>\n<tbody>" + "".join(rows) + "</tbody>\n</table>")
    if "deltas" in images:
        out.append(_figure(images["deltas"], "what the delta stores of its largest changed tensors: chunks stored "
                           "(red; grey chunks are read from the base), or the fraction of rows stored along the rows"))
    out.append(_delta_table(data.deltas))
    return "\n".join(out)


def _delta_table(parts: list[DeltaPart]) -> str:
    rows = "".join(f'<tr data-key="{escape(p.key)}"><td class="key">{_key(p.key)}</td><td>{escape(p.mode)}</td>'
                   f'<td>{escape(p.stored)}</td><td class="num">{human_bytes(p.stored_bytes)}</td>'
                   f'<td class="num">{human_bytes(p.nbytes)}</td></tr>' for p in parts)
    return (f"<details><summary>what the delta stores of each of its {len(parts)} tensors, most first</summary>\n"
            '<table id="delta-table">\n<thead><tr><th>key</th><th>delta</th><th>stored</th><th>stored bytes</th>'
            f"<th>tensor</th></tr></thead>\n<tbody>{rows}</tbody>\n</table></details>")


def _values(data: ReportData) -> str:
    rows = "".join(f'<tr><td class="key">{_key(key)}</td><td><code>{escape(text)}</code></td></tr>'
                   for key, text in data.values)
    return f"<table>\n<thead><tr><th>key</th><th>value</th></tr></thead>\n<tbody>{rows}</tbody>\n</table>"

