"""Models by Hugging Face hub id, wherever a model directory goes: `--target`, `--drafter`, the
speculative config's "model", `serve MODEL`, `train --target`, `demo`, `bench --target`, ...

    path = resolve("amazon/gpt-oss-120b-p-eagle", what="--drafter")   # the snapshot folder in the cache
    path = resolve("openai/gpt-oss-120b@main")                         # a branch, tag or commit
    path = resolve("tests/data/code-pair")                             # an existing path: itself

Why: every serving stack a user knows (vLLM, SGLang, trtllm-serve, transformers) takes a hub id
where a model goes and resolves it into the standard cache; this module is the one code path every
verb uses for that. Rules:

* A string that is an existing path is that path. One that is not, and reads `org/name` (an
  optional `@revision`), is a hub id; anything else is left as a path (the loaders then say what
  is missing there).
* Only what peagle-trt reads is fetched (`FETCHED`: config, safetensors and their index, tokenizer
  files, generation config), from the repository's top level (`IGNORED`: sub-folders such as
  gpt-oss's `original/` and `metal/` are never fetched), with a progress bar on stderr, into
  huggingface_hub's cache: $HF_HUB_CACHE, else $HF_HOME/hub, else ~/.cache/huggingface/hub
  (`hub_cache`, read when called, as `HF_HUB_OFFLINE`, `HF_TOKEN` and `HF_ENDPOINT` are).
* Offline (`HF_HUB_OFFLINE=1`, or no network) a cached model resolves without a request; a missing
  one is a `HubError` naming the id, the cache and the command that fetches it. Gated or private
  repositories without a token say that no token is set. A revision that does not exist says so.
* Never remote code (nothing here imports a repository's Python), safetensors only: a repository
  whose weights are pickled (`*.bin`, `*.pt`, ...) is refused with the reason.

What is resolved, where it is cached and what each error means: docs/CHECKPOINTS.md, "Models by
hub id". Tested by tests/test_hub.py (an offline cache laid out as huggingface_hub lays it).
"""

from __future__ import annotations

import logging
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from peagle_trt.errors import HubError

log = logging.getLogger(__name__)

# what peagle-trt reads of a model repository (build/repository.py copies the same files)
FETCHED = ("config.json", "generation_config.json", "hf_quant_config.json", "*.safetensors",
           "*.safetensors.index.json", "tokenizer.json", "tokenizer_config.json", "tokenizer.model",
           "special_tokens_map.json", "added_tokens.json", "vocab.json", "merges.txt", "chat_template.jinja",
           "chat_template.json")
IGNORED = ("*/*",)  # the top level only: fnmatch's * crosses "/", so sub-folders are excluded by name
PICKLED = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
_ID = re.compile(r"(?P<repo>[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*)(?:@(?P<revision>[\w.][\w./-]*))?")
_TRUE = ("1", "true", "yes", "on")


@dataclass(frozen=True)
class HubRef:
    repo_id: str  # org/name
    revision: str | None = None  # branch, tag or commit; None: main

    def __str__(self) -> str:
        return self.repo_id + (f"@{self.revision}" if self.revision else "")


def parse_id(text: str | Path | None) -> HubRef | None:
    """The hub id `text` names, or None (an existing path, or not of the form org/name[@rev])."""
    if text is None or Path(str(text)).expanduser().exists():
        return None
    match = _ID.fullmatch(str(text))
    return HubRef(match["repo"], match["revision"]) if match else None


