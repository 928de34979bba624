"""What ``arrayckpt info`` prints for a person: lines that fit the terminal, the save's record of which rank wrote which
chunks as a summary, and the note on zarr-python's data types only where it applies.

``--json`` keeps every detail (the whole ``created.writers`` record, every value in full); the text is a summary: no
line is longer than ``width`` (the terminal's, or ``COLUMNS``; output into a pipe or a file is not cut unless
``COLUMNS`` is set, so that ``grep`` and scripts see whole keys and paths). Long keys and paths lose their middle
(``model.layers.…mlp.weight``), other lines their end (``…``); ``--wide`` (``width=0``) prints everything. Pure
functions of their arguments; no torch or TensorStore at import.

:func:`emit` is the one way the commands print text for a person: every line passes through :func:`escaped`, so a
key, value, path or error message from a checkpoint cannot move the cursor, clear the screen, reorder the text (bidi
controls) or start a line of its own.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
import textwrap
from collections.abc import Iterable, Mapping
from typing import Any, TextIO

from .._tools.estimate import human_bytes

__all__ = ["emit", "escaped", "info_header", "info_lines", "ranks_text", "site_dirs", "terminal_width", "tree_lines",
           "writers_summary", "zarr_hint"]

ELLIPSIS = "…"
MIN_KEY = 16  # the narrowest the key column gets (narrower terminals clip whole lines)
LISTED_RANKS = 8  # ranks listed one by one in the writers summary; more are summarised
HOOK_PTH = "arrayckpt-zarr-dtypes.pth"  # the start-up hook's file in site-packages (setup.py installs it)
HOOK_DISABLE_ENV = "ARRAYCKPT_NO_ZARR_HOOK"  # what turns it off (`_arrayckpt_zarr_hook.DISABLE_ENV`)


# What a terminal acts on rather than shows: C0 (newline and tab included), DEL, C1, the bidi controls (which
# reorder what follows them: "Trojan Source"), the Unicode line and paragraph separators, and the byte order mark.
CONTROLS = re.compile("[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028\u2029\u202a-\u202e\u2066-\u2069\ufeff]")
NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escape(match: re.Match[str]) -> str:
    char = match.group()
    return NAMED.get(char) or (f"\\x{ord(char):02x}" if ord(char) < 0x100 else f"\\u{ord(char):04x}")


def escaped(text: str) -> str:
    """``text`` with every control character written out as Python writes it in a string (``\\x1b``, ``\\n``,
    ``\\u202e``), so that text from a checkpoint prints as what it is and on one line.

    >>> escaped("a\\x1b[2Jb\\rc")
    'a\\\\x1b[2Jb\\\\rc'
    """
    return CONTROLS.sub(_escape, text)


def emit(*lines: str, file: TextIO | None = None) -> None:
    """Print ``lines`` for a person (on stdout, or ``file``), one line each, every control character in them escaped:
    the one place where the commands' text output meets a terminal (JSON output escapes on its own)."""
    print("\n".join(escaped(line) for line in lines), file=sys.stdout if file is None else file)


def terminal_width() -> int:
    """The terminal's width in columns (``COLUMNS`` if set); 0 (no limit) when the output is not a terminal."""
    if "COLUMNS" not in os.environ and not sys.stdout.isatty():
        return 0
    return shutil.get_terminal_size().columns


def clip(line: str, width: int) -> str:
    """``line`` cut to ``width`` characters, the last one an ellipsis (``width`` 0: as it is)."""
    line = line.rstrip()
    return line if not width or len(line) <= width else line[: max(width - 1, 0)] + ELLIPSIS


def middle(text: str, width: int) -> str:
    """``text`` in at most ``width`` characters, its middle replaced by an ellipsis (keys and paths: the start says
    where, the end what).

    >>> middle("optimizer_states.0.state.12.exp_avg_sq", 24)
    'optimizer_s…2.exp_avg_sq'
    """
    if not width or len(text) <= width:
        return text
    head = (width - 1) // 2
    return text[:head] + ELLIPSIS + text[len(text) - (width - 1 - head):]


def _with_path(prefix: str, path: str, suffix: str, width: int) -> list[str]:
    """``prefix + path + suffix`` in ``width`` characters, shortening the path in the middle first; two lines
    (the suffix indented below) when the path would keep fewer than ``MIN_KEY`` characters."""
    room = width - len(prefix) - len(suffix) if width else 0
    if width and room < MIN_KEY:
        return [clip(prefix + middle(path, width - len(prefix)), width), clip("  " + suffix.strip(), width)]
    return [prefix + middle(path, room) + suffix]


