"""Building this package's C kernels (csrc/) on first use, into a per-user cache, safely.

Why not a wheel: the kernels target the CPU found (its vector extensions), are small, and the machines
that run them have a C compiler (torch's own inductor needs one). A library is built once per source,
flags and compiler, into $ROLLOUT_SSD_KERNEL_CACHE, else ~/.cache/rollout_ssd/kernels, else a per-user
folder of the temporary directory (a read-only home). Only folders that are ours and that nobody else can
write to are read or written (a shared temporary directory could hold a planted library). Concurrent
builders (an engine and its SSD worker process) each write a temporary file and rename it, so a reader
never sees half a library. Used by bf16_rows.py, f32_rows.py, few_attention.py and layer_kernel.py.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Callable, Optional, Sequence

log = logging.getLogger(__name__)


def cache_dirs() -> list[Path]:
    """Where built libraries live: $ROLLOUT_SSD_KERNEL_CACHE or ~/.cache/rollout_ssd/kernels, and a
    per-user folder in the temporary directory where that one cannot be written (a read-only home)."""
    root = os.environ.get("ROLLOUT_SSD_KERNEL_CACHE") or Path.home() / ".cache" / "rollout_ssd" / "kernels"
    return [Path(root), Path(tempfile.gettempdir()) / f"rollout_ssd-kernels-{os.getuid()}"]


def private(folder: Path) -> bool:
    """Whether libraries in this folder may be loaded: it is ours and nobody else can write to it (the
    temporary directory is shared, and a folder another user made first at our name could hold a
    planted library), or it does not exist yet."""
    try:
        st = folder.stat()
    except (FileNotFoundError, NotADirectoryError):  # not there (yet): whoever makes it is checked then
        return True
    return st.st_uid == os.getuid() and not st.st_mode & 0o022


def default_compiler(cpp: bool = False) -> str:
    """$CC, else `cc` or `gcc`; for C++ (cpp) $CXX, else `c++` or `g++`."""
    if cpp:
        return os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or "c++"
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or "cc"


def build_library(name: str, source: Path, flags: Sequence[str], link: Sequence[str] = (), key_text: bytes = b"",
                  compiler: str = "") -> Path:
    """`compiler source flags link -o <cache>/<name>-<key>.so`, once per (source text + key_text, compiler,
    flags, link): the cached library's path. key_text: whatever else the library depends on (other
    sources it includes, a torch version). Raises CalledProcessError (a failed compile, nothing left
    behind) or OSError (no folder to write to)."""
    cmd = compiler or default_compiler(source.suffix == ".cpp")
    text = source.read_bytes() + key_text
    key = hashlib.sha256(text + " ".join((cmd, *flags, *link)).encode()).hexdigest()[:16]
    dirs = [d for d in cache_dirs() if private(d)]
    for folder in dirs:
        if (folder / f"{name}-{key}.so").exists():
            return folder / f"{name}-{key}.so"
    for folder in dirs:
        try:
            folder.mkdir(mode=0o700, parents=True, exist_ok=True)
            if not private(folder):  # made by another user between the check above and now
                continue
            fd, tmp = tempfile.mkstemp(suffix=".so", dir=folder)
        except OSError:
            continue
        break
    else:
        raise OSError(f"no writable folder for the {name} kernel among {[str(d) for d in dirs]}")
    os.close(fd)
    target = folder / f"{name}-{key}.so"
    try:
        # the linker's inputs after the source: a library named before the file that uses it is dropped
        subprocess.run([cmd, *flags, str(source), *link, "-o", tmp], check=True, capture_output=True, text=True)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def check_operands(kernel: str, x, packed, n: int, bias) -> None:
    """What the rows kernels need of their operands past their own layout: the packed copy contiguous,
    64-byte aligned and on the CPU as its `pack` makes it, x on the CPU, a CPU bias of n elements, n >= 0.
    A ValueError naming the kernel and what was wrong."""
    if not packed.is_contiguous() or packed.data_ptr() % 64 or not packed.is_cpu or not x.is_cpu:
        raise ValueError(f"{kernel}.linear: packed must be a contiguous, 64-byte aligned CPU tensor as pack() "
                         "makes it, and x a CPU tensor")
    if bias is not None and bias.numel() != n:
        raise ValueError(f"{kernel}.linear: bias has {bias.numel()} elements, n={n}")
    if bias is not None and not bias.is_cpu:
        raise ValueError(f"{kernel}.linear: bias must be on the CPU, got {bias.device}")
    if n < 0:
        raise ValueError(f"{kernel}.linear: n must be >= 0, got {n}")


def load_or_none(what: str, load: Callable, kind: Optional[str], instead: str):
    """load(kind), or None where `kind` is None or the build or the load fails: then one warning names the
    kernel, the compiler's message and what runs instead (each module caches its own result)."""
    if kind is None:
        return None
    try:
        return load(kind)
    except (OSError, AttributeError, subprocess.CalledProcessError) as exc:
        log.warning("%s (%s) not built or not loaded (%s); %s", what, kind, getattr(exc, "stderr", "") or exc, instead)
        return None
