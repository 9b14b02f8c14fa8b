"""Models by hub id (peagle_trt/hub.py) and the published heads (peagle_trt/published.py), through
huggingface_hub's real resolution path on a cache laid out as it lays it (tests/hub_layout.py),
offline: ids resolve without a request, every error names what to do, a published head builds by
name and refuses a target it was not trained for before anything is fetched. Downloads (only the
files peagle-trt reads), gated, private and unknown revisions are answered by a loopback stand-in
for the Hub (no network)."""

from __future__ import annotations

import hashlib
import json
import re
import threading
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from peagle_trt import hub, published
from peagle_trt.cli import main
from peagle_trt.errors import HubError
from tests.hub_layout import offline_hub, put_model


@pytest.fixture
def cache(tmp_path, monkeypatch):
    root = tmp_path / "hf-cache"
    root.mkdir()
    offline_hub(monkeypatch, root)
    return root


def _last_json(capsys) -> dict:
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_what_reads_as_a_hub_id(tmp_path):
    assert hub.parse_id("openai/gpt-oss-120b") == hub.HubRef("openai/gpt-oss-120b")
    assert hub.parse_id("amazon/gpt-oss-120b-p-eagle@refs/pr/1") == hub.HubRef("amazon/gpt-oss-120b-p-eagle",
                                                                                "refs/pr/1")
    (tmp_path / "org" / "name").mkdir(parents=True)
    assert hub.parse_id(tmp_path / "org" / "name") is None  # an existing path is a path
    for text in ("smollm2", "/abs/org/name", "a/b/c", "./org", None):
        assert hub.parse_id(text) is None


def test_a_cached_model_resolves_offline_by_id_branch_tag_and_commit(cache, tiny):
    snapshot = put_model(cache, "acme/tiny-llama", tiny["llama"], refs=("main", "v1"))
    assert hub.resolve("acme/tiny-llama") == snapshot
    assert hub.resolve("acme/tiny-llama@v1") == snapshot
    assert hub.resolve("acme/tiny-llama", revision=snapshot.name) == snapshot  # a commit hash
    assert (snapshot / "config.json").is_symlink()  # blobs + links, as huggingface_hub writes them
    assert hub.resolve(tiny["llama"]) == tiny["llama"]  # a directory is itself
    with pytest.raises(HubError, match="contradicts revision 'main'"):
        hub.resolve("acme/tiny-llama@v1", revision="main")


def test_a_missing_model_offline_names_the_id_the_cache_and_the_fetch(cache):
    with pytest.raises(HubError) as exc:
        hub.resolve("acme/absent", what="--target")
    message = str(exc.value)
    for part in ("--target acme/absent", str(cache), "HF_HUB_OFFLINE is set", "hf download acme/absent"):
        assert part in message


def test_pickled_weights_are_refused_with_the_reason(cache, tmp_path, tiny):
    src = tmp_path / "pickled"
    src.mkdir()
    (src / "config.json").write_text((tiny["llama"] / "config.json").read_text())
    (src / "pytorch_model.bin").write_bytes(b"not unpickled")
    put_model(cache, "acme/pickled", src)
    with pytest.raises(HubError, match=r"pickled \(pytorch_model.bin\).*safetensors only"):
        hub.resolve("acme/pickled")


def test_an_interrupted_download_says_so(cache, tmp_path, tiny):
    src = tmp_path / "sharded"
    src.mkdir()
    (src / "config.json").write_text((tiny["llama"] / "config.json").read_text())
    (src / "model-00001-of-00002.safetensors").write_bytes((tiny["llama"] / "model.safetensors").read_bytes())
    (src / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}))
    put_model(cache, "acme/sharded", src)
    with pytest.raises(HubError, match=r"lacks 1 weight shard\(s\) \(model-00002-of-00002.safetensors"):
        hub.resolve("acme/sharded")


def test_only_what_peagle_trt_reads_is_fetched():
    """gpt-oss-120b's files as the Hub lists them: the top-level model, never original/ or metal/."""
    from huggingface_hub.utils import filter_repo_objects

    listing = ["config.json", "generation_config.json", "chat_template.jinja", "tokenizer.json",
               "tokenizer_config.json", "special_tokens_map.json", "model.safetensors.index.json",
               "model-00000-of-00014.safetensors", "original/model--00001-of-00007.safetensors",
               "original/config.json", "metal/model.bin", "README.md", "LICENSE", "USAGE_POLICY",
               ".gitattributes", "pytorch_model.bin"]
    kept = sorted(filter_repo_objects(listing, allow_patterns=list(hub.FETCHED), ignore_patterns=list(hub.IGNORED)))
    assert kept == sorted(listing[:8])


