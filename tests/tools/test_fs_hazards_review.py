"""prune's output on awkward file systems: an existing empty --out folder (private, a mount point, in a
folder the user cannot write), a Hugging Face cache snapshot (relative symbolic links), a full disk or a
signal while the output is written, ONNX / OpenVINO copies of the dense model, and --out names near the
file system's 255-byte limit."""
import errno
import io
import os
import resource
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from torch import nn
from transformers import LlamaForCausalLM

import sparse24
from hf_models import tiny_llama
from sparse24.nn import Sparse24Linear
from test_cli import assert_one_line_error, run as _run


def run(capsys, *argv):
    capsys.readouterr()   # (save_pretrained's progress bar)
    return _run(capsys, *argv)


def _topk_mask(w):
    """Independent 2:4 magnitude mask: the two largest |w| of each group of 4 (no ties in randn)."""
    g = w.abs().reshape(-1, 4)
    return torch.zeros_like(g, dtype=torch.bool).scatter_(1, g.topk(2, dim=1).indices, True).view(w.shape)


def _dense_folder(path: Path) -> LlamaForCausalLM:
    model = tiny_llama()
    model.save_pretrained(path)
    return model


def _assert_pruned(out: Path, dense: LlamaForCausalLM) -> None:
    """``out`` (a folder, or a state dict file) loads, and every pruned layer holds the float64 2:4-masked
    dense weight."""
    ref = {n: m.weight.detach().double().clone() for n, m in dense.named_modules() if isinstance(m, nn.Linear)}
    if out.is_dir():
        loaded = sparse24.from_pretrained(LlamaForCausalLM, out)
    else:
        loaded = tiny_llama(seed=1)
        sparse24.sparsify_(loaded, mode="compressed")
        loaded.load_state_dict(torch.load(out, weights_only=True))   # strict
    layers = {n: m for n, m in loaded.named_modules() if isinstance(m, Sparse24Linear)}
    assert len(layers) == 14   # 7 per decoder block; the head stays dense
    for n, m in layers.items():
        assert torch.equal(m.dense_weight().double(), ref[n] * _topk_mask(ref[n])), n


def _listing(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


# --- 1. an existing empty --out folder is filled in place ---------------------------------------------

def test_an_empty_out_folder_is_filled_in_place_keeping_its_permissions(capsys, tmp_path):
    """It was removed and replaced by the folder built beside it: a private 0700 folder came back 0755 (a
    new inode, owner and ACLs lost). Nothing is written beside it now (its parent is left untouched)."""
    dense = _dense_folder(tmp_path / "dense")
    out = tmp_path / "private"
    out.mkdir()
    os.chmod(out, 0o700)
    before, parent = out.stat(), tmp_path.stat()
    rc, _, err = run(capsys, "prune", str(tmp_path / "dense"), "--out", str(out), "--no-progress")
    assert rc == 0, err
    after = out.stat()
    assert (after.st_ino, stat.S_IMODE(after.st_mode)) == (before.st_ino, 0o700)
    assert tmp_path.stat().st_mtime_ns == parent.st_mtime_ns   # no temporary entry made and removed there
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "generation_config.json", "model.safetensors"]
    _assert_pruned(out, dense)


def test_a_failure_at_the_end_leaves_the_empty_out_folder_as_it_was(capsys, tmp_path, monkeypatch):
    """All or nothing: a move that fails part way (config.json, moved last) takes back those done."""
    _dense_folder(tmp_path / "dense")
    out = tmp_path / "out"
    out.mkdir()
    os.chmod(out, 0o700)
    real = os.replace

    def failing(a, b):
        if Path(b) == out or Path(b).name == "config.json":
            raise OSError(errno.ENOSPC, "No space left on device", str(b))
        return real(a, b)
    monkeypatch.setattr(os, "replace", failing)
    rc, _, err = run(capsys, "prune", str(tmp_path / "dense"), "--out", str(out), "--no-progress")
    assert rc == 2
    assert_one_line_error(err, f"--out {out}: cannot write it (No space left on device)")
    assert out.is_dir() and not any(out.iterdir()) and stat.S_IMODE(out.stat().st_mode) == 0o700
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dense", "out"]


@pytest.mark.skipif(os.name != "posix" or os.geteuid() != 0 or not shutil.which("mount"),
                    reason="mounting a tmpfs needs root")
def test_an_empty_mount_point_as_out(capsys, tmp_path):
    """A docker volume or a PVC: the work was done on the parent's file system, then removing the
    mount point failed ("Device or resource busy"), after all the work."""
    dense = _dense_folder(tmp_path / "dense")
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mnt)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here")
    try:
        rc, _, err = run(capsys, "prune", str(tmp_path / "dense"), "--out", str(mnt), "--no-progress")
        assert rc == 0, err
        assert os.path.ismount(mnt)
        _assert_pruned(mnt, dense)
    finally:
        subprocess.run(["umount", str(mnt)])


