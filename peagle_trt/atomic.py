"""Write an output directory atomically, and never over anything that is not a previous output.

    output = check_output(output, inputs=[target, drafter, calib_data], force=args.force)
    with staged_dir(output, "the repository") as tmp:
        ...write into tmp...

`check_output` runs before any work: the output may never be an input, contain one or lie inside
one (`--output` pointing at a checkpoint would otherwise replace it); an existing output is replaced
only with `force`, and only when it is a directory written by peagle-trt: every file in it listed
in a peagle-trt `manifest.json` (manifest.foreign_files). A regular file, a symbolic link or a foreign
directory is refused, never deleted.

`staged_dir` builds the output in a temporary sibling, then renames it into place (an existing
output is swapped out, then removed; if the final rename fails the old one is put back). On any
failure the temporary directory is removed, so nothing half-written is ever left behind. OSErrors
(disk full, permissions) become a `BuildError` that says so.

How to test: tests/faults/test_force_outputs.py.
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Iterable
from contextlib import contextmanager
from pathlib import Path

from peagle_trt.errors import BuildError
from peagle_trt.manifest import foreign_files

REFUSED = ("--force replaces only a directory written by peagle-trt (recognised by its manifest.json); "
           "remove it yourself or choose another --output")


def writable_parent(output: Path) -> None:
    try:
        output.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise BuildError(f"cannot create {output.parent}: {exc.strerror}; choose a writable --output") from exc
    if not os.access(output.parent, os.W_OK):
        raise BuildError(f"{output.parent} is not writable; choose a writable --output")


def check_output(output: str | Path, inputs: Iterable[str | Path | None], force: bool) -> Path:
    """The absolute output path, or a BuildError when writing it could destroy something not ours.

    `inputs`: every file or directory the stage reads (None entries are skipped)."""
    output = Path(output).absolute()
    real = output.resolve()
    for given in inputs:
        if given is None:
            continue
        src = Path(given).absolute().resolve()
        if real == src or real in src.parents:
            relation = "is" if real == src else "contains"
            raise BuildError(f"--output {output} {relation} the input {given}; the output is replaced as a "
                             "whole, so it must lie outside every input: choose another --output")
        if src in real.parents:
            raise BuildError(f"--output {output} lies inside the input {given}; keep outputs out of input "
                             "directories: choose another --output")
    if not os.path.lexists(output):
        return output
    if not force:
        raise BuildError(f"{output} already exists; pass --force to replace a previous peagle-trt output")
    if output.is_symlink():
        raise BuildError(f"--output {output} is a symbolic link; {REFUSED}")
    if not output.is_dir():
        raise BuildError(f"--output {output} is a file, not a directory written by peagle-trt; {REFUSED}")
    foreign = foreign_files(output)
    if foreign:
        raise BuildError(f"--output {output} is not a peagle-trt output: {foreign[0]}"
                         f"{f' (and {len(foreign) - 1} more)' if len(foreign) > 1 else ''}; {REFUSED}")
    return output


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def publish(tmp: Path, output: Path) -> None:
    """Rename `tmp` to `output`, swapping out (then removing) an existing `output`."""
    if not os.path.lexists(output):
        tmp.rename(output)
        return
    old = output.parent / f".{output.name}.old-{uuid.uuid4().hex[:8]}"
    output.rename(old)
    try:
        tmp.rename(output)
    except BaseException:
        old.rename(output)  # put the previous output back
        raise
    _remove(old)


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
