"""Build hooks: install ``arrayckpt-zarr-dtypes.pth`` into site-packages, from wheels and editable installs.

The project's metadata is all in ``pyproject.toml``; this file only adds two commands. The ``.pth``
file arms ``_arrayckpt_zarr_hook`` at interpreter start-up, so that zarr-python reads arrayckpt's
bfloat16/float8 arrays without anyone importing arrayckpt (see that module). setuptools installs no
``.pth`` file by itself:

- ``build_py`` copies it into ``build_lib``, whose files are the root of a regular wheel, so
  installing the wheel puts it into site-packages.
- An editable wheel (PEP 660) holds no ``build_lib`` files (only the finder, or path, ``.pth`` that
  setuptools generates), so ``editable_wheel`` adds it to the wheel it built, RECORD included. Its name
  sorts after setuptools' ``__editable__.*.pth``, which ``site`` processes (in sorted order) first, so
  the editable finder that serves ``_arrayckpt_zarr_hook`` from the source tree is already in place.
"""

from __future__ import annotations

import base64
import hashlib
import zipfile
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py as _build_py
from setuptools.command.editable_wheel import editable_wheel as _editable_wheel

PTH = "arrayckpt-zarr-dtypes.pth"
HERE = Path(__file__).resolve().parent


class build_py(_build_py):  # noqa: N801 - the name of the command it replaces
    """``build_py`` that also puts the ``.pth`` file into ``build_lib`` (the root of the wheel)."""

    def run(self) -> None:
        super().run()
        if not getattr(self, "editable_mode", False):
            self.copy_file(str(HERE / PTH), str(Path(self.build_lib, PTH)), preserve_mode=False)

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        outputs = list(super().get_outputs(include_bytecode))
        if not getattr(self, "editable_mode", False):
            outputs.append(str(Path(self.build_lib, PTH)))
        return outputs


class editable_wheel(_editable_wheel):  # noqa: N801 - the name of the command it replaces
    """``editable_wheel`` that adds the ``.pth`` file to the editable wheel it built."""

    def run(self) -> None:
        before = _wheels(self.dist_dir)
        super().run()
        built = [path for path, stamp in _wheels(self.dist_dir).items() if before.get(path) != stamp]
        if len(built) != 1:
            raise RuntimeError(f"setup.py: expected 1 new editable wheel in {self.dist_dir}, found {built}")
        _add_to_wheel(built[0], PTH, (HERE / PTH).read_bytes())


def _wheels(directory: str | Path) -> dict[Path, tuple[int, int]]:
    """The wheels in ``directory``, each with its (modification time, size)."""
    return {p: (p.stat().st_mtime_ns, p.stat().st_size) for p in Path(directory).glob("*.whl")}


def _add_to_wheel(wheel: Path, name: str, data: bytes) -> None:
    """Rewrite ``wheel`` with the file ``name`` (``data``) added at its root and listed in its RECORD."""
    with zipfile.ZipFile(wheel) as zin:
        entries = [(info, zin.read(info)) for info in zin.infolist() if info.filename != name]
    records = [info.filename for info, _ in entries if info.filename.endswith(".dist-info/RECORD")]
    if len(records) != 1:
        raise RuntimeError(f"setup.py: {wheel.name} has {len(records)} RECORD files, expected 1")
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    line = f"{name},sha256={digest},{len(data)}"
    tmp = wheel.with_name(wheel.name + ".tmp")
    with zipfile.ZipFile(tmp, "w", compression=zipfile.ZIP_DEFLATED) as zout:
        zout.writestr(_member(name, (1980, 1, 1, 0, 0, 0), 0o644 << 16), data)
        for info, content in entries:
            if info.filename == records[0]:
                kept = [r for r in content.decode().splitlines() if r and not r.startswith(f"{name},")]
                content = "\n".join([*kept, line, ""]).encode()
            zout.writestr(_member(info.filename, info.date_time, info.external_attr), content)
    tmp.replace(wheel)


def _member(name: str, date_time: tuple[int, ...], external_attr: int) -> zipfile.ZipInfo:
    """A fresh, deflated zip member."""
    info = zipfile.ZipInfo(name, date_time=date_time)
    info.external_attr = external_attr
    info.compress_type = zipfile.ZIP_DEFLATED
    return info


setup(cmdclass={"build_py": build_py, "editable_wheel": editable_wheel})