@pytest.mark.skipif(os.name != "posix" or os.geteuid() != 0 or not shutil.which("setpriv"),
                    reason="needs root to run the check as another user (setpriv)")
def test_an_empty_out_folder_the_user_owns_in_a_folder_they_cannot_write():
    """A folder an admin made for the user: refused up front, since the check probed its parent."""
    probe = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable, "-c",
                            "import sparse24"], capture_output=True, text=True, cwd="/")
    if probe.returncode:   # e.g. a pyenv Python under /root, whose libpython another user cannot read
        pytest.skip(f"this Python cannot run as another user here: {probe.stderr.strip()[-200:]}")
    root = Path(tempfile.mkdtemp(prefix="s24-perm-"))
    try:
        os.chmod(root, 0o755)
        mine = root / "mine"
        mine.mkdir()
        os.chown(mine, 65534, 65534)
        code = ("import sys; from pathlib import Path; from sparse24.tools.cli_common import CLIError, "
                "check_out_writable\nfor out in sys.argv[1:]:\n    try:\n        check_out_writable(Path(out)); "
                "print('ok')\n    except CLIError as e:\n        print(e)")
        r = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable, "-c", code,
                            str(mine), str(root / "new")],
                           capture_output=True, text=True, env={**os.environ, "HOME": str(root)}, cwd=root)
        lines = r.stdout.splitlines()
        assert len(lines) == 2 and lines[0] == "ok", r.stdout + r.stderr
        assert "cannot write in" in lines[1], r.stdout   # a new folder there is still refused
    finally:
        shutil.rmtree(root)


# --- 2. a Hugging Face cache snapshot ------------------------------------------------------------------

@pytest.mark.parametrize("sub", ["", "text_encoder_2"])
def test_a_cache_snapshots_relative_links_are_copied_as_files(capsys, tmp_path, sub):
    """huggingface_hub's cache: snapshots/REV/NAME are relative links into ../../blobs. A subfolder's
    links were copied as links, dangling in --out (sentence-transformers' 1_Pooling/config.json). A model
    in a subfolder of the snapshot (diffusers' text_encoder_2/) lost every file but its weights and config
    once links out of the folder were left out: its blobs are the snapshot's."""
    plain = tmp_path / "plain"
    dense = _dense_folder(plain)
    (plain / "1_Pooling").mkdir()
    pooling = '{"word_embedding_dimension": 64, "pooling_mode_mean_tokens": true}'
    (plain / "1_Pooling" / "config.json").write_text(pooling)
    blobs, snap = tmp_path / "repo" / "blobs", tmp_path / "repo" / "snapshots" / "abc"
    blobs.mkdir(parents=True)
    for i, f in enumerate(p for p in sorted(plain.rglob("*")) if p.is_file()):
        shutil.copy(f, blobs / f"b{i}")
        link = snap / sub / f.relative_to(plain)
        link.parent.mkdir(parents=True, exist_ok=True)
        os.symlink(os.path.relpath(blobs / f"b{i}", link.parent), link)
    out = tmp_path / "out"
    rc, printed, err = run(capsys, "prune", str(snap / sub), "--out", str(out), "--no-progress")
    assert rc == 0, err
    assert "links out of the folder" not in printed
    assert sorted(p.relative_to(out) for p in out.rglob("*")) == sorted(p.relative_to(plain) for p in plain.rglob("*"))
    copied = out / "1_Pooling" / "config.json"
    assert not copied.is_symlink() and copied.read_text() == pooling
    assert not any(p.is_symlink() for p in out.rglob("*"))
    _assert_pruned(out, dense)


# --- 3. a failed write or a signal while the output is written --------------------------------------------

@pytest.mark.parametrize("kind", ["pt", "safetensors", "folder"])
def test_a_full_disk_is_one_line_naming_out(capsys, tmp_path, kind):
    """torch.save raises a RuntimeError ("unexpected pos") for the failed write, safetensors a
    SafetensorError: a traceback and exit 1, not the documented one line naming --out (exit 2)."""
    from safetensors.torch import save_file
    dense = tiny_llama()
    if kind == "folder":
        dense.save_pretrained(tmp_path / "dense")
        src, out = tmp_path / "dense", tmp_path / "o"
    else:
        src = tmp_path / "dense.safetensors"
        save_file(dense.state_dict(), src)
        out = tmp_path / f"o.{kind}"
    before = _listing(tmp_path)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    old = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (60000, hard))   # as a full disk: write() fails (EFBIG)
    try:
        rc, _, err = run(capsys, "prune", str(src), "--out", str(out), "--no-progress")
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, old)
    assert rc == 2, err
    assert_one_line_error(err, f"--out {out}: cannot write it (File too large)")
    assert _listing(tmp_path) == before


