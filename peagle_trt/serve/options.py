"""The settings a served model runs with, and their one round trip through config.pbtxt.

`RepositoryOptions` is what `peagle-trt build` is asked for (speculation, backend, sizes, input
limits); `ArtifactPaths` says where the build put the model files, relative to the model's
version directory (`REPO/peagle/1`). The build writes both as the model's config.pbtxt
`parameters` with `to_parameters`; the Triton model and `generate --repo` read them back into the
same dataclasses with `from_parameters` (`read_options` does it for a repository on disk).
The build (peagle_trt/build/) writes, serving reads: both import this light module (no torch).
tests/serve/test_options.py checks the round trip.

`deterministic` (`--deterministic` of build, generate, serve and `dynamo worker`; vLLM's spelling,
the environment variable VLLM_BATCH_INVARIANT=1, is accepted where a repository is served: it
turns the option on, never off) makes every forward row- and batch-invariant (torch and
onnxruntime backends; docs/SERVING.md, "Deterministic mode"). `with_deterministic` applies both.
`serve --seed N` reaches the served models as PEAGLE_SERVE_SEED (`serve_seed`). `kv_cache_dtype`
(`--kv-cache-dtype` of build, generate and vLLM's serve command) says what every KV cache of the
executor stores (`kv_layout`, peagle_trt/config.py KVLayout.cache_dtype).
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path

from peagle_trt.config import (
    BLOCK_SIZE,
    GRAMMAR_TIMEOUT_S,
    KERNELS,
    KV_CACHE_DTYPES,
    MAX_GRAMMAR_BYTES,
    MAX_STOP_BYTES,
    PREFILL_CHUNK,
    PROMPT_BYTES_PER_TOKEN,
    TENSORRT_NOT_DETERMINISTIC,
    KVLayout,
    SpecConfig,
)
from peagle_trt.errors import BuildError, ConfigError

BACKENDS = ("torch", "onnxruntime", "tensorrt")
DETERMINISTIC_ENV = "VLLM_BATCH_INVARIANT"  # vLLM's switch for batch-invariant kernels: "1" turns ours on
SEED_ENV = "PEAGLE_SERVE_SEED"  # `serve --seed N` -> the served models (`serve_seed`)
_PARAM = re.compile(r'parameters\s*\{\s*key:\s*"([^"]+)"\s*value\s*\{\s*string_value:\s*"([^"]*)"\s*\}\s*\}')


@dataclass(frozen=True)
class RepositoryOptions:
    speculation: SpecConfig
    model_name: str = "peagle"
    backend: str = "torch"
    max_batch: int = 8
    max_seq_len: int = 2048
    prefill_chunk: int = PREFILL_CHUNK
    device: str = "cpu"
    dtype: str = "float32"
    gpu_arch: str = "sm_90"  # tensorrt backend: sm_90 (H100/H200) | sm_100 (B200)
    plugin_library: str | None = None  # tensorrt backend: libpeagle plugins (.so)
    kernels: str = "reference"  # torch backend: custom ops in torch | on the Triton kernels ("cuda")
    max_prompt_bytes: int | None = None  # None: 16 x max_seq_len (peagle_trt/config.py)
    max_stop_bytes: int | None = None  # None: 1024, all stop strings together
    threads: int | None = None  # onnxruntime: threads of the process-wide pool (None: its default, the physical cores)
    kv_blocks: int = 0  # KV blocks (full-attention layers and drafter); 0: max_batch full-length requests
    block_size: int = BLOCK_SIZE  # positions per KV block
    prefix_caching: bool = True  # reuse the KV of cached prompt prefixes (peagle_trt/runtime/blocks.py)
    max_grammar_bytes: int = MAX_GRAMMAR_BYTES  # structured output: largest grammar a request may send
    grammar_timeout_s: float = GRAMMAR_TIMEOUT_S  # structured output: longest compile before a refusal
    # row- and batch-invariant forwards (peagle_trt/ops/deterministic.py; torch, onnxruntime)
    deterministic: bool = False
    cuda_graphs: bool = True  # torch backend on CUDA: forwards replayed as CUDA graphs (peagle_trt/executors/graphs.py)
    kv_cache_dtype: str = "auto"  # what the KV caches store: the model's dtype | fp8 (E4M3; config.KV_CACHE_DTYPES)

    def __post_init__(self):
        if self.backend not in BACKENDS:
            raise BuildError(f"backend {self.backend!r} is not available yet; choose from {BACKENDS}")
        if self.kernels not in KERNELS:
            raise BuildError(f"kernels {self.kernels!r} is not one of {KERNELS}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise BuildError(f"kv_cache_dtype {self.kv_cache_dtype!r} is not one of {KV_CACHE_DTYPES}: auto stores "
                             "the model's dtype, fp8 E4M3 codes (--kv-cache-dtype)")
        if self.kernels == "cuda" and (self.backend != "torch" or not self.device.startswith("cuda")):
            raise BuildError(f"kernels='cuda' runs the torch backend's custom ops on the Triton kernels: it "
                             f"needs --backend torch --device cuda (got backend {self.backend!r}, device "
                             f"{self.device!r}); the tensorrt backend always uses them (as plugins)")
        if self.deterministic and self.backend == "tensorrt":
            raise BuildError(TENSORRT_NOT_DETERMINISTIC)
        if self.deterministic and self.kernels == "cuda":
            raise BuildError("deterministic mode runs the torch backend's custom ops row by row in torch; the Triton "
                             "kernels (kernels='cuda') are not batch-invariant there: use kernels='reference'")
        if self.max_batch < 1 or self.max_seq_len < 2 or self.prefill_chunk < 1 or self.block_size < 1:
            raise BuildError("max_batch, max_seq_len, prefill_chunk and block_size must be positive")
        if self.kv_blocks and self.kv_blocks < self.kv_layout.max_blocks:
            raise BuildError(f"kv_blocks {self.kv_blocks} cannot hold one request of max_seq_len {self.max_seq_len} "
                             f"(it needs {self.kv_layout.max_blocks} blocks of {self.block_size}); raise it")
        if (self.max_prompt_bytes is not None and self.max_prompt_bytes < 1) or \
                (self.max_stop_bytes is not None and self.max_stop_bytes < 0):
            raise BuildError(f"max_prompt_bytes must be >= 1 and max_stop_bytes >= 0, got "
                             f"{self.max_prompt_bytes}, {self.max_stop_bytes}")
        if self.max_grammar_bytes < 1 or not self.grammar_timeout_s > 0:
            raise BuildError(f"max_grammar_bytes and grammar_timeout_s must be positive, got "
                             f"{self.max_grammar_bytes}, {self.grammar_timeout_s}")

    def input_limits(self) -> dict[str, int]:
        """The byte limits the served model enforces (config.pbtxt parameters)."""
        return {"max_prompt_bytes": self.max_prompt_bytes or PROMPT_BYTES_PER_TOKEN * self.max_seq_len,
                "max_stop_bytes": MAX_STOP_BYTES if self.max_stop_bytes is None else self.max_stop_bytes}

    @property
    def max_rows(self) -> int:
        """Most rows of one request in a target forward: a prefill chunk or a verify window."""
        return max(self.prefill_chunk, self.speculation.max_nodes + 1)

    @property
    def kv_layout(self) -> KVLayout:
        """The paged KV cache: positions per request = max_seq_len + a verify's rows as headroom (K + 1,
        or a draft tree's nodes + 1)."""
        max_len = self.max_seq_len + self.speculation.max_nodes + 1
        if not self.kv_blocks:
            return KVLayout.for_sequences(self.max_batch, max_len, self.block_size, max_rows=self.max_rows,
                                          cache_dtype=self.kv_cache_dtype)
        return KVLayout(self.kv_blocks, max_len, self.max_batch, self.block_size, self.max_rows, self.kv_cache_dtype)


