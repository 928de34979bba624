"""The manual holds what it promises: every public name is documented with its parameters (``Args:``), what it returns
(``Returns:``), the errors it raises (``Raises:``, each a real exception class) and an example; and the manual's
examples run: every ```` ```python ```` block of ``README.md`` and ``docs/**/*.md`` is executed here.

The public names are ``arrayckpt.__all__`` and the ``__all__`` of ``arrayckpt.dcp``, ``arrayckpt.deepspeed`` and
``arrayckpt.lightning``; of their classes, the public methods a user calls (those a framework calls for the user, and
``Checkpoint``'s and ``LazyArray``'s mapping-level API, documented with the class, are listed in ``_METHODS_EXEMPT``).

A page's blocks run in order in one namespace (a later block may use what an earlier one made), in a fresh
temporary directory. A block that needs a multi-process launch, a GPU, a server or a foreign training stack is
preceded by ``<!-- no-run: why -->`` and is only compiled.
"""

from __future__ import annotations

import builtins
import importlib
import inspect
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

import arrayckpt

ROOT = Path(__file__).resolve().parent.parent
MODULES = ("arrayckpt", "arrayckpt.dcp", "arrayckpt.deepspeed")
SLOW_MODULES = ("arrayckpt.lightning",)  # importing Lightning takes seconds

# classes whose public methods users do not call: a framework calls them (DCP's StorageReader/StorageWriter
# protocol, Lightning's CheckpointIO), or they are documented as a mapping with the class
_METHODS_EXEMPT = {"Checkpoint", "LazyArray", "ArrayckptReader", "ArrayckptWriter", "ArrayckptIO"}

# classes only arrayckpt constructs (``open``, indexing, ``async_save``): their constructor's arguments are not the
# user's, so they need an example but no Args section
_MADE_BY_ARRAYCKPT = {"Checkpoint", "LazyArray", "SaveHandle"}

_SECTION = re.compile(r"^(\s*)(Args|Arguments|Parameters|Attributes|Returns|Yields|Raises|Examples?):\s*$")
_ENTRY = re.compile(r"^(\*{0,2}[A-Za-z_][A-Za-z0-9_]*)\s*(\([^)]*\))?\s*:")


def _public(modules: tuple[str, ...]) -> Iterator[tuple[str, object]]:
    """Every documented name, as ``(dotted name, object)``: the modules' public names and their classes' methods."""
    for module_name in modules:
        module = importlib.import_module(module_name)
        for name in module.__all__:
            if name.startswith("__"):
                continue
            value = getattr(module, name)
            yield f"{module_name}.{name}", value
            if inspect.isclass(value) and not issubclass(value, BaseException) and name not in _METHODS_EXEMPT:
                for attribute, member in vars(value).items():
                    function = member.__func__ if isinstance(member, (staticmethod, classmethod)) else member
                    if not attribute.startswith("_") and inspect.isfunction(function):
                        yield f"{module_name}.{name}.{attribute}", function


def sections(doc: str) -> dict[str, list[str]]:
    """A Google-style docstring's sections: name -> its lines (dedented to the section's entries)."""
    found: dict[str, list[str]] = {}
    lines = doc.splitlines()
    i = 0
    while i < len(lines):
        match = _SECTION.match(lines[i])
        if not match:
            i += 1
            continue
        indent, name = len(match.group(1)), match.group(2)
        body: list[str] = []
        i += 1
        while i < len(lines) and (not lines[i].strip() or len(lines[i]) - len(lines[i].lstrip()) > indent):
            body.append(lines[i])
            i += 1
        found[{"Arguments": "Args", "Parameters": "Args", "Example": "Examples"}.get(name, name)] = body
    return found


def entries(body: list[str]) -> list[str]:
    """The names an Args/Attributes/Raises section lists (the lines at its first indentation)."""
    indents = [len(line) - len(line.lstrip()) for line in body if line.strip()]
    if not indents:
        return []
    first = min(indents)
    names = []
    for line in body:
        if line.strip() and len(line) - len(line.lstrip()) == first:
            match = _ENTRY.match(line.strip())
            if match:
                names.append(match.group(1).lstrip("*"))
    return names


def _parameters(value: Callable[..., object]) -> list[str]:
    try:
        signature = inspect.signature(value)
    except (TypeError, ValueError):
        return []
    return [name for name in signature.parameters if name not in ("self", "cls")]


def _returns_something(value: Callable[..., object]) -> bool:
    annotation = inspect.signature(value).return_annotation
    return annotation not in (None, "None", inspect.Signature.empty)


