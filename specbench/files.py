"""Whole-or-absent file writes. Caches, checkpoints and sweep cells are read by other processes and
survive kills: a file is written beside its final name under a name no other writer picks, then renamed
over it, so a reader sees the old file or the new one, never half of one."""
from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path
from typing import Iterator


@contextlib.contextmanager
def replacing(path: Path | str) -> Iterator[Path]:
    """A temporary path beside `path` to write to; on a clean exit it replaces `path` (with the umask's
    usual mode: caches are shared data), on an error it is removed and `path` is left as it was."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    descriptor, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(descriptor)
    temporary = Path(name)
    try:
        yield temporary
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(temporary, 0o666 & ~umask)  # mkstemp makes owner-only files
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise


def write_text(path: Path | str, text: str) -> None:
    """`path`'s text, whole or not at all."""
    with replacing(path) as temporary:
        temporary.write_text(text)
