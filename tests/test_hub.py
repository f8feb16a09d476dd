"""Hugging Face Hub ids, against a local stand-in for the hub (tests/hub_server.py).

Real names have dots ("Qwen/Qwen3-0.6B", "meta-llama/Llama-3.1-8B"): each loads through `hfjax.load`,
`hfjax.pipeline`, `hfjax.load_pipeline` and `hfjax serve`, and gives what the same checkpoint gives
from its local directory. The hub's refusals (no such repository, a gated one, no such revision, a
listed file it does not serve, offline mode) are one line naming the id.

In this process huggingface_hub is pointed at the stand-in by its constants (it reads HF_ENDPOINT
once, on import), with a cache of each test's own; the `hfjax serve` process gets HF_ENDPOINT and
HF_HOME in its environment, as a user sets them.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

import background
import hfjax
from hfjax import testing
from hub_server import Hub

httpx = pytest.importorskip("httpx", reason="httpx is a test dependency: pip install httpx")

QWEN, LLAMA = "Qwen/Qwen3-0.6B", "meta-llama/Llama-3.1-8B"
SHARDED, BROKEN, RESUMED, REVISED = "org/Sharded-1.5B", "org/Broken-0.5B", "org/Resumed-2.0", "org/Revised-1.1"
DIFFUSION = "hf-internal/tiny-sd-1.5"
TOKEN = "hf_right_token"
IDS = np.array([[1, 5, 9, 2, 7]])


@pytest.fixture(scope="module")
def local(tmp_path_factory):
    """The checkpoints the hub serves, as local directories."""
    root = tmp_path_factory.mktemp("hub-checkpoints")
    return {
        "qwen3": testing.save_tiny_checkpoint("qwen3", root / "qwen3"),
        "llama": testing.save_tiny_checkpoint("llama", root / "llama"),
        "sharded": testing.save_tiny_checkpoint("llama", root / "sharded", seed=1, max_shard_size="100KB"),
        "revised": testing.save_tiny_checkpoint("qwen3", root / "revised", seed=2),
    }


def _copy(folder: pathlib.Path, to: pathlib.Path, **extra: bytes) -> pathlib.Path:
    """`folder`'s files in `to`, with `extra` files (name: bytes) beside them."""
    to.mkdir()
    for path in folder.iterdir():
        (to / path.name).write_bytes(path.read_bytes())
    for name, data in extra.items():
        (to / name).write_bytes(data)
    return to


@pytest.fixture(scope="module")
def hub(local, tmp_path_factory):
    hub = Hub()
    root = tmp_path_factory.mktemp("hub-repositories")
    # Files the loader must not fetch beside the checkpoint: a README and PyTorch pickles.
    extra = {"README.md": b"# Qwen3, tiny\n", "pytorch_model.bin": b"not read"}
    hub.publish(QWEN, _copy(local["qwen3"], root / "qwen3", **extra))
    hub.publish(LLAMA, local["llama"], token=TOKEN)
    # A stray full copy beside the shards, as Mistral's repositories hold consolidated.safetensors.
    hub.publish(SHARDED, _copy(local["sharded"], root / "sharded", **{"consolidated.safetensors": b"\0" * 64}))
    hub.publish(BROKEN, local["qwen3"])
    hub.repos[BROKEN].unserved.add("model.safetensors")
    hub.publish(RESUMED, local["qwen3"])
    hub.publish(REVISED, local["qwen3"])
    hub.publish(REVISED, local["revised"], revision="v2.0")
    yield hub
    hub.close()


