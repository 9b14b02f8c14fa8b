"""The bundled tritonserver's backend folder (peagle_trt/serve/server.py `_bundled`): made once per machine in
the temp dir, whole or not at all, and never removed under a server that runs from it when two
servers start at once (two test workers, two `peagle-trt serve`)."""

import os
import tempfile

import pytest

from peagle_trt.serve import server

pytest.importorskip("pytriton")
STUB = ("backends", "python", "triton_python_backend_stub")


@pytest.fixture
def temp(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    return tmp_path


def test_a_copy_made_by_a_concurrent_start_is_kept(temp, monkeypatch):
    copytree, other = server.shutil.copytree, {}

    def copy_after_another_start(*args, **kw):
        if not other:  # another start finishes its copy while this one is copying
            monkeypatch.setattr(server.shutil, "copytree", copytree)
            other["work"] = server._bundled()[1]
            other["inode"] = os.stat(other["work"]).st_ino
            monkeypatch.setattr(server.shutil, "copytree", copy_after_another_start)
        return copytree(*args, **kw)

    monkeypatch.setattr(server.shutil, "copytree", copy_after_another_start)
    _, work = server._bundled()
    assert work == other["work"] and os.stat(work).st_ino == other["inode"]  # not replaced under it
    assert work.joinpath(*STUB).is_file()
    assert [p.name for p in temp.iterdir()] == [work.name]  # this start's own copy is gone


def test_an_incomplete_copy_is_replaced(temp):
    _, work = server._bundled()
    work.joinpath(*STUB).unlink()
    (work / "junk").write_text("left by whatever deleted the stub")
    _, again = server._bundled()
    assert again == work and work.joinpath(*STUB).is_file() and not (work / "junk").exists()
    assert [p.name for p in temp.iterdir()] == [work.name]
