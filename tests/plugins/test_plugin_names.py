"""The C++ plugins spell the op names, plugin version and namespace that peagle_trt/ops/names.py
declares (the one Python declaration). Parses plugins/src/plugins/peaglePlugins.h and pluginUtils.h;
no compiler or GPU needed."""

from __future__ import annotations

import re
from pathlib import Path

from peagle_trt.ops import names

PLUGINS = Path(__file__).resolve().parents[2] / "plugins" / "src" / "plugins"


def _constants(text: str, name: str) -> list[str]:
    """Every `constexpr char const* <name> = "...";` string in `text`."""
    return re.findall(rf'constexpr\s+char\s+const\s*\*\s*{name}\s*=\s*"([^"]*)"\s*;', text)


def test_plugin_names_are_the_op_types():
    header = (PLUGINS / "peaglePlugins.h").read_text()
    classes = dict(re.findall(r'class\s+(\w+Plugin)\s+final\b[^{]*\{[^}]*?kName\s*=\s*"([^"]*)"', header))
    assert classes == {"KVAttentionPlugin": names.KV_ATTENTION, "DraftInputsPlugin": names.DRAFT_INPUTS,
                       "DraftSamplePlugin": names.DRAFT_SAMPLE, "MoEPlugin": names.MOE}
    assert sorted(_constants(header, "kName")) == sorted(names.OP_TYPES)


def test_plugin_version_and_namespace():
    utils = (PLUGINS / "pluginUtils.h").read_text()
    assert _constants(utils, "kPluginVersion") == [names.PLUGIN_VERSION]
    assert _constants(utils, "kPluginNamespace") == [names.PLUGIN_NAMESPACE]