def writers_summary(record: object) -> str:
    """``created.writers`` (which rank wrote each chunk of each array) in a few words: ranks and chunks per rank.

    >>> writers_summary({"model/w": [[0, 1, 2, 2]], "model/b": [[0, 0, 1, 1]]})
    '2 ranks, 5 chunks (rank 0: 3, rank 1: 2)'
    """
    from .._format.writers import writer_counts

    counts = writer_counts(record)
    if counts is None:
        return "(not a record arrayckpt reads)"
    total = sum(counts.values())
    head = f"{len(counts)} rank{'' if len(counts) == 1 else 's'}, {total:,} chunk{'' if total == 1 else 's'}"
    if len(counts) <= 1:
        return head
    if len(counts) <= LISTED_RANKS:
        return head + " (" + ", ".join(f"rank {rank}: {n:,}" for rank, n in counts.items()) + ")"
    low, high = min(counts.values()), max(counts.values())
    return head + (f" ({low:,} per rank)" if low == high else f" ({low:,}–{high:,} per rank)")


def created_lines(created: Mapping[str, Any], width: int) -> list[str]:
    """The ``created`` record as ``created   key=value, ...`` lines, wrapped at ``width``; ``writers`` summarised."""
    items = [f"{key}={writers_summary(value) if key == 'writers' else value}" for key, value in created.items()]
    if not items:
        return []
    texts = [item + "," for item in items[:-1]] + items[-1:]
    lines: list[str] = []
    for text in texts:  # an item stays on one line (clipped if it alone is too long)
        if lines and (not width or len(lines[-1]) + 1 + len(text) <= width):
            lines[-1] += " " + text
        else:
            lines.append(("created   " if not lines else " " * 10) + text)
    return [clip(line, width) for line in lines]


def _table(info: Mapping[str, Any], width: int) -> list[str]:
    """The tensor table; a key column too wide for the terminal shortens its keys in the middle."""
    delta = len(info["chain"]) > 1
    rows = [[k, t["dtype"], "×".join(map(str, t["shape"])) or "scalar", human_bytes(t["nbytes"]), t["codec"],
             "×".join(map(str, t["chunks"])) or "1", *((t["stored"],) if delta else ())]
            for k, t in info["tensors"].items()]
    header = ["key", "dtype", "shape", "size", "codec", "chunks", *(("stored",) if delta else ())]
    widths = [max([len(header[i])] + [len(r[i]) for r in rows]) for i in range(len(header))]
    others = sum(widths[1:]) + 2 * (len(widths) - 1)
    if width and widths[0] + others > width:
        widths[0] = max(width - others, MIN_KEY, len(header[0]))
        for row in rows:
            row[0] = middle(row[0], widths[0])
    out = ["  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True))]
    for row in rows:
        out.append("  ".join(c.rjust(w) if i == 3 else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths,
                                                                                                strict=True))))
    return [clip(line, width) for line in out]


def info_header(info: Mapping[str, Any]) -> str:
    """``checkpoint PATH  (format v1, step 3)``; the step recorded at save, else the plain value that names it
    (``step``, or a single ``train_state.step``: ``_format.values.step_value``), labelled as not recorded."""
    from .._format.values import step_value

    step = info["step"]
    if step is None:
        found = step_value(info["values"])
        step = "none recorded" if found is None else f"none recorded; the value `{found.key}` is {found.step}"
    packs = info.get("packs")
    layout = "" if not packs else f", packed: {packs['files']} pack{'' if packs['files'] == 1 else 's'}"
    return f"checkpoint {info['path']}  (format v{info['format_version']}{layout}, step {step})"


def ranks_text(ranks: list[str]) -> str:
    """``per rank (2 ranks): uint8[5056] each`` or each rank's."""
    same = len(set(ranks)) == 1
    count = f"{len(ranks)} rank{'' if len(ranks) == 1 else 's'}"
    return f"per rank ({count}): " + (f"{ranks[0]} each" if same else ", ".join(ranks))


