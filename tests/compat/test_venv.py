"""The speculators venv set-up fails loudly (with the script's output), never skips."""

from __future__ import annotations

import pytest

from tests.compat.venv import ensure_venv


def test_venv_creation_failure_fails_the_tests_with_the_reason(tmp_path):
    with pytest.raises(pytest.fail.Exception, match=r"(?s)could not create the speculators venv.*"
                                                    r"nonexistent/python3"):
        ensure_venv(tmp_path / "venv", "/nonexistent/python3")
    assert not (tmp_path / "venv").exists()
