"""A Hugging Face checkpoint served as it is: a Mixtral built with transformers' own classes, served by a real
uvicorn straight from its directory and from the hub cache's layout (a model id, no network), exported once into
a cache keyed by its content, its greedy tokens those of transformers' `generate`."""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

import openai
import pytest
import torch

from moe_serve import LLM, SamplingParams
from moe_serve.errors import ArtifactError
from moe_serve.exporters.hf_cache import DIGESTS_FILE, cache_dir, servable_artifact
from moe_serve.server.settings import ServerSettings
from moe_serve.tokenizer import Tokenizer
from tests.exporters.hf_models import MODELS, save_hf_model
from tests.server.conftest import start_server

MODEL_ID = "acme/tiny-mixtral"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return save_hf_model("mixtral", tmp_path_factory.mktemp("hf") / "mixtral-hf", seed=5, overrides={"vocab_size": 257})


@pytest.fixture
def caches(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("MOE_SERVE_HF_CACHE", str(tmp_path / "moe-serve-hf"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    return tmp_path / "hub"


def hub_layout(checkpoint: Path, hub: Path, model_id: str = MODEL_ID, revision: str = "0" * 40) -> Path:
    """The checkpoint as huggingface_hub caches it: blobs named by content, a snapshot of links, refs/main."""
    repo = hub / ("models--" + model_id.replace("/", "--"))
    (repo / "blobs").mkdir(parents=True)
    snapshot = repo / "snapshots" / revision
    snapshot.mkdir(parents=True)
    for path in checkpoint.iterdir():
        blob = repo / "blobs" / hashlib.sha256(path.read_bytes()).hexdigest()
        shutil.copyfile(path, blob)
        (snapshot / path.name).symlink_to(os.path.relpath(blob, snapshot))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    return snapshot


def generate_ids(checkpoint: Path, prompt: list[int], n: int) -> list[int]:
    model = MODELS["mixtral"][0].from_pretrained(checkpoint).eval()
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n, do_sample=False
        )
    return out[0, len(prompt) :].tolist()


def test_a_directory_is_exported_once_into_a_cache_keyed_by_its_content(checkpoint, caches, tmp_path) -> None:
    first = servable_artifact(checkpoint, progress=False)
    assert Path(first).parent.parent == cache_dir() and Path(first).name == "mixtral-hf"
    digests = cache_dir() / DIGESTS_FILE
    stamp = digests.stat().st_mtime_ns
    assert servable_artifact(checkpoint, progress=False) == first and digests.stat().st_mtime_ns == stamp  # no rehash
    changed = tmp_path / "mixtral-hf"
    shutil.copytree(checkpoint, changed)
    (changed / "generation_config.json").write_text('{"do_sample": false}')  # another file: another checkpoint
    assert Path(servable_artifact(changed, progress=False)).parent != Path(first).parent
    prompt = [3, 14, 15, 92, 65, 35]
    ours = LLM(first).generate([prompt], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0]
    assert ours.outputs[0].token_ids == generate_ids(checkpoint, prompt, 12)


def test_served_from_its_directory_and_by_model_id_from_the_hub_cache(checkpoint, caches) -> None:
    hub_layout(checkpoint, caches)
    prompt = [3, 14, 15, 92, 65, 35]
    expected = Tokenizer.from_file(checkpoint / "tokenizer.json").decode(generate_ids(checkpoint, prompt, 12))
    for model, name in [(str(checkpoint), "mixtral-hf"), (MODEL_ID, "tiny-mixtral")]:
        running = start_server(ServerSettings(models=(model,)))
        try:
            client = openai.OpenAI(base_url=running.url + "/v1", api_key="unused")
            assert [m.id for m in client.models.list().data][0] == name
            completion = client.completions.create(
                model=name, prompt=prompt, max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
            )
            assert completion.choices[0].text == expected
        finally:
            running.stop()


def test_what_is_neither_an_artifact_nor_a_checkpoint_names_both_commands(tmp_path, caches) -> None:
    (tmp_path / "odd").mkdir()
    (tmp_path / "odd" / "config.json").write_text('{"hello": 1}')
    with pytest.raises(ArtifactError, match=r"moe-serve export FORMAT SRC DST.*moe-serve serve DIR"):
        LLM(tmp_path / "odd")
    with pytest.raises(ArtifactError, match="no Hugging Face checkpoint of that id in the local hub cache"):
        LLM("acme/absent")
