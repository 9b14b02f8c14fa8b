"""Read a rendered model directory's `config.pbtxt` parameters (the keys our template writes)."""

from __future__ import annotations

import re
from pathlib import Path

from peagle_trt.errors import ConfigError

_PARAM = re.compile(r'parameters\s*\{\s*key:\s*"([^"]+)"\s*value\s*\{\s*string_value:\s*"([^"]*)"\s*\}\s*\}')


def model_params(repo: str | Path, model: str = "peagle") -> tuple[Path, dict[str, str]]:
    model_dir = Path(repo) / model
    config = model_dir / "config.pbtxt"
    if not config.is_file():
        raise ConfigError(f"{repo}: no model {model!r} (missing {config}); build the repository with "
                          "`peagle-trt build`")
    return model_dir, dict(_PARAM.findall(config.read_text()))