class _Hub(BaseHTTPRequestHandler):
    """A loopback stand-in for the Hub: `server.answer` = (status, X-Error-Code) for every request,
    or else, for `server.repos` ({repo_id: folder}), the three endpoints a download reads (the
    revision's commit, the file tree, each file). Every path asked is kept in `server.seen`."""

    def do_GET(self):  # noqa: N802 (http.server's names)
        self._reply(body=True)

    def do_HEAD(self):  # noqa: N802
        self._reply(body=False)

    def _reply(self, body: bool):
        path = urllib.parse.urlparse(self.path).path
        self.server.seen.append(path)
        if self.server.answer is not None:
            status, code = self.server.answer
            return self._send(status, json.dumps({"error": code}).encode(), body, {"X-Error-Code": code})
        for pattern, handler in ((r"/api/models/([^/]+/[^/]+)/revision/([^/]+)", self._info),
                                 (r"/api/models/([^/]+/[^/]+)/tree/([^/]+)(?:/.*)?", self._tree),
                                 (r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", self._file)):
            match = re.fullmatch(pattern, path)
            if match and match[1] in self.server.repos:
                return handler(body, *match.groups())
        self._send(404, b'{"error": "not found"}', body, {"X-Error-Code": "RepoNotFound"})

    def _files(self, repo: str) -> dict[str, Path]:
        root = self.server.repos[repo]
        return {str(p.relative_to(root)): p for p in sorted(root.rglob("*")) if p.is_file()}

    def _commit(self, repo: str) -> str:
        return hashlib.sha1(repo.encode()).hexdigest()

    def _info(self, body, repo, _revision):
        info = {"id": repo, "sha": self._commit(repo), "siblings": [{"rfilename": f} for f in self._files(repo)]}
        self._send(200, json.dumps(info).encode(), body)

    def _tree(self, body, repo, _revision):
        tree = [{"type": "file", "path": f, "size": p.stat().st_size,
                 "oid": hashlib.sha1(p.read_bytes()).hexdigest()} for f, p in self._files(repo).items()]
        self._send(200, json.dumps(tree).encode(), body)

    def _file(self, body, repo, _revision, name):
        data = self._files(repo)[urllib.parse.unquote(name)].read_bytes()
        self._send(200, data, body, {"X-Repo-Commit": self._commit(repo), "Content-Type": "application/octet-stream",
                                     "ETag": f'"{hashlib.sha256(data).hexdigest()}"'})

    def _send(self, status: int, data: bytes, body: bool, headers: dict | None = None):
        self.send_response(status)
        for key, value in {"Content-Type": "application/json", **(headers or {})}.items():
            self.send_header(key, value)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if body:
            self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture
def stand_in_hub(cache, monkeypatch):
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Hub)
    server.answer, server.repos, server.seen = None, {}, []
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{server.server_port}")
    yield server
    server.shutdown()


def test_online_only_the_files_peagle_trt_reads_are_fetched(stand_in_hub, cache, tiny, tmp_path, capsys,
                                                             monkeypatch):
    repo = tmp_path / "published"
    (repo / "original").mkdir(parents=True)
    for f in tiny["llama"].iterdir():
        (repo / f.name).write_bytes(f.read_bytes())
    (repo / "original" / "model.safetensors").write_bytes(b"another layout")
    (repo / "README.md").write_text("card")
    (repo / "pytorch_model.bin").write_bytes(b"a pickle")
    stand_in_hub.repos["acme/tiny-llama"] = repo
    path = hub.resolve("acme/tiny-llama", what="--target")
    assert sorted(p.name for p in path.iterdir()) == sorted(f.name for f in tiny["llama"].iterdir())
    fetched = {p.rsplit("/", 1)[-1] for p in stand_in_hub.seen if "/resolve/" in p}
    assert fetched == {f.name for f in tiny["llama"].iterdir()}  # never README, the pickle or original/
    assert "acme/tiny-llama: config, tokenizer and safetensors weights into" in capsys.readouterr().err
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # now cached: resolved offline, without a request
    seen = len(stand_in_hub.seen)
    assert hub.resolve("acme/tiny-llama") == path and len(stand_in_hub.seen) == seen


@pytest.mark.parametrize("answer, expected", [
    ((401, "GatedRepo"), r"gated: accept its terms .*no Hugging Face token is set"),
    ((401, "RepoNotFound"), r"no such model repository on the Hub, or it is private and no Hugging Face token"),
    ((404, "RevisionNotFound"), r"revision 'v9' does not exist in acme/secret"),
])
def test_gated_private_and_unknown_revisions_say_what_to_do(stand_in_hub, answer, expected):
    stand_in_hub.answer = answer
    with pytest.raises(HubError, match=expected):
        hub.resolve("acme/secret@v9" if answer[1] == "RevisionNotFound" else "acme/secret", what="MODEL")


def test_published_heads_name_their_targets():
    head = published.published_head("AMAZON/gpt-oss-120b-p-eagle")  # ids are case-insensitive
    assert (head.trained_depth, head.card_k, published.default_target(head)) == (8, 5, "openai/gpt-oss-120b")
    coder = published.published_head("amazon/Qwen3-Coder-30B-A3B-Instruct-P-EAGLE")
    published.check_pairing(coder, "Qwen/Qwen3-Coder-30B-A3B-Instruct-FP8", None)  # trained on the FP8 one
    with pytest.raises(HubError, match="trained for openai/gpt-oss-120b, not openai/gpt-oss-20b"):
        published.check_pairing(head, "openai/gpt-oss-20b", None)
    with pytest.raises(HubError, match="the target is a 'llama' model"):
        published.check_pairing(head, None, "llama")
    assert published.published_head("acme/my-head") is None


def test_build_of_a_published_head_by_name_takes_its_target(cache, tiny_gpt_oss, tmp_path, capsys):
    target = put_model(cache, "openai/gpt-oss-120b", tiny_gpt_oss["target"])
    head = put_model(cache, "amazon/gpt-oss-120b-p-eagle", tiny_gpt_oss["drafter"])
    assert main(["build", "--drafter", "amazon/gpt-oss-120b-p-eagle", "--output", str(tmp_path / "repo"),
                 "--backend", "torch", "--max-batch", "1", "--max-seq-len", "64", "--num-spec-tokens", "3"]) == 0
    result = _last_json(capsys)
    assert (result["target"], result["drafter"], result["spec_mode"]) == (str(target), str(head), "peagle")


def test_a_head_with_another_target_is_refused_before_anything_is_fetched(cache, tiny, tmp_path, capsys):
    # neither model is cached: had anything been fetched first, the error would be "not in the cache"
    code = main(["build", "--target", "Qwen/Qwen3-8B", "--drafter", "amazon/GPT-OSS-20B-P-EAGLE",
                 "--output", str(tmp_path / "repo")])
    assert code == 2 and "trained for openai/gpt-oss-20b, not Qwen/Qwen3-8B" in _last_json(capsys)["error"]
    code = main(["build", "--target", str(tiny["llama"]), "--drafter", "amazon/GPT-OSS-20B-P-EAGLE",
                 "--output", str(tmp_path / "repo")])
    result = _last_json(capsys)
    assert code == 2 and result["error_type"] == "HubError" and "a 'llama' model" in result["error"]


def test_the_speculative_config_names_the_drafter_by_id_and_revision(cache, tiny, capsys):
    put_model(cache, "acme/tiny-llama", tiny["llama"])
    put_model(cache, "acme/tiny-head", tiny["aws"], refs=("v1",))
    config = json.dumps({"method": "eagle3", "model": "acme/tiny-head", "revision": "v1",
                         "num_speculative_tokens": 2, "parallel_drafting": True})
    assert main(["generate", "--target", "acme/tiny-llama", "--speculative-config", config, "--backend", "torch",
                 "--prompt", "hi", "--max-tokens", "4", "--ignore-eos", "--no-chat-template"]) == 0
    result = _last_json(capsys)
    assert result["spec_mode"] == "peagle" and len(result["token_ids"]) == 4
    config = config.replace('"v1"', '"v2"')
    assert main(["generate", "--target", "acme/tiny-llama", "--speculative-config", config, "--prompt", "hi"]) == 2
    assert "acme/tiny-head@v2" in _last_json(capsys)["error"]