class _Signalling(io.FileIO):
    """A file whose third write is interrupted (``action`` runs first)."""
    action = None

    def __init__(self, *a):
        super().__init__(*a)
        self.calls = 0

    def write(self, b):
        self.calls += 1
        if self.calls == 3:
            type(self).action()
        return super().write(b)


def _interrupt():
    raise KeyboardInterrupt


@pytest.mark.parametrize("action, code", [(lambda: os.kill(os.getpid(), signal.SIGTERM), 143), (_interrupt, 130)],
                         ids=["SIGTERM", "Ctrl-C"])
def test_a_signal_while_torch_save_writes_exits_as_documented(capsys, tmp_path, monkeypatch, action, code):
    """torch.save wraps the exception raised by a signal inside its write in a RuntimeError: a
    traceback and exit 1, not 143 after SIGTERM / 130 after Ctrl-C; the temporary file is removed."""
    from sparse24.tools import prune
    torch.save(tiny_llama().state_dict(), tmp_path / "dense.pt")
    before = _listing(tmp_path)
    monkeypatch.setattr(_Signalling, "action", staticmethod(action))
    monkeypatch.setattr(prune, "open", lambda p, mode="r", *a, **k: _Signalling(p, mode) if mode == "wb"
                        else open(p, mode, *a, **k), raising=False)
    previous = signal.signal(signal.SIGTERM, signal.SIG_DFL)   # (as in a plain `python -m sparse24`)
    try:
        rc, _, err = run(capsys, "prune", str(tmp_path / "dense.pt"), "--out", str(tmp_path / "o.pt"),
                         "--no-progress")
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert rc == code, err
    assert "Traceback" not in err and err.strip().endswith(("terminated", "interrupted")), err
    assert _listing(tmp_path) == before


# --- 4. ONNX and OpenVINO copies of the dense model ----------------------------------------------------------

def test_onnx_and_openvino_copies_are_not_copied(capsys, tmp_path):
    """sentence-transformers' Hub folders carry the dense model again as onnx/model*.onnx and
    openvino/openvino_model*.bin: they were copied into the 2:4 folder (loaded by backend="onnx")."""
    src = tmp_path / "dense"
    dense = _dense_folder(src)
    for f in ("onnx/model.onnx", "onnx/model_qint8_avx512.onnx", "openvino/openvino_model.bin",
              "openvino/openvino_model.xml", "2_Dense/model.onnx", "2_Dense/openvino_model_qint8.bin",
              "1_Pooling/config.json", "pytorch_model.bin"):
        (src / f).parent.mkdir(exist_ok=True)
        (src / f).write_bytes(b"dense weights")
    out = tmp_path / "out"
    rc, text, err = run(capsys, "prune", str(src), "--out", str(out), "--no-progress")
    assert rc == 0, err
    assert _listing(out) == ["1_Pooling", "1_Pooling/config.json", "2_Dense", "config.json",
                             "generation_config.json", "model.safetensors"]
    assert ("not copied (the dense weights in other formats): 2_Dense/model.onnx, "
            "2_Dense/openvino_model_qint8.bin, onnx/, openvino/, pytorch_model.bin") in text
    _assert_pruned(out, dense)


# --- 5. a long --out name ---------------------------------------------------------------------------------

def _name_max(folder: Path) -> int:
    return os.pathconf(folder, "PC_NAME_MAX")


def test_a_long_out_name_is_written(capsys, tmp_path):
    """The temporary names .NAME.PID.tmp.pt / .NAME.PID.partial exceeded the file system's 255 bytes
    for a legal --out name: 'File name too long' after all the work."""
    n = _name_max(tmp_path)
    dense = tiny_llama()
    torch.save(dense.state_dict(), tmp_path / "dense.pt")
    dense.save_pretrained(tmp_path / "dense")
    file_out, folder_out = tmp_path / ("f" * (n - 3) + ".pt"), tmp_path / ("d" * n)
    rc, _, err = run(capsys, "prune", str(tmp_path / "dense.pt"), "--out", str(file_out), "--no-progress")
    assert rc == 0, err
    _assert_pruned(file_out, dense)
    rc, _, err = run(capsys, "prune", str(tmp_path / "dense"), "--out", str(folder_out), "--no-progress")
    assert rc == 0, err
    _assert_pruned(folder_out, dense)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["dense", "dense.pt", file_out.name, folder_out.name])


