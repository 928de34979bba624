"""Every command of ``arrayckpt`` on a corpus of bad inputs: one line on stderr, exit status 1 or 2, no traceback,
no file created (and no code run from a pickle)."""

from __future__ import annotations

import json
import os
import re
import struct
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

import arrayckpt  # noqa: E402
from arrayckpt.cli import main  # noqa: E402

PWNED = "pwned-marker"


class _Evil:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _lying_safetensors(path: Path, offsets: list[int], size: int = 16) -> None:
    header = json.dumps({"w": {"dtype": "F32", "shape": [1000, 1000], "data_offsets": offsets}}).encode()
    path.write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * size)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    import torch.distributed.checkpoint as dcp

    root = tmp_path_factory.mktemp("corpus")
    paths = {name: root / name for name in ("missing", "random.bin", "empty", "dcp", "manager", "lying.safetensors",
                                            "overlap.safetensors", "huge_header.safetensors", "evil.pt",
                                            "garbage.pt", "good")}
    paths["random.bin"].write_bytes(os.urandom(4096))
    paths["empty"].mkdir()
    with pytest.warns(UserWarning):
        dcp.save({"w": torch.ones(4, 4), "b": torch.zeros(3)}, checkpoint_id=paths["dcp"], no_dist=True)
    manager = arrayckpt.CheckpointManager(paths["manager"])
    for step in (1, 2):
        manager.save(step, {"w": torch.full((2, 2), float(step)), "step": step})
    manager.close()
    _lying_safetensors(paths["lying.safetensors"], [0, 4_000_000])
    header = json.dumps({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                         "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}).encode()
    paths["overlap.safetensors"].write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 12)
    paths["huge_header.safetensors"].write_bytes(struct.pack("<Q", 2**62) + b"{}")
    torch.save({"x": _Evil(str(root / PWNED))}, paths["evil.pt"])
    paths["garbage.pt"].write_bytes(b"\x80" + os.urandom(3000))
    arrayckpt.save({"w": torch.arange(8.0)}, paths["good"])
    return paths


BAD = ["missing", "random.bin", "empty", "dcp", "manager", "lying.safetensors", "overlap.safetensors",
       "huge_header.safetensors", "evil.pt", "garbage.pt"]
COMMANDS = [
    ["info", "{bad}"], ["info", "{bad}", "--json"], ["info", "{bad}", "--tree"], ["verify", "{bad}"],
    ["verify", "{bad}", "--json"], ["show", "{bad}", "w"], ["show", "{bad}", "w", "0:2"], ["diff", "{bad}", "{good}"],
    ["diff", "{good}", "{bad}"], ["compact", "{bad}", "{out}"], ["convert", "{bad}", "{out}"],
    ["convert", "{bad}", "{out}.safetensors"], ["convert", "{bad}", "{out}.pt"],
    ["convert", "{bad}", "{out}", "--to", "dcp"], ["convert", "{bad}", "{out}", "--to", "hf"],
    ["convert", "{bad}", "{out}", "--to", "megatron"],
]


def _listing(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


def _check(capsys: pytest.CaptureFixture[str], code: int, root: Path, before: set[str]) -> None:
    err = capsys.readouterr().err
    assert code in (1, 2), err
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("arrayckpt: error: "), err
    assert _listing(root) == before, "a file was created or removed"
    assert not (root / PWNED).exists()


@pytest.mark.parametrize(("command", "bad"), [(c, b) for c in COMMANDS for b in BAD
                                              if not (c[0] == "convert" and b == "dcp")],  # a valid source
                         ids=lambda v: " ".join(v) if isinstance(v, list) else v)
def test_every_command_on_bad_input(corpus: dict[str, Path], capsys: pytest.CaptureFixture[str], bad: str,
                                    command: list[str]) -> None:
    root = corpus["good"].parent
    before = _listing(root)
    fill = {"bad": str(corpus[bad]), "good": str(corpus["good"]), "out": str(root / "out")}
    code = main([part.format(**fill) for part in command])
    if command[0] == "verify" and code == 1:  # damage found: a report on stdout, not an error
        capsys.readouterr()
        assert _listing(root) == before
        return
    _check(capsys, code, root, before)


@pytest.mark.parametrize("bad", BAD)
def test_gc_on_bad_input(corpus: dict[str, Path], capsys: pytest.CaptureFixture[str], bad: str) -> None:
    root = corpus["good"].parent
    before = _listing(root)
    code = main(["gc", str(corpus[bad]), "--dry-run"])
    if code == 0:  # a directory with nothing to remove
        assert "Traceback" not in capsys.readouterr().err
        assert _listing(root) == before
    else:
        _check(capsys, code, root, before)


@pytest.mark.parametrize(("what", "said"), [("dcp", "PyTorch DCP checkpoint"), ("manager", "step-00000002"),
                                            ("evil.pt", "torch.save file")])
@pytest.mark.parametrize("command", ["info", "verify"])
def test_says_what_a_path_is(corpus: dict[str, Path], capsys: pytest.CaptureFixture[str], what: str, said: str,
                             command: str) -> None:
    assert main([command, str(corpus[what])]) == 2
    err = capsys.readouterr().err
    assert said in err and "incomplete" not in err


def test_convert_of_a_manager_root_lists_its_steps(corpus: dict[str, Path], capsys: pytest.CaptureFixture[str]):
    out = corpus["good"].parent / "from-manager.safetensors"
    assert main(["convert", str(corpus["manager"]), str(out)]) == 2
    err = capsys.readouterr().err
    assert "a directory of 2 checkpoint(s)" in err and "convert one of them" in err and "step-00000001" in err
    assert not out.exists()


def test_malicious_pickle_is_refused_without_running(corpus: dict[str, Path], capsys: pytest.CaptureFixture[str]):
    root = corpus["good"].parent
    assert main(["convert", str(corpus["evil.pt"]), str(root / "out")]) == 2
    err = capsys.readouterr().err
    assert "posix.system" in err or "os.system" in err or "nt.system" in err
    assert "weights_only" in err and "\n" not in err.strip()
    assert not (root / PWNED).exists()


def test_existing_target_says_the_flag(corpus: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    target = corpus["good"].parent / "existing.safetensors"
    target.write_bytes(b"x")
    try:
        assert main(["convert", str(corpus["good"]), str(target)]) == 2
        err = capsys.readouterr().err
        assert "--overwrite" in err and "overwrite=True" not in err
    finally:
        target.unlink()


def _run(*args: str, **kwargs) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "arrayckpt.cli", *args], capture_output=True, text=True,
                          timeout=120, **kwargs)


@pytest.mark.slow
@pytest.mark.parametrize(("bad", "command"), [("missing", "info"), ("dcp", "verify"), ("evil.pt", "convert"),
                                              ("lying.safetensors", "convert")])
def test_as_a_process(corpus: dict[str, Path], bad: str, command: str) -> None:
    args = [command, str(corpus[bad])] + ([str(corpus["good"].parent / "out")] if command == "convert" else [])
    result = _run(*args)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1


@pytest.mark.slow
def test_closed_pipe_ends_quietly(tmp_path: Path) -> None:
    arrayckpt.save({"w": torch.ones(2), "text": "x" * 400_000}, tmp_path / "big")
    process = subprocess.Popen([sys.executable, "-m", "arrayckpt.cli", "info", str(tmp_path / "big"), "--json"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert process.stdout is not None and process.stderr is not None
    process.stdout.read(10)
    process.stdout.close()  # `| head -c 10`
    err = process.stderr.read().decode()
    assert process.wait(timeout=120) == 141
    assert err == ""


# --- issue 5, items 1 and 6: text from a checkpoint never acts on the terminal --------------------------------------

RAW_CONTROL = re.compile("[\x00-\x09\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028\u2029\u202a-\u202e\u2066-\u2069]")
HOSTILE = "\x1b[2J\r\x07\u202e"


@pytest.fixture(scope="module")
def hostile_pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("hostile-text")
    arrayckpt.save({f"w{HOSTILE}": torch.ones(2), "note": f"a{HOSTILE}b", f"k{HOSTILE}\nx": 3}, root / "a")
    arrayckpt.save({f"w{HOSTILE}": torch.zeros(2), "note": "plain", f"k{HOSTILE}\nx": 4}, root / "b")
    return root / "a", root / "b"


@pytest.mark.parametrize("command", [["info", "{a}"], ["info", "{a}", "--tree"], ["info", "{a}", "--json"],
                                     ["show", "{a}", "note"], ["show", "{a}", f"w{HOSTILE}"],
                                     ["show", "{a}", f"k{HOSTILE}\nx"], ["diff", "{a}", "{b}"],
                                     ["diff", "{a}", "{b}", "--json"]], ids=lambda c: " ".join(c[:1] + c[2:3]))
def test_control_characters_from_a_checkpoint_are_printed_escaped(hostile_pair: tuple[Path, Path], command: list[str],
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    a, b = hostile_pair
    main([part.format(a=a, b=b) for part in command])
    out, err = capsys.readouterr()
    assert not RAW_CONTROL.search(out + err), repr(out + err)
    if "--json" not in command:
        assert "\\x1b[2J\\r\\x07\\u202e" in out and "\nx" not in out, out  # shown, escaped, and on its key's line


def test_an_error_quoting_a_path_with_a_newline_is_one_escaped_line(tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / f"new\nline{HOSTILE}"
    assert main(["info", str(missing)]) == 2
    err = capsys.readouterr().err
    assert not RAW_CONTROL.search(err) and len(err.strip().splitlines()) == 1, repr(err)
    assert "new\\nline\\x1b[2J" in err, err


@pytest.mark.parametrize("command", [["info", "{p}"], ["show", "{p}", "w"], ["convert", "{p}", "{p}.safetensors"],
                                     ["convert", "{p}", "{p}-megatron", "--to", "megatron"]],
                         ids=lambda c: " ".join(c[:1] + c[3:]))
def test_errors_name_a_checkpoint_whose_name_has_a_newline(tmp_path: Path, command: list[str],
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "new\nline"
    arrayckpt.save({"w": torch.ones(2)}, path)
    (path / "zarr.json").write_text("{damaged")
    assert main([part.format(p=path) for part in command]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"arrayckpt: error: {tmp_path}/new\\nline: "), repr(err)
    with pytest.raises(arrayckpt.CorruptCheckpointError, match=r"new\nline: root zarr.json is damaged"):
        arrayckpt.load({"w": torch.zeros(2)}, path)


def test_verify_names_a_checkpoint_whose_name_has_a_newline(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    path = tmp_path / "new\nline"
    arrayckpt.save({"w": torch.ones(2)}, path)
    (path / "w" / "c.0").write_bytes(b"xx")
    assert main(["verify", str(path)]) == 1
    out = capsys.readouterr().out
    assert len(out.splitlines()) == 2 and f"DAMAGED {tmp_path}/new\\nline: 1 problem(s)" in out, out


# --- issue 5, item 3: a file the user names is read only when it is a small regular file ----------------------------


@pytest.fixture
def not_small_files(tmp_path: Path) -> dict[str, Path]:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    huge = tmp_path / "huge.json"
    with open(huge, "wb") as f:
        f.truncate(65 << 20)  # sparse: 65 MiB claimed, nothing stored
    return {"device": Path("/dev/zero"), "fifo": fifo, "huge": huge}


@pytest.mark.parametrize(("what", "said"), [("device", "is a device, not a regular file"),
                                            ("fifo", "is a pipe (FIFO), not a regular file"),
                                            ("huge", "holds 68,157,440 bytes, more than the 67,108,864")])
@pytest.mark.parametrize(("option", "to", "holds"), [("--config", "hf", "a config.json"),
                                                     ("--param-names", "deepspeed", "the parameter names")])
def test_a_named_file_must_be_small_and_regular(corpus: dict[str, Path], not_small_files: dict[str, Path],
                                                capsys: pytest.CaptureFixture[str], what: str, said: str, option: str,
                                                to: str, holds: str) -> None:
    out = not_small_files["fifo"].parent / "out"
    named = not_small_files[what]
    assert main(["convert", str(corpus["good"]), str(out), "--to", to, option, str(named)]) == 2
    err = capsys.readouterr().err
    assert err == f"arrayckpt: error: {named}: {said}{err.split(said)[1]}" and holds in err, err
    assert err.count("\n") == 1 and not out.exists()


def test_the_python_api_checks_the_config_file_too(corpus: dict[str, Path], tmp_path: Path) -> None:
    with pytest.raises(arrayckpt.FormatError, match=r"^/dev/zero: is a device, not a regular file; name the file"):
        arrayckpt.convert(corpus["good"], tmp_path / "hf", to_format="hf", config="/dev/zero")
    assert not (tmp_path / "hf").exists()