@dataclass(frozen=True)
class ArtifactPaths:
    """Where the served model's files are, relative to the version directory (or absolute).
    torch backend: the checkpoints; onnxruntime / tensorrt: the tokenizer files in `target`."""
    target: str
    drafter: str = ""  # "" when there is none (spec mode none, or an exported drafter)
    onnx: str = ""
    engine: str = ""


# option field -> parameter key, where they differ (the keys are the template's since the start)
_RENAMED = {"speculation": None, "model_name": None}
_OPTIONAL_INTS = ("max_prompt_bytes", "max_stop_bytes", "threads")


def to_parameters(options: RepositoryOptions, paths: ArtifactPaths) -> dict[str, str]:
    """config.pbtxt `parameters` (all strings): every option but the model's name (the config's
    `name`), with the input limits resolved, plus the artifact paths."""
    spec = options.speculation
    params = {"spec_mode": spec.mode, "num_spec_tokens": str(spec.num_spec_tokens),  # run-time keys: quote-free
              "k_schedule": " ".join(f"{lo}-{hi}:{k}" for lo, hi, k in spec.k_schedule),
              "adaptive_k": str(spec.adaptive), "synthetic_rates": " ".join(repr(r) for r in spec.synthetic_rates),
              # draft trees: the budget, its schedule, a static tree's rank paths ("0 1 0.0": ranks joined by ".")
              "tree_budget": str(spec.tree_budget),
              "tree_schedule": " ".join(f"{lo}-{hi}:{b}" for lo, hi, b in spec.tree_schedule),
              "static_tree": " ".join(".".join(str(r) for r in path) for path in spec.static_tree)}
    for f in fields(options):
        if f.name in _RENAMED:
            continue
        value = getattr(options, f.name)
        params[f.name] = "" if value is None else str(value)
    params.update({k: str(v) for k, v in options.input_limits().items()})
    params.update({f"{f.name}_path": getattr(paths, f.name) for f in fields(paths)})
    return params


