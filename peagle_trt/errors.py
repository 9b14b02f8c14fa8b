"""Typed, actionable errors: every message says what was expected, what was found, and the fix.

Only `peagle_trt.cli` catches broad exceptions; library code raises one of these.
"""


class PeagleError(Exception):
    """Base class of every error peagle-trt raises on purpose."""


class ConfigError(PeagleError):
    """A configuration (config.json, CLI flags, speculative config) is missing a key or is invalid."""


class CheckpointError(PeagleError):
    """A checkpoint's weight files are missing, truncated, corrupt or have unexpected tensors."""


class RequestError(PeagleError):
    """One request cannot be served as sent: empty, malformed or over a limit (prompt or stop-string
    bytes, prompt + max_tokens beyond the model's sequence length), or the request queue is full.
    Nothing was queued; other requests are not affected."""


class PairingError(ConfigError):
    """The target and the drafter do not fit together (hidden size, vocabulary, taps, mask token)."""


class OpInputError(PeagleError, ValueError):
    """A custom op (peagle_trt/ops) got inputs outside its contract: a shape, dtype, scale kind or
    option it does not take. Also a ValueError, so callers of the kernels catching that keep working."""


class RuntimeInvariantError(PeagleError):
    """An internal invariant of the runtime broke (a bug, never bad user input)."""


class BuildError(PeagleError):
    """A build/package step failed (unwritable output, missing template, ...); nothing was left behind."""


class HubError(PeagleError):
    """A model named by its Hugging Face hub id cannot be used: not in the cache while offline (or
    with no network), gated or private without a token, not found, a revision that does not exist,
    or a repository without safetensors weights (peagle_trt/hub.py)."""


class ConvertError(PeagleError):
    """A model file cannot be converted (missing, not GGUF, an architecture the project cannot load)."""


class ManifestError(PeagleError):
    """An artifact directory does not match its manifest.json (edited, truncated or mixed files)."""


class TransferError(PeagleError):
    """A file sent in parts (to or from a GPU machine) is incomplete or damaged: a part is missing,
    or a part's or the whole file's sha256 differs from its manifest."""


class ServeError(PeagleError):
    """The inference server could not be started or did not become ready."""


class PortInUseError(ServeError):
    """A port the server should listen on is held by another process."""


class RemoteError(ServeError):
    """The server refused or failed one request; `status` is its gRPC status name (e.g. INVALID_ARG)."""

    def __init__(self, message: str, status: str = ""):
        super().__init__(message)
        self.status = status