def info_lines(info: Mapping[str, Any], width: int, notes: Iterable[str] = ()) -> list[str]:
    """Everything ``arrayckpt info`` prints (``info``: ``info.info_dict``'s data), one line each (for :func:`emit`,
    which escapes them), no line longer than ``width`` (0: no limit); ``notes`` (the zarr data-type note) follow the
    table, wrapped."""
    out = _with_path("checkpoint ", info["path"], info_header(info)[len("checkpoint ") + len(info["path"]):], width)
    out += created_lines(info["created"], width)
    out.append("")
    out += _table(info, width)
    n = len(info["tensors"])
    out += ["", f"{n} tensor{'' if n == 1 else 's'}, {human_bytes(info['total_bytes'])}"]
    for note in notes:
        out += textwrap.wrap(note, width, subsequent_indent="      ") if width else [note]
    if info["aliases"]:
        out += ["", clip("aliases (one tensor saved under two keys, e.g. tied weights: stored once, under the key on "
                         "the right)", width)]
        out += [clip(f"  {key} -> {target}", width) for key, target in info["aliases"].items()]
    if len(info["chain"]) > 1:
        out += ["", clip(f"delta checkpoint: stores {human_bytes(info['stored_bytes'] or 0)} itself; chain (newest "
                         "first):", width)]
        for layer in info["chain"]:
            if "error" in layer:
                out.append(clip(f"  {layer['path']}  UNREADABLE: {layer['error']}", width))
                continue
            stored = human_bytes(layer["stored_bytes"]) if layer["stored_bytes"] is not None else "?"
            kind = "delta" if layer["delta"] else "full"
            out += _with_path("  ", layer["path"], f"  step {layer['step']}  {kind}, {stored}", width)
    if info["per_rank"]:
        out += ["", clip("per-rank entries (`arrayckpt show PATH KEY`: each rank's)", width)]
        out += [clip(f"  {key}  {ranks_text(ranks)}", width) for key, ranks in info["per_rank"].items()]
    if info["values"]:
        out += ["", "values (`arrayckpt show PATH KEY`: one in full)"]
        out += [clip(f"  {key} = {value!r}", width) for key, value in info["values"].items()]
    return out


def tree_lines(info: Mapping[str, Any], width: int) -> list[str]:
    """``info --tree``: the keys as a tree of their dotted parts, containers once, leaves with what they hold."""
    out = _with_path("checkpoint ", info["path"], info_header(info)[len("checkpoint ") + len(info["path"]):], width)
    leaves = {key: (f"{t['dtype']} {'×'.join(map(str, t['shape'])) or 'scalar'}  {human_bytes(t['nbytes'])}  "
                    f"{t['codec']}") for key, t in info["tensors"].items()}
    leaves.update({key: f"= {value!r}" for key, value in info["values"].items()})
    leaves.update({key: f"alias of {target}" for key, target in info["aliases"].items()})
    leaves.update({key: ranks_text(ranks) for key, ranks in info["per_rank"].items()})
    shown: set[str] = set()
    for key, text in leaves.items():
        parts = key.split(".")
        for depth in range(len(parts) - 1):
            prefix = ".".join(parts[: depth + 1])
            if prefix not in shown:
                shown.add(prefix)
                out.append(clip("  " * depth + parts[depth] + "/", width))
        out.append(clip("  " * (len(parts) - 1) + f"{parts[-1]}  {text}", width))
    return out


def site_dirs() -> list[str]:
    """The directories whose ``.pth`` files a fresh ``python`` of this environment runs at start-up."""
    import site

    dirs = list(site.getsitepackages())
    if site.ENABLE_USER_SITE is not False:
        dirs.append(site.getusersitepackages())
    return dirs


def zarr_hint(dtypes: Iterable[str], sites: Iterable[str] | None = None,
              environ: Mapping[str, str] = os.environ) -> str | None:
    """The note for bfloat16/float8 arrays when zarr-python run without ``import arrayckpt`` could not read them:
    when arrayckpt's start-up hook (``arrayckpt-zarr-dtypes.pth`` in site-packages, which registers the types as zarr
    is imported) is not installed in this environment (``sites``: its site directories), or is turned off; ``None``
    when it is active or there are no such arrays. (Whether this process ran the hook says nothing: ``import
    arrayckpt`` registers the types itself.)"""
    special = sorted({name for name in dtypes if name == "bfloat16" or name.startswith("float8")})
    if not special:
        return None
    what = f"note: zarr-python run without `import arrayckpt` cannot read the {', '.join(special)} arrays here:"
    instead = "or run `import arrayckpt` before zarr opens them"
    if environ.get(HOOK_DISABLE_ENV, "") not in ("", "0"):
        setting = f"{HOOK_DISABLE_ENV}={environ[HOOK_DISABLE_ENV]}"
        return f"{what} {setting} turns off arrayckpt's start-up hook; unset it, {instead}"
    sites = site_dirs() if sites is None else list(sites)
    if any(os.path.isfile(os.path.join(directory, HOOK_PTH)) for directory in sites):
        return None
    return (f"{what} arrayckpt's start-up hook ({HOOK_PTH}, which registers these data types when zarr is imported) "
            f"is not installed in this Python's site-packages ({', '.join(sites) or 'none'}): installing arrayckpt "
            f"with pip puts it there (`pip install arrayckpt`; from a source tree `pip install -e .`), {instead}")