def hub_cache() -> Path:
    """huggingface_hub's cache folder as the environment sets it now."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or Path(os.environ.get("XDG_CACHE_HOME") or "~/.cache") / "huggingface"
    return Path(home).expanduser() / "hub"


def offline() -> bool:
    return any(os.environ.get(k, "").strip().lower() in _TRUE for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def resolve(text: str | Path, *, revision: str | None = None, what: str = "model") -> Path:
    """The local directory of `text`: an existing path as is; a hub id (`org/name[@rev]`, or
    `revision=`) resolved into the cache (fetched when missing and online); anything else as a Path.
    `what` names the flag in errors (e.g. "--drafter")."""
    ref = parse_id(text)
    if ref is None:
        if revision and Path(str(text)).expanduser().exists():
            raise HubError(f"{what} {text}: a revision ({revision!r}) applies to hub ids, and {text} is a local "
                           "path; drop the revision or name the model by its hub id")
        return Path(str(text)).expanduser()
    if revision and ref.revision and revision != ref.revision:
        raise HubError(f"{what} {text}: revision {ref.revision!r} in the id contradicts revision {revision!r}; "
                       "give one of them")
    ref = HubRef(ref.repo_id, ref.revision or revision)
    path = _snapshot(ref, what)
    log.info("%s %s -> %s", what, ref, path)
    return check_snapshot(path, ref, what)


def fetch_hint(ref: HubRef) -> str:
    rev = f" --revision {ref.revision}" if ref.revision else ""
    return (f"fetch it once with network access (HF_HUB_OFFLINE unset), or with huggingface_hub's CLI: "
            f"HF_HUB_CACHE={hub_cache()} hf download {ref.repo_id}{rev}")


def _token_state() -> str:
    from huggingface_hub import get_token

    if get_token() is None:
        return ("no Hugging Face token is set (HF_TOKEN is unset and `hf auth login` has stored none): "
                "set HF_TOKEN to a token with access")
    return "the token in use (HF_TOKEN or `hf auth login`) has no access to it: use one that has"


def _snapshot(ref: HubRef, what: str) -> Path:
    """snapshot_download of the files peagle-trt reads; huggingface_hub's errors as HubError."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        HFValidationError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )
    from tqdm.auto import tqdm

    cache, is_offline = hub_cache(), offline()
    where = f"{what} {ref}"
    if not is_offline:
        print(f"[hub] {ref}: config, tokenizer and safetensors weights into {cache} (reused when cached)",
              file=sys.stderr, flush=True)
    try:
        return Path(snapshot_download(ref.repo_id, revision=ref.revision, cache_dir=cache,
                                      local_files_only=is_offline, allow_patterns=list(FETCHED),
                                      ignore_patterns=list(IGNORED), endpoint=os.environ.get("HF_ENDPOINT") or None,
                                      tqdm_class=tqdm))
    except HFValidationError as exc:
        raise HubError(f"{where}: not a valid hub id ({exc}); name a model as org/name, optionally "
                       "org/name@revision, or pass an existing directory") from exc
    except GatedRepoError as exc:
        raise HubError(f"{where}: the repository is gated: accept its terms on "
                       f"https://huggingface.co/{ref.repo_id}, and {_token_state()}") from exc
    except RevisionNotFoundError as exc:
        raise HubError(f"{where}: revision {ref.revision!r} does not exist in {ref.repo_id}; use a branch, "
                       "tag or commit of it (default main)") from exc
    except RepositoryNotFoundError as exc:
        raise HubError(f"{where}: no such model repository on the Hub, or it is private and {_token_state()}; "
                       f"it is not a local directory either") from exc
    except LocalEntryNotFoundError as exc:
        why = ("HF_HUB_OFFLINE is set" if is_offline else "the Hub could not be reached")
        raise HubError(f"{where}: not in the Hugging Face cache {cache} and {why}; it is not a local "
                       f"directory either. {fetch_hint(ref)}") from exc
    except HfHubHTTPError as exc:
        raise HubError(f"{where}: the Hub refused the request ({exc}); retry, or {fetch_hint(ref)}") from exc


def check_snapshot(path: Path, ref: HubRef, what: str) -> Path:
    """`path` when it holds a model peagle-trt can read: config.json and safetensors weights (an
    index's shards all present); HubError otherwise (pickled weights refused with the reason)."""
    where = f"{what} {ref} ({path})"
    if not (path / "config.json").is_file():
        raise HubError(f"{where}: no config.json at the repository's top level; peagle-trt reads Hugging Face "
                       "model repositories (config.json + safetensors)")
    if not any(path.glob("*.safetensors")):
        pickled = sorted({p.name for p in path.iterdir() if p.suffix in PICKLED} | set(_remote_pickles(ref)))
        if pickled:
            raise HubError(f"{where}: its weights are pickled ({', '.join(pickled[:3])}), and peagle-trt loads "
                           "safetensors only (a pickle can run code when loaded); use a safetensors revision of "
                           "the model, or convert it where you trust the code: "
                           "model.save_pretrained(DIR, safe_serialization=True)")
        raise HubError(f"{where}: no safetensors weights at the repository's top level; {fetch_hint(ref)}")
    index = path / "model.safetensors.index.json"
    if index.is_file():
        import json

        try:
            shards = set(json.loads(index.read_text())["weight_map"].values())
        except (ValueError, KeyError, TypeError) as exc:
            raise HubError(f"{where}: {index.name} is not a safetensors index ({exc}); fetch it again") from exc
        missing = sorted(s for s in shards if not (path / s).is_file())
        if missing:
            raise HubError(f"{where}: the cached snapshot lacks {len(missing)} weight shard(s) ({missing[0]}, ...): "
                           f"an interrupted download; {fetch_hint(ref)}")
    return path


def _remote_pickles(ref: HubRef) -> list[str]:
    """Pickled weight files at the repository's top level, as the Hub lists them (nothing offline:
    the cache then holds only what was fetched)."""
    if offline():
        return []
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HfHubHTTPError

    try:
        files = HfApi(endpoint=os.environ.get("HF_ENDPOINT") or None).list_repo_files(ref.repo_id,
                                                                                     revision=ref.revision)
    except (HfHubHTTPError, OSError) as exc:  # the listing only names the files in the error
        log.info("could not list %s: %s", ref, exc)
        return []
    return [f for f in files if "/" not in f and f.endswith(PICKLED)]
