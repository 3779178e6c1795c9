"""Where the package keeps what it derives from model files between processes ($ROLLOUT_SSD_CACHE), and the
key that says a cached entry still describes its file (the GGUF tensor index and tokenizer, the strategy
rule's measurements: ssd/rule_cache.py)."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path


def cache_root() -> Path:
    return Path(os.environ.get("ROLLOUT_SSD_CACHE", Path.home() / ".cache" / "rollout_ssd"))


def file_key(path: Path) -> str:
    """A cache key of this file as it is now: its resolved path, size and mtime."""
    st = path.stat()
    return hashlib.sha256(f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:16]
