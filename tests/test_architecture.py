"""Guards that keep the package's structure as ``docs/development.md`` describes it ("How the code is organised").

- imports go one way, down the layers, and no module imports a private name (``_x``) of another subpackage;
- there are no import cycles between modules;
- the public API is one table: ``__all__``, the lazy table and the TYPE_CHECKING imports agree, and every name
  resolves;
- the format and read layers need no torch: a process where ``import torch`` fails opens, slices, verifies,
  shows and inspects a checkpoint;
- no module is longer than ~500 lines besides its docstrings unless its docstring says why;
- the public ``Checkpoint`` has its user-facing members only (``CHECKPOINT_MEMBERS``), its plumbing kept private;
- tuning knobs live in ``_settings.py`` (no module-level ``*_BYTES``/``*_THREADS``/... constants elsewhere);
- at most ``MAX_ANY_SHARE`` of the package's annotations mention ``Any`` (the real type where it is known);
- tests that spawn processes are marked ``slow`` (the quick run leaves them out), and the README's test command
  (CI's) runs them all;
- the README stays under ``README_LINES`` lines (the manual is the site built from ``docs/``).

Imports are read with ``ast``; function-level imports count (they run too), and so do imports under
``if TYPE_CHECKING:`` (a type a module names is a dependency all the same: a cycle through one is a design cycle,
only hidden from the interpreter). The public table's TYPE_CHECKING imports in ``__init__.py`` go down like any.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import arrayckpt

PACKAGE = Path(arrayckpt.__file__).parent

# Lowest first: a module may import from its own layer and the layers before it, never from a later one.
LAYERS = [
    ("_errors", "_version", "_zarr_dtypes", "_settings"),
    ("_format",),
    ("_layout",),
    ("_io",),
    ("_storage",),
    ("_torch",),
    ("_read",),
    ("_write",),
    ("_tools",),
    ("_convert",),
    ("_peer",),  # the manager's peer-memory tier
    ("_manage",),  # the checkpoint manager: policies, tiers, uploader, restore, SIGTERM
    ("_integrations",),  # other stacks' plug-in points: DCP storage, Lightning CheckpointIO
    ("_cli",),  # the command line: parsing and printing, one module per group of commands
    ("cli", "dcp", "deepspeed", "lightning", "torchtitan"),
    ("__init__",),
]
LAYER_OF = {name: i for i, names in enumerate(LAYERS) for name in names}
# Subpackages whose modules must import without torch (the format layer and everything ``arrayckpt.open`` needs).
TORCH_FREE = ("_errors", "_version", "_settings", "_zarr_dtypes", "_format", "_layout", "_io", "_storage")
# Modules of the layers that use torch which import without it: the torch guards, and `convert` (whose
# arrayckpt -> safetensors export needs no torch; the other converters are imported when used).
TORCH_FREE_MODULES = ("_torch", "_convert.dispatch")
MAX_LINES = 500
LONG_REASON = "Longer than 500 lines:"  # what a module's docstring says when it is longer, followed by why


def _modules() -> dict[str, Path]:
    """Every module of the package by dotted name relative to it (``_read.chain``, ``cli``, ``__init__``)."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        out[".".join(parts)] = path
    return out