def problems(name: str, value: object) -> list[str]:
    """What the docstring of ``value`` lacks, for every callable with parameters (an error class needs a line only)."""
    doc = inspect.getdoc(value) or ""
    if inspect.isclass(value) and issubclass(value, BaseException):
        return [] if doc.strip() else [f"{name}: no docstring (one line on when it is raised)"]
    assert callable(value)
    parameters = [] if getattr(value, "__name__", "") in _MADE_BY_ARRAYCKPT else _parameters(value)
    if not parameters and not inspect.isclass(value):
        return []
    found = sections(doc)
    wrong = []
    listed = entries(found.get("Args", [])) + entries(found.get("Attributes", []))
    unlisted = [p for p in parameters if p not in listed]
    if unlisted:
        wrong.append(f"{name}: its Args (or, for a result, Attributes) section does not name {unlisted}")
    if not inspect.isclass(value) and _returns_something(value) and "Returns" not in found and "Yields" not in found:
        wrong.append(f"{name}: no Returns section")
    for error in entries(found.get("Raises", [])):
        raised = getattr(arrayckpt, error, None) or getattr(builtins, error, None)
        if not (inspect.isclass(raised) and issubclass(raised, BaseException)):
            wrong.append(f"{name}: its Raises section names {error!r}, not an exception of arrayckpt or builtins")
    example = "\n".join(found.get("Examples", []))
    if not (">>>" in example or "```" in example or re.search(r"::\s*$", example, re.M)):
        wrong.append(f"{name}: no Examples section with a `>>>` example or a code block")
    return wrong


@pytest.mark.parametrize("modules", [MODULES, pytest.param(SLOW_MODULES, marks=pytest.mark.slow)],
                         ids=["arrayckpt", "lightning"])
def test_every_public_name_is_documented(modules: tuple[str, ...]):
    wrong = [problem for name, value in _public(modules) for problem in problems(name, value)]
    assert not wrong, "\n".join(wrong)


def test_the_docstring_check_catches_what_it_should():
    def undocumented(path: str, *, strict: bool = True) -> int:
        """Does something."""
        return 0

    def documented(path: str, *, strict: bool = True) -> int:
        """Does something.

        Args:
            path: where.
            strict (bool): how.

        Returns:
            a number.

        Raises:
            CheckpointNotFoundError: nothing there.

        Examples:
            >>> documented("x")
            0
        """
        return 0

    assert len(problems("undocumented", undocumented)) == 3
    assert problems("documented", documented) == []


# --- the manual's examples run ------------------------------------------------------------------------------------

_FENCE = re.compile(r"^( *)```python\s*$")
_NO_RUN = re.compile(r"<!--\s*no-run:\s*(\S.*?)\s*-->")


def code_blocks(path: Path) -> list[tuple[int, str, str | None]]:
    """The ```` ```python ```` blocks of a page: (line number, code, the no-run reason or None)."""
    lines = path.read_text().splitlines()
    blocks = []
    i = 0
    while i < len(lines):
        match = _FENCE.match(lines[i])
        if not match:
            i += 1
            continue
        start, indent = i, len(match.group(1))
        previous = next((line for line in reversed(lines[:i]) if line.strip()), "")
        no_run = _NO_RUN.search(previous)
        body = []
        i += 1
        while i < len(lines) and lines[i].strip() != "```":
            body.append(lines[i][indent:])
            i += 1
        blocks.append((start + 1, "\n".join(body) + "\n", no_run.group(1) if no_run else None))
        i += 1
    return blocks


PAGES = sorted(p for p in [ROOT / "README.md", *(ROOT / "docs").rglob("*.md")] if code_blocks(p))


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_manual_examples_run(page: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.chdir(tmp_path)
    namespace: dict[str, object] = {"__name__": "__manual__"}
    for line, code, no_run in code_blocks(page):
        where = f"{page.relative_to(ROOT)}:{line}"
        compiled = compile(code, where, "exec")  # every block parses, run or not
        if no_run is None:
            exec(compiled, namespace)


def test_every_no_run_marker_is_on_a_block():
    """A ``<!-- no-run: why -->`` marker stands right before a ```` ```python ```` block, and says why."""
    for page in [ROOT / "README.md", *(ROOT / "docs").rglob("*.md")]:
        lines = page.read_text().splitlines()
        for i, line in enumerate(lines):
            if "no-run" in line:
                where = f"{page.relative_to(ROOT)}:{i + 1}"
                assert _NO_RUN.search(line), f"{where}: write the marker as <!-- no-run: why -->"
                following = next((later for later in lines[i + 1:] if later.strip()), "")
                assert _FENCE.match(following), f"{where}: the no-run marker is not right before a ```python block"


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("mkdocs") is None, reason="mkdocs is not installed (the [test] extra has it)")
def test_the_manual_builds_without_warnings(tmp_path: Path):
    """``mkdocs build --strict``: a broken link, a missing page or a docstring mkdocstrings cannot render fails it."""
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr[-4000:]
    api = (tmp_path / "api" / "index.html").read_text()
    assert "Parameters:" in api and "Returns:" in api and "Raises:" in api