def test_a_calibrated_prune_fills_an_empty_out_folder_in_place(capsys, tmp_path):
    """The calibrated path finished its output itself (remove --out, rename the folder built beside it):
    with the folder now built inside --out, it failed after the calibration ("Directory not empty")."""
    from test_cli_calibrated import _folder

    folder, _ = _folder(tmp_path, "llama")
    out = tmp_path / "out"
    out.mkdir()
    os.chmod(out, 0o700)
    before = out.stat()
    rc, _, err = run(capsys, "prune", str(folder), "--out", str(out), "--method", "wanda", "--calibration",
                     str(tmp_path / "calib.txt"), "--samples", "4", "--no-progress")
    assert rc == 0, err
    after = out.stat()
    assert (after.st_ino, stat.S_IMODE(after.st_mode)) == (before.st_ino, 0o700)
    assert "config.json" in os.listdir(out) and not [n for n in os.listdir(out) if n.startswith(".")]


# --- 4. a full disk while the other files are written, and folder links back up ------------------------

def _no_space(*names):   # (OSError's 4th argument is winerror, the 5th filename2)
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), *names[:1], None, *names[1:]) if names else \
        OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


@pytest.mark.parametrize("where", ["tokenizer", "subfolder", "config", "linked-out"])
def test_a_full_disk_at_any_file_of_a_folder_is_one_line_naming_out(capsys, tmp_path, monkeypatch, where):
    """The error named the removed temporary path (shutil's copy: src -> .s24-*.partial/...), printed
    shutil.Error's list (a subfolder), named no file (transformers writing config.json), or, --out a link
    to an empty folder, its target's temporary path: not the documented one line naming --out (exit 2)."""
    import transformers
    dense = tmp_path / "dense"
    tiny_llama().save_pretrained(dense)
    (dense / "tokenizer.json").write_text("{}")
    (dense / "1_Pooling").mkdir()
    (dense / "1_Pooling" / "big.json").write_text("{}")
    out, target = tmp_path / "o", tmp_path / "target"
    copyfile = shutil.copyfile

    def full_copy(src, dst, **kw):   # (os.sendfile names both files)
        if Path(src).name == {"tokenizer": "tokenizer.json", "subfolder": "big.json"}.get(where):
            raise _no_space(os.fspath(src), os.fspath(dst))
        return copyfile(src, dst, **kw)

    def full_config(self, path, *a, **kw):   # (a buffered write's close names no file)
        raise _no_space()

    replace = os.replace

    def full_replace(a, b, **kw):
        if Path(a).name == "config.json":
            raise _no_space(str(a), str(b))
        return replace(a, b, **kw)

    monkeypatch.setattr(shutil, "copyfile", full_copy)
    if where == "config":
        monkeypatch.setattr(transformers.PreTrainedConfig, "to_json_file", full_config)
    if where == "linked-out":
        target.mkdir()
        os.symlink(target, out)
        monkeypatch.setattr(os, "replace", full_replace)
    before = _listing(tmp_path)
    rc, _, err = run(capsys, "prune", str(dense), "--out", str(out), "--no-progress")
    assert rc == 2, err
    assert_one_line_error(err, f"--out {out}: cannot write it (No space left on device)")
    assert ".partial" not in err
    assert _listing(tmp_path) == before


@pytest.mark.parametrize("link", ["1_Pooling/up", "self", "a/b"])
def test_a_folder_link_back_up_is_not_copied_into_itself(capsys, tmp_path, link):
    """A folder link to the model folder or a folder above it (or a cycle of two links: a/b -> ../b,
    b/a -> ../a) was followed until the kernel's link limit: ~40 nested copies, the dense weights in each."""
    src = tmp_path / "dense"
    dense = _dense_folder(src)
    (src / "1_Pooling").mkdir()
    (src / "1_Pooling" / "config.json").write_text("{}")
    (src / "a").mkdir()
    (src / "b").mkdir()
    (src / "b" / "x.txt").write_text("x")
    targets = {"1_Pooling/up": "..", "self": ".", "a/b": "../b"}
    os.symlink(targets[link], src / link)
    if link == "a/b":
        os.symlink("../a", src / "b" / "a")
    out = tmp_path / "out"
    rc, _, err = run(capsys, "prune", str(src), "--out", str(out), "--no-progress")
    assert rc == 0, err
    assert not list(out.rglob("model.safetensors"))[1:], "the dense weights copied again below --out"
    assert (out / "1_Pooling" / "config.json").read_text() == "{}"
    assert (out / "b" / "x.txt").read_text() == "x"
    if link == "a/b":   # (a link to a folder that is not above it is copied, once)
        assert (out / "a" / "b" / "x.txt").read_text() == "x" and not (out / "a" / "b" / "a").exists()
    else:
        assert not (out / link).exists()
    _assert_pruned(out, dense)