def _top(module: str) -> str:
    """The part of the package a module belongs to: its subpackage, or itself for a top-level module."""
    return module.split(".")[0]


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    """ids of the import nodes under ``if TYPE_CHECKING:`` blocks."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            for inner in node.body:
                for sub in ast.walk(inner):
                    found.add(id(sub))
    return found


def _resolve(module: str, level: int, target: str | None) -> str:
    """The package-relative dotted name a relative import in ``module`` names."""
    base = module.split(".")
    is_package = base[-1] == "__init__"
    base = base[:-1]  # the package holding the module (for __init__: the package itself)
    if is_package and base == []:
        base = []
    for _ in range(level - 1):
        base = base[:-1]
    return ".".join([*base, *(target.split(".") if target else [])])


def _imports(module: str, path: Path, type_checking: bool = True) -> list[tuple[str, list[str], int]]:
    """(imported package module, names imported from it, line) for every import of the package (without
    ``type_checking``: only those that run)."""
    tree = ast.parse(path.read_text())
    skip = set() if type_checking else _type_checking_nodes(tree)
    modules = _modules()
    out = []
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.ImportFrom):
            if node.level:
                target = _resolve(module, node.level, node.module)
            elif node.module and (node.module == "arrayckpt" or node.module.startswith("arrayckpt.")):
                target = node.module.removeprefix("arrayckpt").lstrip(".")
            else:
                continue
            names = [a.name for a in node.names]
            if target == "" or target in {m.rsplit(".__init__", 1)[0] for m in modules if m.endswith("__init__")}:
                # "from . import x" / "from .._write import save": the names are modules (or package attributes)
                prefix = f"{target}." if target else ""
                for name in names:
                    child = f"{prefix}{name}"
                    out.append((child if child in modules else (f"{target}.__init__" if target else "__init__"),
                                [] if child in modules else [name], node.lineno))
            else:
                out.append((target, names, node.lineno))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("arrayckpt."):
                    out.append((alias.name.removeprefix("arrayckpt."), [], node.lineno))
    return out


def _graph() -> dict[str, list[tuple[str, list[str], int]]]:
    return {module: _imports(module, path) for module, path in _modules().items()}


def test_imports_go_down_the_layers_and_no_private_name_crosses_a_subpackage():
    problems = []
    for module, imports in _graph().items():
        here = _top(module)
        assert here in LAYER_OF, f"{module}: its part of the package is not in LAYERS; add it"
        for target, names, line in imports:
            there = _top(target)
            if LAYER_OF[there] > LAYER_OF[here]:
                problems.append(f"{module}:{line} imports {target} (layer {there!r} is above {here!r})")
            if there != here:
                private = [n for n in names if n.startswith("_") and not n.startswith("__")]
                if private:
                    problems.append(f"{module}:{line} imports private {private} from {target}")
    assert not problems, "\n".join(problems)


# Type-only imports (under ``if TYPE_CHECKING:``) allowed to close a cycle: none (issue 25 item 5 removed the last
# five: the read path reads through ``_read/source.py``'s protocol, object-storage gc through ``ObjectPrefix``).
KNOWN_TYPE_ONLY_BACK_EDGES: set[tuple[str, str]] = set()


def test_no_import_cycles():
    """No cycle, counting type-only imports too (but the known ones above, which must stay type-only)."""
    modules = _modules()
    for module, target in KNOWN_TYPE_ONLY_BACK_EDGES:  # the list only shrinks: each is still there, and type-only
        assert target in {t for t, _, _ in _imports(module, modules[module])}, f"{module} -> {target}: remove it"
        assert target not in {t for t, _, _ in _imports(module, modules[module], type_checking=False)}, module
    graph = {module: sorted({t for t, _, _ in imports if t != module and (module, t) not in KNOWN_TYPE_ONLY_BACK_EDGES})
             for module, imports in _graph().items()}
    state: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in graph.get(node, []):
            if nxt not in modules:
                continue
            if state.get(nxt) == 1:
                cycles.append(" -> ".join([*stack[stack.index(nxt):], nxt]))
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for module in graph:
        if module not in state:
            visit(module)
    assert not cycles, "\n".join(cycles)


def test_the_graph_check_sees_what_it_should():
    """The checks above would catch a violation: the parser finds relative imports, names, layers, and the imports
    under ``if TYPE_CHECKING:`` (``_manage/policy.py`` names ``Checkpoint`` only for type checkers)."""
    imports = _imports("_read.checkpoint", _modules()["_read.checkpoint"])
    targets = {t for t, _, _ in imports}
    assert "_format.manifest" in targets and "_io.arrays" in targets
    policy = _modules()["_manage.policy"]
    assert "_read.checkpoint" in {t for t, _, _ in _imports("_manage.policy", policy)}
    assert "_read.checkpoint" not in {t for t, _, _ in _imports("_manage.policy", policy, type_checking=False)}
    assert _resolve("_read.chain", 2, "_io.arrays") == "_io.arrays"
    assert _resolve("_read.chain", 1, "checkpoint") == "_read.checkpoint"
    assert _resolve("__init__", 1, "_errors") == "_errors"
    assert LAYER_OF["_read"] > LAYER_OF["_storage"] > LAYER_OF["_format"]


def _type_checking_names() -> dict[str, str]:
    """Public name -> ``module[:attribute]`` as the TYPE_CHECKING imports of ``__init__.py`` state it."""
    tree = ast.parse((PACKAGE / "__init__.py").read_text())
    out = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            for inner in node.body:
                assert isinstance(inner, ast.ImportFrom)
                for alias in inner.names:
                    public = alias.asname or alias.name
                    module = "." * inner.level + (inner.module or "")
                    out[public] = module if alias.asname in (None, alias.name) else f"{module}:{alias.name}"
    return out


def test_public_api_is_one_table():
    lazy = arrayckpt._LAZY
    assert arrayckpt.__all__ == sorted([*lazy, "__version__"])
    assert _type_checking_names() == lazy
    for name in lazy:
        value = getattr(arrayckpt, name)
        assert value is not None
        module = lazy[name].partition(":")[0]
        assert getattr(value, "__module__", "").endswith(module.lstrip(".")) or not callable(value), name
    assert set(arrayckpt.__all__) <= set(dir(arrayckpt))
    with pytest.raises(AttributeError, match="no attribute 'nonexistent'"):
        arrayckpt.nonexistent  # noqa: B018


def test_errors_keep_their_builtin_bases():
    assert issubclass(arrayckpt.CheckpointBusyError, RuntimeError)
    assert issubclass(arrayckpt.ReplacedCheckpointError, arrayckpt.CorruptCheckpointError)
    assert issubclass(arrayckpt.CorruptCheckpointError, OSError)
    assert issubclass(arrayckpt.CheckpointNotFoundError, FileNotFoundError)
    assert issubclass(arrayckpt.KeyMismatchError, KeyError) and issubclass(arrayckpt.KeyMismatchError, ValueError)


def _docstring_lines(tree: ast.Module) -> int:
    """The lines of a module's docstrings (its own, its classes' and its functions')."""
    count = 0
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value,
                                                                                                  str):
                count += (first.end_lineno or first.lineno) - first.lineno + 1
    return count


