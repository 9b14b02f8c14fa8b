"""The confinement rules of peagle_trt/dynamo/options.py, without Dynamo: one named address per
process, every interface only when asked, Dynamo's wildcard publishers only where the network
namespace holds nothing but the named address and loopback."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from peagle_trt.dynamo.options import Planes, WorkerOptions, check_wildcard_reach, local_addresses
from peagle_trt.errors import ConfigError


@pytest.mark.parametrize("host", ["0.0.0.0", "", "::", "*"])
def test_every_interface_is_refused_unless_asked(host, tmp_path):
    with pytest.raises(ConfigError, match="every network interface"):
        Planes(host, discovery_dir=str(tmp_path))
    assert Planes(host, discovery_dir=str(tmp_path), allow_all_interfaces=True).host == "0.0.0.0"


def test_planes_env_puts_every_plane_on_the_host(tmp_path):
    env = Planes("127.0.0.2", discovery_dir=str(tmp_path / "d")).env()
    for name in ("DYN_TCP_RPC_HOST", "DYN_TCP_RESPONSE_STREAM_HOST", "DYN_EVENT_PLANE_HOST", "DYN_SYSTEM_HOST",
                 "DYN_HTTP_HOST"):
        assert env[name] == "127.0.0.2"
    assert env["DYN_FILE_KV"] == str(tmp_path / "d") and (tmp_path / "d").is_dir()


def test_bad_settings_say_what_to_do(tmp_path):
    with pytest.raises(ConfigError, match="IP address"):
        Planes("localhost", discovery_dir=str(tmp_path))
    with pytest.raises(ConfigError, match="--discovery-dir"):
        Planes("127.0.0.1")
    with pytest.raises(ConfigError, match="peagle-trt build"):
        WorkerOptions(tmp_path, Planes(discovery_dir=str(tmp_path)))


def test_wildcard_publishers_need_a_namespace_of_their_own(tmp_path):
    planes = Planes("127.0.0.1", discovery_dir=str(tmp_path))
    others = {a for a in local_addresses() if not a.startswith("127.")}
    if others:  # this machine has a network address: the worker must refuse
        with pytest.raises(ConfigError, match="network namespace"):
            check_wildcard_reach(planes)
    check_wildcard_reach(Planes("127.0.0.1", discovery_dir=str(tmp_path), allow_all_interfaces=True))
    code = "from peagle_trt.dynamo.options import *; check_wildcard_reach(Planes('127.0.0.3', discovery_dir='x'))"
    isolate = "-n" if os.geteuid() == 0 else "-rn"  # non-root: inside a user namespace of its own
    inside = subprocess.run(["unshare", isolate, "--", sys.executable, "-c", code], capture_output=True, text=True)
    assert inside.returncode == 0, inside.stderr  # loopback only: allowed
