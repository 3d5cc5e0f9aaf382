"""Faults of the machine rather than of the input: a full disk, a read-only or unwritable results directory, no memory
left. Met while a stage writes its record, a checkpoint or an export, each becomes a WriteFault naming what was being
written, where, and the space it needed when that is known; the CLI prints it as one line with what a rerun resumes
from (cli.py). A write that fails this way leaves nothing that could be taken as complete: files are written to a
temp name and renamed (records.atomic_write), and a half-written checkpoint is removed (`partial`), which also gives
its space back."""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
from pathlib import Path

CAUSES = {errno.ENOSPC: "no space left on device", errno.EDQUOT: "disk quota exceeded",
          errno.EROFS: "read-only file system", errno.EACCES: "permission denied",
          errno.EPERM: "operation not permitted"}
# writers that raise no OSError quote the same errors in their message: safetensors ("No space left on device (os
# error 28)"), torch's file writer ("open file failed with strerror: Read-only file system")
STRERRORS = {os.strerror(n): cause for n, cause in CAUSES.items()}
OUT_OF_MEMORY = "out of memory"
FULL = {CAUSES[errno.ENOSPC], CAUSES[errno.EDQUOT]}
# torch's file writer on a full disk says only that a write came up short ("unexpected pos 576 vs 534")
TORCH_WRITER = ("inline_container.cc", "PytorchStreamWriter")
ALLOCATION = re.compile(r"(?:tried to allocate|Tried to allocate) ([\d.]+) ?(bytes|[KMGT]iB)")
UNITS = {"bytes": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40}


class WriteFault(RuntimeError):
    """A write (or the work around it) failed for want of space, permission or memory: `cause` (CAUSES' words or
    "out of memory"), `path` (None: not known), `what` was written there, `needed` bytes when known."""

    def __init__(self, cause: str, path: Path | str | None = None, what: str = "", needed: int | None = None):
        self.cause, self.path, self.what, self.needed = cause, path, what, needed
        self.free = free_bytes(path) if path is not None and cause in FULL else None
        super().__init__(self.describe())

    def describe(self) -> str:
        where = f" while writing {self.what} {self.path}" if self.what else f": {self.path}" if self.path else ""
        sizes = [f"needs about {human(self.needed)}"] if self.needed and self.cause in FULL | {OUT_OF_MEMORY} else []
        sizes += [f"{human(self.free)} free"] if self.free is not None else []
        return f"{self.cause}{where}" + (f" ({', '.join(sizes)})" if sizes else "")

    def remedy(self) -> str:
        """What to do before the rerun, as a sentence's start."""
        if self.cause == OUT_OF_MEMORY:
            return "Free some memory"
        if self.cause in FULL:
            return "Free some space"
        return f"Make {Path(self.path).parent if self.path else 'the results directory'} writable"


def human(n: int) -> str:
    """Bytes as a short figure: 512 B, 1.2 MB, 3.4 GB."""
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def free_bytes(path: Path | str) -> int | None:
    """Bytes free to this user on the file system that holds `path` (its nearest existing parent)."""
    p = Path(path).absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        return shutil.disk_usage(p).free
    except OSError:
        return None


def tree_bytes(path: Path | str | None) -> int | None:
    """The size of a file or a directory's files (None: there is none): what writing it again takes."""
    if path is None or not Path(path).exists():
        return None
    p = Path(path)
    return p.stat().st_size if p.is_file() else sum(f.stat().st_size for f in p.rglob("*") if f.is_file())


def chain(exc: BaseException):
    """`exc` and the exceptions it came from (its cause, else its context), each once."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def _allocation(text: str) -> int | None:
    m = ALLOCATION.search(text)
    return int(float(m.group(1)) * UNITS[m.group(2)]) if m else None


def cause(exc: BaseException, path: Path | str | None = None) -> tuple[str, int | None] | None:
    """(what happened, bytes needed when the error says) when `exc` or an exception it comes from is a fault of the
    machine: an OSError of CAUSES, a library's error quoting one, a torch write come up short on a full disk (at
    `path`), or no memory left; None for anything else."""
    for e in chain(exc):
        if isinstance(e, WriteFault):
            return e.cause, e.needed
        if isinstance(e, MemoryError) or type(e).__name__ == "OutOfMemoryError" or \
                "can't allocate memory" in str(e):
            return OUT_OF_MEMORY, _allocation(str(e))
        if isinstance(e, OSError) and e.errno in CAUSES:
            return CAUSES[e.errno], None
        text = str(e)
        for strerror, found in STRERRORS.items():
            if strerror in text:
                return found, None
        if path is not None and any(w in text for w in TORCH_WRITER) and (free_bytes(path) or 0) < 1 << 20:
            return CAUSES[errno.ENOSPC], None
    return None


def _filename(exc: BaseException) -> str | None:
    """The file an error names: an OSError's, or the path a safetensors error quotes."""
    for e in chain(exc):
        if isinstance(e, OSError) and e.filename:
            return str(e.filename)
        m = re.search(r'at path "([^"]+)"', str(e))
        if m:
            return m.group(1)
    return None


def fault_of(exc: BaseException) -> WriteFault | None:
    """`exc` as a WriteFault when it is (or comes from) a fault of the machine, wherever it was raised; else None."""
    if isinstance(exc, WriteFault):
        return exc
    found = cause(exc)
    return WriteFault(found[0], _filename(exc), needed=found[1]) if found else None


@contextlib.contextmanager
def writing(path: Path | str, what: str, needed: int | None = None, partial: Path | None = None):
    """Inside the block, a failure for want of space, permission or memory raises WriteFault naming `what` at `path`
    (`needed`: the bytes it takes, when known); `partial`, the half-written output, is removed first."""
    try:
        yield
    except Exception as e:
        found = cause(e, path)
        if found is None:
            raise
        if partial is not None:
            shutil.rmtree(partial, ignore_errors=True)
        if isinstance(e, WriteFault):
            raise
        raise WriteFault(found[0], path, what, needed or found[1]) from e
