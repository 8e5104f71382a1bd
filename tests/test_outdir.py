"""--out and --force: only an onnxformer directory of the right kind is ever replaced, atomically; nothing of the
user's is deleted; what a killed run left behind is cleaned up (or ignored) by the next one."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

import toolkit.reference.outdir as O
from runtime.manifest import MANIFEST
from toolkit.reference.checkpoint import CHECKPOINT_KIND, load_checkpoint, save_checkpoint
from toolkit.apps.cli import main
from toolkit.reference.config import preset
from toolkit.reference.model import Transformer
from toolkit.reference.outdir import STAGING, OutputError, remove_stale


def staged(parent: Path) -> list[str]:
    """Temporary directories of ours in parent."""
    return sorted(p.name for p in parent.iterdir() if f".{STAGING}-" in p.name)


def run(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def user_error(result, *phrases):
    assert result.exit_code == 2, (result.exit_code, result.output, result.exception)
    assert isinstance(result.exception, SystemExit) and "Traceback" not in result.output
    err = result.stderr.strip()
    assert "\n" not in err and err.startswith("error:"), err
    for phrase in phrases:
        assert phrase in err, (phrase, err)


def dead_pid() -> int:
    """The id of a process that has exited."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


@pytest.fixture
def model():
    return Transformer(preset("tiny", vocab_size=40), seed=3)


@pytest.fixture
def users_dir(tmp_path) -> Path:
    """A non-empty directory that is not ours (it even has a config.json of another framework)."""
    d = tmp_path / "mine"
    (d / "sub").mkdir(parents=True)
    (d / "notes.txt").write_text("precious")
    (d / "config.json").write_text('{"model_type": "marian", "d_model": 512}')
    (d / "sub" / "data.bin").write_bytes(b"\x00" * 10)
    return d


def unchanged(d: Path) -> None:
    assert (d / "notes.txt").read_text() == "precious"
    assert (d / "sub" / "data.bin").read_bytes() == b"\x00" * 10
    assert sorted(p.name for p in d.iterdir()) == ["config.json", "notes.txt", "sub"]


@pytest.fixture(scope="module")
def ckpt_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("outdir") / "ckpt"
    assert run("init", "--preset", "tiny", "--out", out).exit_code == 0
    return out


def test_every_writing_command_refuses_an_unrelated_directory_even_with_force(users_dir, ckpt_dir, toy_exported):
    _, bundle = toy_exported
    commands = [("init", "--preset", "tiny", "--out", users_dir),
                ("train", "--out", users_dir, "--steps", "1"),
                ("export", ckpt_dir, "--out", users_dir),
                ("optimize", bundle, "--out", users_dir)]
    for args in commands:
        for force in ((), ("--force",)):
            user_error(run(*args, *force), "is not an onnxformer", "even with --force", "--out")
            unchanged(users_dir)
    assert staged(users_dir.parent) == []


def test_force_replaces_a_checkpoint_atomically_and_keeps_nothing_old(tmp_path, model):
    out = save_checkpoint(tmp_path / "ckpt", model, training={"steps": 1})
    inode = out.stat().st_ino
    other = Transformer(preset("tiny", vocab_size=40, d_ff=48), seed=4)
    save_checkpoint(out, other, force=True)
    assert load_checkpoint(out).config.d_ff == 48
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "weights.safetensors"]   # training.json went
    assert out.stat().st_ino != inode                     # a new directory took the old one's place
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_force_refuses_our_directory_holding_a_users_file(tmp_path, model):
    out = save_checkpoint(tmp_path / "ckpt", model)
    (out / "README.md").write_text("my notes")
    with pytest.raises(OutputError, match="also holds README.md, which onnxformer did not write"):
        save_checkpoint(out, model, force=True)
    assert (out / "README.md").read_text() == "my notes"
    (out / "README.md").unlink()
    (out / "extra").mkdir()
    with pytest.raises(OutputError, match="also holds extra"):
        save_checkpoint(out, model, force=True)


def test_force_replaces_only_its_own_kind(tmp_path, ckpt_dir, toy_exported):
    _, bundle = toy_exported
    ckpt = tmp_path / "ckpt"
    shutil.copytree(ckpt_dir, ckpt)
    user_error(run("export", ckpt_dir, "--out", ckpt, "--force"), "is not an onnxformer bundle")
    assert load_checkpoint(ckpt).config.d_model == 32
    copy = tmp_path / "bundle"
    shutil.copytree(bundle, copy)
    user_error(run("init", "--preset", "tiny", "--out", copy, "--force"), "is not an onnxformer checkpoint")
    assert (copy / MANIFEST).is_file()


def test_files_links_and_unwritable_parents_are_refused(tmp_path, model):
    (tmp_path / "afile").write_text("x")
    with pytest.raises(OutputError, match="not a directory"):
        save_checkpoint(tmp_path / "afile", model, force=True)
    with pytest.raises(OutputError, match="is a file, not a directory"):
        save_checkpoint(tmp_path / "afile" / "ckpt", model)
    target = save_checkpoint(tmp_path / "real", model)
    (tmp_path / "link").symlink_to(target)
    with pytest.raises(OutputError, match="symbolic link"):
        save_checkpoint(tmp_path / "link", model, force=True)
    assert (tmp_path / "link").is_symlink() and (target / "config.json").is_file()
    assert (tmp_path / "afile").read_text() == "x"


