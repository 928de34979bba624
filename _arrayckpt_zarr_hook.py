"""Start-up hook: zarr-python reads arrayckpt's bfloat16/float8 arrays without anyone importing arrayckpt.

zarr-python 3.1 collects the ``zarr.data_type`` entry points that ``pyproject.toml`` declares but never
loads them, so a fresh interpreter that only uses zarr fails with ``No Zarr data type found that
matches 'bfloat16'``. The ``arrayckpt-zarr-dtypes.pth`` file installed next to this module calls
:func:`install` at interpreter start-up, which only puts one tiny finder at the front of
``sys.meta_path``: nothing is imported then (no zarr, numpy, torch or arrayckpt). When the ``zarr``
package has finished importing, the finder registers arrayckpt's data types (importing
``arrayckpt._zarr_dtypes``, which imports numpy, ml_dtypes and zarr's dtype module, never torch) and
removes itself.

The trigger is the top-level ``zarr`` package rather than ``zarr.core.dtype`` (which holds
``data_type_registry``): Python imports a package before any of its submodules, and ``zarr/__init__``
imports ``zarr.core.dtype`` itself, so ``zarr.core.dtype`` finishes while ``zarr`` is still half
initialised, whereas once ``zarr`` has finished everything ``arrayckpt._zarr_dtypes`` needs is
complete, and no reader can reach an array before that.

Only arrayckpt's own types are registered (``arrayckpt._zarr_dtypes.register()``), not
``data_type_registry._lazy_load()``, which would import every installed package's entry points (and
abort at the first broken one) and is private. Registering is idempotent, so a later zarr that loads
the entry points itself registers the same classes again, harmlessly.

The hook never breaks an import: a failure to register is reported as a ``RuntimeWarning`` (if even
that fails it is dropped) and zarr's import goes on. Set ``ARRAYCKPT_NO_ZARR_HOOK=1`` to disable it.
This module is top-level and imports only ``sys`` and ``os`` (both already loaded at start-up) so that
the ``.pth`` line stays negligible.
"""

import os
import sys

TYPE_CHECKING = False  # (typing.TYPE_CHECKING, without importing typing at start-up)
if TYPE_CHECKING:
    from collections.abc import Sequence
    from importlib.machinery import ModuleSpec
    from types import ModuleType

TRIGGER = "zarr"
"""The module whose completed import registers the types."""

TARGET = "arrayckpt._zarr_dtypes"
"""The module that defines the types (importing it registers them) and holds ``register()``."""

DISABLE_ENV = "ARRAYCKPT_NO_ZARR_HOOK"
"""Environment variable: when set to anything but ``""``/``"0"``, :func:`install` does nothing."""


def register() -> None:
    """Register arrayckpt's data types with zarr-python now; report a failure as a warning, never raise."""
    try:
        module = sys.modules.get(TARGET)
        if module is None:
            import importlib

            module = importlib.import_module(TARGET)  # registers the types as a side effect
        # A module without ``register`` yet is being imported right now (it imported zarr itself, in
        # this thread or another): it registers everything when it finishes, so there is nothing to do.
        register_types = getattr(module, "register", None)
        if register_types is not None:
            register_types()  # idempotent
    except Exception as exc:  # noqa: BLE001 - never let a failure escape into someone's `import zarr`
        try:
            import warnings

            warnings.warn(
                f"arrayckpt could not register its bfloat16/float8 data types with zarr-python "
                f"({type(exc).__name__}: {exc}); zarr cannot read such arrays until `import arrayckpt` "
                f"succeeds",
                RuntimeWarning,
                stacklevel=2,
            )
        except Exception:  # noqa: BLE001 - e.g. `-W error`: dropping the warning beats breaking the import
            pass


class _RegisteringLoader:
    """Stands in for zarr's own loader for one import: runs it, then :func:`register`.

    The module gets its real loader back (``__loader__``, ``__spec__.loader``) before its code runs, so
    nothing that inspects the module, during or after the import, ever sees this proxy.
    """

    def __init__(self, loader: object) -> None:
        self.loader = loader

    def create_module(self, spec: object) -> object:
        create_module = getattr(self.loader, "create_module", None)
        return None if create_module is None else create_module(spec)

    def exec_module(self, module: object) -> None:
        loader = self.loader
        if getattr(module, "__loader__", None) is self:
            module.__loader__ = loader  # type: ignore[attr-defined]
        spec = getattr(module, "__spec__", None)
        if spec is not None and spec.loader is self:
            spec.loader = loader
        loader.exec_module(module)  # type: ignore[attr-defined]  # an error here fails zarr's import as usual
        uninstall()  # one-shot, and only after a successful import (a failed one may be retried)
        register()

    def __getattr__(self, name: str) -> object:
        if name == "loader":  # not set yet (copy, pickle): no recursion
            raise AttributeError(name)
        return getattr(self.loader, name)


class _ZarrImportFinder:
    """A ``sys.meta_path`` finder that only ever answers for ``zarr``, by wrapping the real spec's loader."""

    def find_spec(self, fullname: str, path: "Sequence[str] | None" = None,
                  target: "ModuleType | None" = None) -> "ModuleSpec | None":
        if fullname != TRIGGER:
            return None  # the only work done for every other import: one string comparison
        try:
            for finder in list(sys.meta_path):
                if finder is self:
                    continue
                find_spec = getattr(finder, "find_spec", None)
                if find_spec is None:
                    return None  # a legacy finder: let the import system ask it (unhooked, but correct)
                spec = find_spec(fullname, path, target)
                if spec is None:
                    continue
                if spec.loader is None or not hasattr(spec.loader, "exec_module"):
                    return None  # not a normal package: leave it alone
                spec.loader = _RegisteringLoader(spec.loader)
                return spec
        except Exception:  # noqa: BLE001 - fall back to the import system's own search
            return None
        return None

    def __repr__(self) -> str:
        return f"<{__name__}._ZarrImportFinder: registers arrayckpt's zarr data types once zarr is imported>"


_FINDER = _ZarrImportFinder()


def install() -> None:
    """Arm the hook (idempotent); called by ``arrayckpt-zarr-dtypes.pth`` at interpreter start-up.

    If zarr is already imported, registers right away instead.
    """
    if os.environ.get(DISABLE_ENV, "") not in ("", "0"):
        return
    if TRIGGER in sys.modules:
        register()
    elif not installed():
        sys.meta_path.insert(0, _FINDER)


def uninstall() -> None:
    """Remove the finder from ``sys.meta_path`` (it removes itself after zarr's first import)."""
    if installed():
        sys.meta_path[:] = [finder for finder in sys.meta_path if finder is not _FINDER]  # in place


def installed() -> bool:
    """Whether the finder is waiting in ``sys.meta_path`` for zarr's import."""
    return any(finder is _FINDER for finder in sys.meta_path)
