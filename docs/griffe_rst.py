"""A griffe extension for the API reference (``docs/api.md``): the docstrings are reStructuredText-flavoured prose,
rendered by mkdocstrings as Markdown. Before rendering, this turns the three reST habits that Markdown misreads
into their Markdown forms: doctest runs (``>>>`` lines) become ``pycon`` code blocks, Sphinx roles
(``:func:`name```) become code, and a paragraph's closing ``::`` (a literal block follows, indented, which
Markdown renders as code too) becomes ``:``. The docstrings themselves are left as they are."""

from __future__ import annotations

import re
from typing import Any

import griffe

_ROLE = re.compile(r":(?:py:)?(?:class|func|meth|attr|exc|data|mod|obj):`~?([^`]+)`")


def rst_to_markdown(text: str) -> str:
    out: list[str] = []
    in_doctest = False
    for line in text.splitlines():
        stripped = line.strip()
        if not in_doctest and stripped.startswith(">>>"):
            indent = line[: len(line) - len(line.lstrip())]
            out.append(f"{indent}```pycon")
            in_doctest = True
        elif in_doctest and not stripped:
            out.append(f"{indent}```")
            in_doctest = False
        if not in_doctest:
            line = _ROLE.sub(r"``\1``", line)
            if line.endswith("::") and not line.strip() == "::":
                line = line[:-1]
        out.append(line)
    if in_doctest:
        out.append(f"{indent}```")
    return "\n".join(out)


class RstDocstrings(griffe.Extension):
    def on_object(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = rst_to_markdown(obj.docstring.value)
