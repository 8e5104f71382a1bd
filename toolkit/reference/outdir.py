"""Output directories: what `--out` may replace, and writing a directory atomically. Every command that writes a
directory (init, train, import, export, optimize) goes through here.

    with staged_output(out, force, CHECKPOINT_KIND) as tmp:   # tmp: .NAME.onnxformer-tmp-PID-XXXX beside out
        ...write files into tmp...
    # clean exit: tmp takes out's place (an old out is swapped out in one rename, then removed);
    # an exception or Ctrl-C: tmp is removed and out is untouched;
    # kill -9: tmp stays behind, hidden, and the next run that writes out removes it

An empty directory at `--out` is written without `--force` (it holds nothing to lose, e.g. one made by
`mkdir` or a volume mount). `--force` replaces only a directory of the same kind that onnxformer wrote:
`OutputKind.files` recognises one (a bundle by its manifest, a checkpoint by its config) and must account for
every file in it. Anything else at `--out` (a user's directory, a file, a link, an onnxformer directory holding
files we did not write) is refused with OutputError (exit 2) and never deleted. Imports only the standard library.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from toolkit.reference.errors import OutputError

STAGING = "onnxformer"                     # the marker in every temporary name: .NAME.onnxformer-tmp-PID-XXXX


@dataclass(frozen=True)
class OutputKind:
    """A kind of directory onnxformer writes. files(dir): every file such a directory of ours holds, or None when
    dir is not one (not ours, or unreadable)."""

    name: str                                      # "bundle", "checkpoint"
    files: Callable[[Path], set[str] | None]
    made_by: str                                   # the command that writes one, for messages


def listed_files(marker: str) -> Callable[[Path], set[str] | None]:
    """OutputKind.files for a directory whose JSON file `marker` lists the files we wrote ({"files": [...]})."""
    def files(directory: Path) -> set[str] | None:
        try:
            listed = json.loads((directory / marker).read_text())["files"]
            return {marker, *listed}
        except (OSError, ValueError, KeyError, TypeError):
            return None
    return files


def check_output(out: str | Path, force: bool, kind: OutputKind) -> Path:
    """Refuse an --out that exists (without force), that is not ours to replace, or that cannot be written.
    Touches nothing; called before any long work and again just before the new directory moves in."""
    out = Path(out)
    if out.is_symlink():
        raise OutputError(f"--out {out} is a symbolic link; pass the directory it points to, or another --out")
    if out.exists():
        if not out.is_dir():
            raise OutputError(f"--out {out} exists and is not a directory; choose another --out")
        entries = sorted(p.name for p in out.iterdir())
        if entries:                                 # an empty directory is filled as if it were not there
            _check_replaceable(out, entries, force, kind)
    existing = out.absolute().parent
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise OutputError(f"cannot create {out}: {existing} is a file, not a directory; choose another --out")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise OutputError(f"cannot write {out}: {existing} is not writable; choose another --out")
    return out


def _check_replaceable(out: Path, entries: list[str], force: bool, kind: OutputKind) -> None:
    """Refuse a non-empty out unless it is a directory of kind holding only our files, and force is given."""
    ours = kind.files(out)
    if ours is None:
        raise OutputError(f"--out {out} exists and is not an onnxformer {kind.name} (the {kind.made_by} writes "
                          f"one), so it will not be replaced, even with --force; choose another --out")
    foreign = [name for name in entries
               if name not in ours or not (out / name).is_file() or (out / name).is_symlink()]
    if foreign:
        listed = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
        raise OutputError(f"--out {out} is an onnxformer {kind.name} but also holds {listed}, which onnxformer "
                          f"did not write, so it will not be replaced, even with --force; move them out or "
                          f"choose another --out")
    if not force:
        raise OutputError(f"{out} already exists; choose another --out, or pass --force to replace the "
                          f"{kind.name} there")


@contextlib.contextmanager
def staged_output(out: str | Path, force: bool, kind: OutputKind):
    """Yield an empty temporary directory beside out; on a clean exit it replaces out, on any failure it goes."""
    out = check_output(out, force, kind)
    parent = out.absolute().parent
    created = [p for p in (parent, *parent.parents) if not p.exists()]
    try:
        parent.mkdir(parents=True, exist_ok=True)
        remove_stale(out)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.{STAGING}-tmp-{os.getpid()}-", dir=parent))
    except OSError as exc:
        raise OutputError(f"cannot write {out} ({exc.strerror}); choose another --out") from None
    try:
        yield tmp
        _share(tmp)
        check_output(out, force, kind)               # what appeared at out while we worked is checked again
        _commit(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        for p in created:                           # parents this call made, if still empty
            with contextlib.suppress(OSError):
                p.rmdir()
        raise


def remove_stale(out: str | Path) -> list[Path]:
    """Remove what killed runs left beside out: our temporary directories whose process is gone. A previous out
    moved aside by a run killed before its replacement moved in is put back first. Returns what was removed."""
    out = Path(out)
    parent = out.absolute().parent
    pattern = re.compile(rf"^\.{re.escape(out.name)}\.{STAGING}-(tmp|old)-(\d+)-[A-Za-z0-9_]+$")
    stale = []
    if parent.is_dir():
        for p in parent.iterdir():
            m = pattern.match(p.name)
            if m and p.is_dir() and not p.is_symlink() and not _alive(int(m.group(2))):
                stale.append((m.group(1), p))
    removed = []
    for role, p in sorted(stale, key=lambda rp: rp[0] == "tmp"):
        if role == "old" and not out.exists() and not out.is_symlink():
            with contextlib.suppress(OSError):
                os.rename(p, out)                   # the previous out, never replaced: restore it
                continue
        shutil.rmtree(p, ignore_errors=True)
        removed.append(p)
    return removed


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:                         # someone else's process
        return True
    return True


def _share(tmp: Path) -> None:
    """mkdtemp makes 0700: give the directory and its files the permissions the umask gives any new file."""
    mask = os.umask(0)
    os.umask(mask)
    for f in (tmp, *tmp.rglob("*")):
        os.chmod(f, (0o777 if f.is_dir() else 0o666) & ~mask)


def _commit(tmp: Path, out: Path) -> None:
    """Move tmp to out. An existing out is exchanged with tmp in one rename where the system can (Linux
    renameat2), else moved aside first; the old directory is removed only once the new one is in place."""
    if not out.exists():
        os.rename(tmp, out)
        return
    if _exchange(tmp, out):
        shutil.rmtree(tmp, ignore_errors=True)       # tmp now holds the old directory
        return
    old = tmp.with_name(tmp.name.replace(f"{STAGING}-tmp-", f"{STAGING}-old-"))
    os.rename(out, old)
    try:
        os.rename(tmp, out)
    except OSError:
        os.rename(old, out)                          # put the previous directory back
        raise
    shutil.rmtree(old, ignore_errors=True)


_RENAME_EXCHANGE, _AT_FDCWD = 2, -100


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths (renameat2 RENAME_EXCHANGE); False where the system or filesystem lacks it."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    raise OSError(code, os.strerror(code), str(b))


__all__ = ["OutputKind", "OutputError", "check_output", "staged_output", "remove_stale"]