def from_parameters(params: Mapping[str, str],
                    model_name: str = "peagle") -> tuple[RepositoryOptions, ArtifactPaths]:
    """The inverse of `to_parameters`; ConfigError names a missing or malformed key."""
    def get(key: str, default: str | None = None) -> str:
        if key in params:
            return params[key]
        if default is None:
            raise ConfigError(f"config.pbtxt has no parameter {key!r}; rebuild the repository with "
                              "`peagle-trt build`")
        return default

    def integer(key: str, default: str | None = None) -> int:
        text = get(key, default)
        try:
            return int(text)
        except ValueError:
            raise ConfigError(f"config.pbtxt parameter {key!r} must be an integer, got {text!r}") from None

    values = {"model_name": model_name}
    for f in fields(RepositoryOptions):
        if f.name in _RENAMED or f.name not in params:
            continue  # an older repository without the key: the option's default
        if f.name in _OPTIONAL_INTS:
            values[f.name] = integer(f.name) if params[f.name] else None
        elif f.name in ("max_batch", "max_seq_len", "prefill_chunk", "kv_blocks", "block_size", "max_grammar_bytes"):
            values[f.name] = integer(f.name)
        elif f.name == "grammar_timeout_s":
            try:
                values[f.name] = float(params[f.name])
            except ValueError:
                raise ConfigError(f"config.pbtxt parameter {f.name!r} must be a number, got "
                                  f"{params[f.name]!r}") from None
        elif f.name in ("prefix_caching", "deterministic", "cuda_graphs"):
            values[f.name] = params[f.name] == "True"
        else:
            values[f.name] = None if f.name == "plugin_library" and not params[f.name] else params[f.name]
    try:
        schedule = tuple(tuple(int(x) for x in e.replace(":", "-").split("-")) for e in get("k_schedule", " ").split())
        rates = tuple(float(r) for r in get("synthetic_rates", " ").split())
        trees = tuple(tuple(int(x) for x in e.replace(":", "-").split("-")) for e in get("tree_schedule", " ").split())
        static = tuple(tuple(int(r) for r in path.split(".")) for path in get("static_tree", " ").split())
    except ValueError:
        raise ConfigError(f"config.pbtxt parameters k_schedule {params.get('k_schedule')!r} / synthetic_rates "
                          f"{params.get('synthetic_rates')!r} / tree_schedule / static_tree are malformed; "
                          "rebuild") from None
    spec = SpecConfig(get("spec_mode"), integer("num_spec_tokens"), schedule, get("adaptive_k", "False") == "True",
                      rates, integer("tree_budget", "0"), trees, static)
    try:
        options = RepositoryOptions(spec, **values)
    except BuildError as exc:
        raise ConfigError(f"config.pbtxt parameters: {exc}") from exc
    paths = ArtifactPaths(get("target_path"), get("drafter_path", ""), get("onnx_path", ""),
                          get("engine_path", ""))
    return options, paths


def with_deterministic(options: RepositoryOptions, asked: bool = False) -> RepositoryOptions:
    """`options` with deterministic mode on when it is `asked` (a --deterministic flag) or the
    environment says VLLM_BATCH_INVARIANT=1; otherwise as they are (a flag never turns it off).
    Raises ConfigError where the backend cannot be deterministic (tensorrt)."""
    env = os.environ.get(DETERMINISTIC_ENV, "").strip().lower()
    if env not in ("", "0", "1", "true", "false"):
        raise ConfigError(f"{DETERMINISTIC_ENV}={os.environ[DETERMINISTIC_ENV]!r}: expected 1 (on) or 0 (off)")
    if options.deterministic or not (asked or env in ("1", "true")):
        return options
    try:
        return dataclasses.replace(options, deterministic=True)
    except BuildError as exc:
        raise ConfigError(str(exc)) from exc


def serve_seed() -> int | None:
    """`serve --seed N` (vLLM's flag), passed to the served models as PEAGLE_SERVE_SEED: the seed
    from which requests that carry none get theirs (peagle_trt/serve/generator.py); None when unset."""
    text = os.environ.get(SEED_ENV, "").strip()
    if not text:
        return None
    try:
        return int(text)
    except ValueError as exc:
        raise ConfigError(f"{SEED_ENV}={text!r}: expected an integer (serve --seed)") from exc


def read_parameters(repo: str | Path, model: str = "peagle") -> tuple[Path, dict[str, str]]:
    """(model directory, its config.pbtxt parameters as written) of a rendered repository."""
    model_dir = Path(repo) / model
    config = model_dir / "config.pbtxt"
    if not config.is_file():
        raise ConfigError(f"{repo}: no model {model!r} (missing {config}); build the repository with "
                          "`peagle-trt build`")
    return model_dir, dict(_PARAM.findall(config.read_text()))


def read_options(repo: str | Path, model: str = "peagle") -> tuple[Path, RepositoryOptions, ArtifactPaths]:
    """(model directory, options, artifact paths) of a rendered repository."""
    model_dir, params = read_parameters(repo, model)
    return (model_dir, *from_parameters(params, model))
