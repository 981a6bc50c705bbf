"""What every room needs: an error's first line, a writable directory, a hub name told from a path."""

from __future__ import annotations

import errno
import os
import tempfile
from pathlib import Path

FULL = (errno.ENOSPC, errno.EDQUOT)  # a full disk, or a spent quota


def first_line(e: BaseException) -> str:
    """An error's first non-empty line, for one-line messages."""
    return next((line for line in str(e).splitlines() if line.strip()), type(e).__name__)


def writable_problem(d: Path | str) -> str | None:
    """Why files cannot be written in folder d (made if missing), in words, or None: tried, not read off
    permission bits (root ignores them; a read-only mount does not show in them). The probe file's name is
    unique across nodes sharing d."""
    try:
        os.makedirs(d, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=d, prefix=".write-test-")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        return first_line(e)
    return None


def is_hub_id(name: str) -> bool:
    """'owner/name' on the Hugging Face hub (not a local path): models and datasets alike."""
    return name.count("/") == 1 and not name.startswith((".", "/", "~"))