def test_modules_are_short_or_say_why():
    """The limit is on what a module does: its docstrings, which document every public parameter with an example
    (``tests/test_docs.py``), do not count."""
    long = []
    for module, path in _modules().items():
        tree = ast.parse(path.read_text())
        lines = path.read_text().count("\n") - _docstring_lines(tree)
        docstring = ast.get_docstring(tree) or ""
        if lines > MAX_LINES and LONG_REASON not in docstring:
            long.append(f"{module}: {lines} lines besides docstrings")
    assert not long, "\n".join(long)


_NO_TORCH = """
import json, sys
sys.modules["torch"] = None  # import torch fails from here on
import arrayckpt
from arrayckpt import cli
import importlib
for name in {modules!r}:
    importlib.import_module("arrayckpt." + name)
path = sys.argv[1]
checkpoint = arrayckpt.open(path)
out = {{
    "keys": sorted(checkpoint),
    "row": checkpoint["model.w"][1].tolist(),
    "bf16": str(checkpoint["model.b"].numpy_dtype),
    "step": checkpoint.plain_values["step"],
    "verify": arrayckpt.verify(path).ok,
    "show": arrayckpt.show(path, "model.w", "0:2").max,
    "info": cli.main(["info", path]),
    "torch_loaded": sys.modules.get("torch") is not None,
}}
try:
    arrayckpt.save({{}}, path + "-again")
except arrayckpt.TorchNotInstalledError as e:  # at the call, not at import; an ImportError too
    out["save"] = [str(e), isinstance(e, ImportError)]
print(json.dumps(out))
"""


