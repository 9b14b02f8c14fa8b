"""Write an output directory atomically: build it in a temporary sibling, then rename it into place.

    with staged_dir(output, "the repository") as tmp:
        ...write into tmp...

On success `tmp` replaces `output` (an existing `output` is swapped out, then removed); on any
failure `tmp` is removed, so nothing half-written is ever left behind. OSErrors (disk full,
permissions) become a `BuildError` that says so.
"""

from __future__ import annotations

import os
import shutil
import uuid
from contextlib import contextmanager
from pathlib import Path

from peagle_trt.errors import BuildError


def writable_parent(output: Path) -> None:
    try:
        output.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise BuildError(f"cannot create {output.parent}: {exc.strerror}; choose a writable --output") from exc
    if not os.access(output.parent, os.W_OK):
        raise BuildError(f"{output.parent} is not writable; choose a writable --output")


def publish(tmp: Path, output: Path) -> None:
    """Rename `tmp` to `output`, swapping out (then removing) an existing `output`."""
    if output.exists():
        old = output.parent / f".{output.name}.old-{uuid.uuid4().hex[:8]}"
        output.rename(old)
        tmp.rename(output)
        shutil.rmtree(old, ignore_errors=True)
    else:
        tmp.rename(output)


@contextmanager
def staged_dir(output: Path, what: str):
    output = Path(output).absolute()
    writable_parent(output)
    tmp = output.parent / f".{output.name}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        tmp.mkdir()
        yield tmp
        publish(tmp, output)
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(exc, OSError):
            raise BuildError(f"writing {what} failed ({exc}); nothing was left behind") from exc
        raise