@pytest.fixture
def online(hub, tmp_path, monkeypatch):
    """huggingface_hub in this process pointed at the stand-in, with an empty cache and no token."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "ENDPOINT", hub.url)
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", hub.url + "/{repo_id}/resolve/{revision}/{filename}")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub-cache"))
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "no-token"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    for name in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    hub.requests.clear()
    return hub


def _logits(model) -> np.ndarray:
    return np.asarray(model(IDS).logits)


@pytest.fixture(scope="module")
def expected(local):
    """Logits of each local checkpoint, loaded from its directory."""
    return {name: _logits(hfjax.load(path)) for name, path in local.items()}


def _fetched(hub: Hub, repo_id: str) -> set[str]:
    return {
        r.path.split("/resolve/", 1)[1].split("/", 1)[1]
        for r in hub.requests
        if r.method == "GET" and "/resolve/" in r.path and r.path.startswith(f"/{repo_id}/")
    }


def test_ids_with_dots_load_as_their_local_directory_does(online, expected):
    model = hfjax.load(QWEN)
    np.testing.assert_array_equal(_logits(model), expected["qwen3"])
    assert model.tokenizer is not None and model.tokenizer.chat_template
    assert "models--Qwen--Qwen3-0.6B" in str(model.path)
    fetched = _fetched(online, QWEN)
    assert "model.safetensors" in fetched and "config.json" in fetched
    assert not fetched & {"README.md", "pytorch_model.bin"}, fetched


def test_a_sharded_checkpoint_loads_the_shards_its_index_names(online, expected):
    model = hfjax.load(SHARDED)
    np.testing.assert_array_equal(_logits(model), expected["sharded"])
    shards = {name for name in _fetched(online, SHARDED) if name.endswith(".safetensors")}
    assert len(shards) > 1 and "consolidated.safetensors" not in shards, shards


def test_a_gated_repository_needs_its_token(online, expected):
    for token in (None, "hf_wrong_token"):
        with pytest.raises(hfjax.LoadError) as error:
            hfjax.load(LLAMA, token=token)
        message = str(error.value)
        assert "\n" not in message and f"'{LLAMA}'" in message and "gated" in message, message
        assert "401" in message and "hf auth login" in message and "token=" in message, message
    model = hfjax.load(LLAMA, token=TOKEN)
    np.testing.assert_array_equal(_logits(model), expected["llama"])
    assert any(r.authorization == f"Bearer {TOKEN}" for r in online.requests)


def test_a_missing_repository_is_one_line_naming_it(online):
    with pytest.raises(hfjax.LoadError) as error:
        hfjax.load("Qwen/Qwen3-0.6B-Nonexistent")
    message = str(error.value)
    assert "\n" not in message and "'Qwen/Qwen3-0.6B-Nonexistent'" in message, message
    assert "404 RepoNotFound" in message and "no repository" in message, message


def test_a_missing_revision_is_one_line_naming_it(online):
    with pytest.raises(hfjax.LoadError) as error:
        hfjax.load(QWEN, revision="v9.9")
    message = str(error.value)
    assert "\n" not in message and f"'{QWEN}'" in message and "'v9.9'" in message and "404" in message, message


def test_a_listed_file_the_hub_does_not_serve_is_named(online):
    with pytest.raises(hfjax.LoadError) as error:
        hfjax.load(BROKEN)
    message = str(error.value)
    assert "\n" not in message and f"'{BROKEN}'" in message and "'model.safetensors'" in message, message
    assert "404 EntryNotFound" in message, message


@pytest.mark.parametrize("name", ["/no/such/Model-1.0", "./Model-1.0", "~/Model-1.0", "org/name/Model-1.0", "a--b"])
def test_what_is_no_hub_id_is_a_local_path_error_that_asks_no_hub(online, name):
    with pytest.raises(hfjax.LoadError, match=r"no checkpoint directory at '.*'; pass an existing local path"):
        hfjax.load(name)
    assert online.requests == []


def test_an_interrupted_download_resumes_from_where_it_stopped(online, expected, monkeypatch):
    from huggingface_hub import constants

    # Chunks smaller than the file, so that some of it is written before the cut.
    monkeypatch.setattr(constants, "DOWNLOAD_CHUNK_SIZE", 64 * 1024)
    cut = 300_000
    online.cut(RESUMED, "model.safetensors", after=cut)
    model = hfjax.load(RESUMED)
    np.testing.assert_array_equal(_logits(model), expected["qwen3"])
    gets = [r for r in online.requests if r.method == "GET" and r.path.endswith("/model.safetensors")]
    resumed = [r for r in gets[1:] if r.range]
    assert gets[0].range is None and resumed, gets
    start = int(resumed[0].range.removeprefix("bytes=").split("-")[0])
    assert 0 < start <= cut, resumed[0]


def test_revision_picks_that_commits_files(online, expected):
    np.testing.assert_array_equal(_logits(hfjax.load(REVISED)), expected["qwen3"])
    np.testing.assert_array_equal(_logits(hfjax.load(REVISED, revision="v2.0")), expected["revised"])
    commit = online.repos[REVISED].refs["v2.0"]
    model = hfjax.load(REVISED, revision=commit)
    np.testing.assert_array_equal(_logits(model), expected["revised"])
    assert model.path.name == commit


def test_offline_reads_the_cache_or_says_the_hub_could_not_be_reached(online, expected, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(hfjax.LoadError) as error:
        hfjax.load(QWEN)
    message = str(error.value)
    assert "\n" not in message and f"'{QWEN}'" in message, message
    assert "could not be reached" in message and "HF_HUB_OFFLINE=1" in message, message
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    hfjax.bridge.resolve_checkpoint(QWEN)  # the cache, warmed
    online.requests.clear()
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    np.testing.assert_array_equal(_logits(hfjax.load(QWEN)), expected["qwen3"])
    assert online.requests == []


def test_the_text_generation_pipeline_takes_a_hub_id(online, local):
    prompt, settings = "The river ran", dict(max_new_tokens=5, do_sample=False)
    from_hub = hfjax.pipeline("text-generation", model=QWEN)(prompt, **settings)
    from_directory = hfjax.pipeline("text-generation", model=str(local["qwen3"]))(prompt, **settings)
    assert from_hub == from_directory
    assert from_hub[0]["generated_text"].startswith(prompt)
    with pytest.raises(hfjax.PipelineError, match=r"revision= and token= choose what a hub id downloads"):
        hfjax.pipeline("text-generation", model=hfjax.load(local["qwen3"]), revision="v2.0")


def test_load_pipeline_takes_a_hub_id_and_fetches_no_weight_variants(online, tmp_path):
    pytest.importorskip("diffusers")
    path = testing.save_tiny_pipeline("stable-diffusion", tmp_path / "tiny-sd")
    (path / "unet" / "diffusion_pytorch_model.fp16.safetensors").write_bytes(b"\0" * 64)  # a variant
    online.publish(DIFFUSION, path)
    inputs = dict(prompt="a red cat", num_inference_steps=2, height=32, width=32, output_type="np")

    def image(pipe):
        import torch

        pipe.set_progress_bar_config(disable=True)
        return pipe(**inputs, generator=torch.Generator().manual_seed(0)).images

    from_hub = image(hfjax.load_pipeline(DIFFUSION))
    np.testing.assert_array_equal(from_hub, image(hfjax.load_pipeline(path)))
    fetched = _fetched(online, DIFFUSION)
    assert {"model_index.json", "unet/diffusion_pytorch_model.safetensors", "vae/config.json"} <= fetched, fetched
    assert "unet/diffusion_pytorch_model.fp16.safetensors" not in fetched


def test_hfjax_serve_takes_a_hub_id_with_dots(hub, local, tmp_path):
    port = background.free_port()
    environment = {
        **os.environ,
        "HF_ENDPOINT": hub.url,
        "HF_HOME": str(tmp_path / "hf-home"),
        "PYTHONPATH": os.pathsep.join(sys.path),
        "OMP_WAIT_POLICY": "PASSIVE",
    }
    for name in ("HF_HUB_CACHE", "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_HUB_OFFLINE"):
        environment.pop(name, None)
    log = tmp_path / "serve.log"
    with open(log, "w") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "hfjax.cli", "serve", QWEN, "--port", str(port), "--max-model-len", "64"],
            stdout=out, stderr=subprocess.STDOUT, env=environment,
        )  # fmt: skip
    try:
        url = background.wait_until_healthy(process, f"http://127.0.0.1:{port}", log, name="hfjax serve")
        prompt = "The river ran"
        answer = httpx.post(
            url + "/v1/completions",
            json={"model": QWEN, "prompt": prompt, "max_tokens": 5, "temperature": 0},
            timeout=120,
        )
        assert answer.status_code == 200, answer.text
        want = hfjax.load(local["qwen3"]).generate_text(prompt, max_new_tokens=5, do_sample=False)
        assert answer.json()["choices"][0]["text"] == want
    finally:
        process.kill()
        process.wait()