@pytest.mark.slow
def test_format_and_read_layers_need_no_torch(tmp_path):
    path = tmp_path / "ckpt"
    w = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    arrayckpt.save({"model": {"w": w, "b": torch.ones(2, dtype=torch.bfloat16)}, "step": 3}, path)
    modules = sorted(m for m in _modules() if _top(m) in TORCH_FREE and not m.endswith("__init__"))
    modules += TORCH_FREE_MODULES
    assert "_format.manifest" in modules and "_storage.local" in modules
    done = subprocess.run([sys.executable, "-c", _NO_TORCH.format(modules=modules), str(path)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result == {"keys": ["model.b", "model.w"], "row": [4.0, 5.0, 6.0, 7.0], "bf16": "bfloat16", "step": 3,
                      "verify": True, "show": 7.0, "info": 0, "torch_loaded": False,
                      "save": ["arrayckpt.save requires PyTorch: pip install 'arrayckpt[torch]'", True]}


def test_every_package_docstring_names_its_modules():
    """A newcomer reads a package's ``__init__`` first: it names every module and subpackage in it."""
    missing = []
    for init in sorted(PACKAGE.glob("*/__init__.py")):
        docstring = ast.get_docstring(ast.parse(init.read_text())) or ""
        names = [p.stem for p in init.parent.glob("*.py") if p.stem != "__init__"]
        names += [p.name for p in init.parent.iterdir() if (p / "__init__.py").is_file()]
        missing += [f"{init.parent.name}/{name}" for name in sorted(names) if name not in docstring]
    assert not missing, f"not named in their package's docstring: {missing}"


TESTS = Path(__file__).parent
SPAWNS = ("run_ranks", "torchrun", "_torchrun", "run_example", "run_group", "Popen", "subprocess.run",
          "subprocess.check_output")


def _marked_slow(decorators: list[ast.expr]) -> bool:
    return any("mark.slow" in ast.unparse(d) for d in decorators)


def test_tests_that_spawn_processes_are_marked_slow():
    """``pytest -m "not slow"`` (the quick run, README) never spawns ranks or processes: every test function whose
    body calls a spawning helper is marked ``slow``, itself or by its module's ``pytestmark`` (the S3 fixtures are
    marked by ``conftest.py``)."""
    unmarked = []
    for path in sorted(TESTS.rglob("test_*.py")):
        tree = ast.parse(path.read_text())
        module_slow = any(isinstance(n, ast.Assign) and any(getattr(t, "id", "") == "pytestmark" for t in n.targets)
                          and "mark.slow" in ast.unparse(n.value) for n in tree.body)
        for node in tree.body:
            if not isinstance(node, ast.FunctionDef) or not node.name.startswith("test_"):
                continue
            calls = {ast.unparse(c.func) for c in ast.walk(node) if isinstance(c, ast.Call)}
            if calls & set(SPAWNS) and not module_slow and not _marked_slow(node.decorator_list):
                unmarked.append(f"{path.name}::{node.name}")
    assert not unmarked, f"spawning tests not marked slow: {unmarked}"


def test_the_readme_test_command_runs_every_test_and_names_the_quick_run():
    """CI runs the README's test command: it must not leave the slow tests out; the quick run is documented."""
    text = (PACKAGE.parent / "README.md").read_text()
    command = text.split("<!-- test-command -->", 1)[1].split("```bash", 1)[1].split("```", 1)[0].strip()
    assert "pytest" in command and "slow" not in command, command
    assert '-m "not slow"' in text


README_LINES = 250  # what a newcomer reads in five minutes; the manual is the site built from docs/


def test_the_readme_stays_a_five_minute_read():
    """The README says what arrayckpt is, how to install it, the quick start and the development commands, and links
    to the manual; everything else belongs in ``docs/`` (issue 34)."""
    lines = (PACKAGE.parent / "README.md").read_text().splitlines()
    assert len(lines) <= README_LINES, f"README.md has {len(lines)} lines; move guides into docs/ (the manual)"


# Module-level constants named like tuning knobs that are facts, not knobs (limits of the format and of what a reader
# accepts, sizes of things, other libraries' defaults). Every knob lives in ``_settings.py``.
FACTS = {"MAX_LEASE_S", "MAX_SEGMENT_BYTES", "INDEX_BYTES", "FINGERPRINT_BYTES", "USER_FILE_LIMIT", "DOCUMENT_LIMIT",
         "LATEST_LIMIT", "SAFETENSORS_HEADER_LIMIT", "HF_MAX_SHARD_BYTES", "WEIGHT_BYTES", "OPTIMIZER_BYTES",
         "MASTER_BYTES", "MAX_NAME_BYTES", "MAX_CHUNK_BYTES", "MAX_PUT_BYTES", "MIN_PART_BYTES"}
KNOB_NAME = ("_BYTES", "_THREADS", "_CONCURRENCY", "_RETRIES", "_S", "_LIMIT", "_SECONDS", "_NICE")


def test_tuning_knobs_live_in_the_settings_module():
    """One place for settings: a new module-level constant named like a knob (``*_BYTES``, ``*_THREADS``, ...) goes
    into ``_settings.py`` (overridable by ``ARRAYCKPT_<NAME>``), unless it is a fact listed in :data:`FACTS`; and only
    ``_settings.py`` reads arrayckpt's environment variables (the zarr hook's switch aside)."""
    found = []
    for module, path in _modules().items():
        if module == "_settings":
            continue
        text = path.read_text()
        for node in ast.parse(text).body:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] \
                if isinstance(node, ast.AnnAssign) else []
            for target in targets:
                name = getattr(target, "id", "")
                if name.isupper() and name.lstrip("_").endswith(KNOB_NAME) and name not in FACTS:
                    found.append(f"{module}.{name}")
        if '"ARRAYCKPT_' in text.replace('"ARRAYCKPT_NO_ZARR_HOOK"', ""):
            found.append(f"{module}: reads an ARRAYCKPT_ variable")
    assert not found, f"tuning knobs outside arrayckpt/_settings.py: {found}"


# What users do with an opened checkpoint. Its plumbing (storage handles, node metadata, specs, the checks of a
# read) is on ``_read/stored.py::StoredCheckpoint``, which the package reaches through ``stored_of(checkpoint)``.
CHECKPOINT_MEMBERS = {
    # Mapping[str, LazyArray]
    "get", "items", "keys", "values",
    # closing
    "close", "closed",
    # what it is and what it holds
    "location", "manifest", "step", "metrics", "plain_values", "aliases", "per_rank", "nbytes",
    # a delta checkpoint's chain of bases
    "base", "chain",
}


def test_the_public_checkpoint_keeps_only_user_facing_members(tmp_path):
    """A new public member of ``arrayckpt.Checkpoint`` is a decision: add it here, or put it on StoredCheckpoint."""
    assert {name for name in dir(arrayckpt.Checkpoint) if not name.startswith("_")} == CHECKPOINT_MEMBERS
    arrayckpt.save({"w": torch.ones(2), "step": 1}, tmp_path / "ckpt")
    with arrayckpt.open(tmp_path / "ckpt") as ckpt:
        ckpt.plain_values  # noqa: B018 - cached on the instance: still a member of the set
        assert {name for name in vars(ckpt) if not name.startswith("_")} <= CHECKPOINT_MEMBERS
        assert {name for name in dir(ckpt) if not name.startswith("_")} == CHECKPOINT_MEMBERS


MAX_ANY_SHARE = 0.06  # of the annotations below; 4.1% when this test came (7.6% before the types were written)


def _annotations(tree: ast.AST) -> list[ast.expr]:
    """Every parameter, return and annotated-assignment annotation of a module."""
    out: list[ast.expr] = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            a = node.args
            out += [arg.annotation for arg in (*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg)
                    if arg is not None and arg.annotation is not None]
            out += [node.returns] if node.returns is not None else []
        elif isinstance(node, ast.AnnAssign):
            out.append(node.annotation)
    return out


def test_any_is_kept_for_what_is_truly_any():
    """``Any`` is for what really is anything (a user's state values, keyword arguments forwarded to another
    library, storage options passed to fsspec/TensorStore); a JSON document is ``_format.jsontypes.JSON``, a
    process group a ``ProcessGroup``. A share over the limit means new code reached for ``Any`` where the type is
    known: the message names the files with the most."""
    total, per_module = 0, {}
    for module, path in _modules().items():
        annotations = _annotations(ast.parse(path.read_text()))
        total += len(annotations)
        per_module[module] = sum("Any" in ast.unparse(a) for a in annotations)
    share = sum(per_module.values()) / total
    top = sorted(per_module.items(), key=lambda item: -item[1])[:10]
    assert share <= MAX_ANY_SHARE, (f"{share:.1%} of {total} annotations mention Any (at most {MAX_ANY_SHARE:.0%}); "
                                    "most in: " + ", ".join(f"{m} ({n})" for m, n in top))