def test_an_empty_directory_is_written_without_force(tmp_path, model):
    (tmp_path / "empty").mkdir()
    save_checkpoint(tmp_path / "empty", model)
    assert load_checkpoint(tmp_path / "empty") and staged(tmp_path) == []
    with pytest.raises(OutputError, match="already exists.*--force"):      # now it holds a checkpoint
        save_checkpoint(tmp_path / "empty", model)
    (tmp_path / "forced").mkdir()
    save_checkpoint(tmp_path / "forced", model, force=True)
    assert load_checkpoint(tmp_path / "forced")
    (tmp_path / "cli").mkdir()
    assert run("init", "--preset", "tiny", "--out", tmp_path / "cli").exit_code == 0
    assert load_checkpoint(tmp_path / "cli") and staged(tmp_path) == []


class DiskFull:
    """A tokenizer whose file cannot be written: the write fails half-way through the checkpoint."""

    vocab_size = 1

    def save(self, path):
        Path(path).write_text("{")
        raise OSError(28, "No space left on device")


def test_a_failed_write_leaves_the_old_directory_and_no_new_parents(tmp_path, model):
    out = save_checkpoint(tmp_path / "ckpt", model)
    before = (out / "weights.safetensors").read_bytes()
    bad = Transformer(preset("tiny", vocab_size=40), seed=9)
    with pytest.raises(OSError, match="No space"):
        save_checkpoint(out, bad, tokenizer=DiskFull(), force=True)
    assert (out / "weights.safetensors").read_bytes() == before and not (out / "tokenizer.json").exists()
    with pytest.raises(OSError, match="No space"):
        save_checkpoint(tmp_path / "new" / "deep" / "ckpt", bad, tokenizer=DiskFull())
    assert not (tmp_path / "new").exists() and staged(tmp_path) == []


@pytest.mark.parametrize("exchange", [True, False], ids=["renameat2-exchange", "move-aside"])
def test_commit_swaps_and_puts_the_old_back_when_the_move_fails(tmp_path, model, monkeypatch, exchange):
    out = save_checkpoint(tmp_path / "ckpt", model)
    if not exchange:
        monkeypatch.setattr(O, "_exchange", lambda a, b: False)
    save_checkpoint(out, Transformer(preset("tiny", vocab_size=40), seed=5), force=True)
    assert staged(tmp_path) == []
    if exchange:
        return
    real = os.rename
    calls = []

    def second_fails(a, b):
        calls.append((a, b))
        if len(calls) == 2:                          # out moved aside, then the new one fails to move in
            raise OSError(28, "No space left on device")
        return real(a, b)

    before = (out / "weights.safetensors").read_bytes()
    monkeypatch.setattr(O.os, "rename", second_fails)
    with pytest.raises(OSError):
        save_checkpoint(out, Transformer(preset("tiny", vocab_size=40), seed=6), force=True)
    assert (out / "weights.safetensors").read_bytes() == before and staged(tmp_path) == []


def test_leftovers_of_a_killed_run_are_removed_by_the_next_and_others_are_kept(tmp_path, model):
    out = tmp_path / "ckpt"
    pid = dead_pid()
    dead_tmp = tmp_path / f".ckpt.{STAGING}-tmp-{pid}-abc123"
    (dead_tmp / "half").mkdir(parents=True)
    (dead_tmp / "half" / "weights.safetensors").write_bytes(b"partial")
    live_tmp = tmp_path / f".ckpt.{STAGING}-tmp-{os.getppid()}-def456"    # a run still going (our parent)
    live_tmp.mkdir()
    lookalike = tmp_path / ".ckpt.mine-tmp-1-x"                       # not a name we write
    lookalike.mkdir()
    other_out = tmp_path / f".other.{STAGING}-tmp-{pid}-abc123"         # another --out's leftovers: not ours to judge
    other_out.mkdir()
    assert not out.exists()
    save_checkpoint(out, model)
    assert not dead_tmp.exists() and live_tmp.exists() and lookalike.exists() and other_out.exists()
    assert load_checkpoint(out).config.vocab_size == 40


def test_a_previous_directory_moved_aside_by_a_killed_run_is_restored(tmp_path, model):
    """Killed between moving the old --out aside and moving the new one in (systems without renameat2)."""
    out = save_checkpoint(tmp_path / "ckpt", model)
    aside = tmp_path / f".ckpt.{STAGING}-old-{dead_pid()}-zz9"
    os.rename(out, aside)
    assert remove_stale(out) == [] and load_checkpoint(out).config.vocab_size == 40 and not aside.exists()


def test_the_kind_recognises_only_complete_checkpoints(tmp_path, model):
    out = save_checkpoint(tmp_path / "ckpt", model)
    assert CHECKPOINT_KIND.files(out) >= {"config.json", "weights.safetensors"}
    (out / "weights.safetensors").unlink()
    assert CHECKPOINT_KIND.files(out) is None                       # a config without weights is not ours
    (out / "weights.safetensors").write_bytes(b"x")
    (out / "config.json").write_text("{not json")
    assert CHECKPOINT_KIND.files(out) is None


def test_a_full_disk_is_one_line_and_leaves_no_bundle(toy_exported, tmp_path, monkeypatch):
    """optimize (export likewise) on a disk that fills while the bundle is written: exit 2, one line naming the
    disk and the fix, no traceback, nothing at --out and no staging folder beside it."""
    import exporters.optimize as optimize
    import exporters.shared_weights as shared

    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(shared, "share_weights", full)
    monkeypatch.setattr(optimize, "share_weights", full)
    result = run("optimize", str(toy_exported[1]), "--out", str(tmp_path / "fp32"))
    user_error(result, "the disk is full", "free space", "--out on another disk")
    assert not (tmp_path / "fp32").exists() and staged(tmp_path) == []
