"""Corrupted artifacts, by class: every copy either fails to load with one clear error (no
traceback, no hang, nothing allocated from absurd sizes) or loads and then serves every endpoint it has.
Nothing loads and then fails."""

from __future__ import annotations

import copy
import json
import shutil
import struct
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from moe_serve import LLM, SamplingParams
from moe_serve.api import protocol as p
from moe_serve.api.prepare import render_chat
from moe_serve.artifact import CONFIG_FILE, TOKENIZER_FILE, WEIGHTS_FILE, load_artifact, sha256_file
from moe_serve.cli import main
from moe_serve.errors import MoEServeError
from moe_serve.quality import QUALITY_FILE

TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
Mutation = Callable[[Path], None]


def edit_model(change: Callable[[dict], None]) -> Mutation:
    def mutate(path: Path) -> None:
        manifest = json.loads((path / CONFIG_FILE).read_text())
        change(manifest["model"])
        (path / CONFIG_FILE).write_text(json.dumps(manifest))

    return mutate


def set_field(dotted: str, value) -> Mutation:
    *parents, name = dotted.split(".")

    def change(model: dict) -> None:
        for part in parents:
            model = model[part]
        model[name] = copy.deepcopy(value)

    return edit_model(change)


def edit_manifest(change: Callable[[dict], None]) -> Mutation:
    def mutate(path: Path) -> None:
        manifest = json.loads((path / CONFIG_FILE).read_text())
        change(manifest)
        (path / CONFIG_FILE).write_text(json.dumps(manifest))

    return mutate


def write(name: str, data: bytes | str) -> Mutation:
    def mutate(path: Path) -> None:
        (path / name).write_bytes(data.encode() if isinstance(data, str) else data)
        reseal(path)

    return mutate


def reseal(path: Path) -> None:
    """Record the files' current checksums, so that a mutation is tested past the checksum check."""
    try:
        manifest = json.loads((path / CONFIG_FILE).read_text())
    except (ValueError, RecursionError):  # the mutation broke the manifest itself: nothing to reseal
        return
    if isinstance(manifest, dict) and isinstance(manifest.get("checksums"), dict):
        for name in (WEIGHTS_FILE, TOKENIZER_FILE):
            if (path / name).is_file():
                manifest["checksums"][name] = sha256_file(path / name)
        (path / CONFIG_FILE).write_text(json.dumps(manifest))


def edit_tensors(change: Callable[[dict[str, torch.Tensor]], None]) -> Mutation:
    def mutate(path: Path) -> None:
        tensors = load_file(str(path / WEIGHTS_FILE))
        change(tensors)
        save_file(tensors, str(path / WEIGHTS_FILE))
        reseal(path)

    return mutate


def truncate(name: str, keep: float) -> Mutation:
    def mutate(path: Path) -> None:
        data = (path / name).read_bytes()
        (path / name).write_bytes(data[: int(len(data) * keep)])
        reseal(path)

    return mutate


def first_tensor(change: Callable[[torch.Tensor], torch.Tensor]) -> Mutation:
    def apply(tensors: dict[str, torch.Tensor]) -> None:
        name = sorted(tensors)[0]
        tensors[name] = change(tensors[name])

    return edit_tensors(apply)


def with_nan(t: torch.Tensor) -> torch.Tensor:
    t = t.clone()
    t.view(-1)[0] = float("nan")
    return t


WORDLEVEL_WITHOUT_UNK = json.dumps(
    {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [],
        "normalizer": None,
        "pre_tokenizer": {"type": "Whitespace"},
        "post_processor": None,
        "decoder": None,
        "model": {"type": "WordLevel", "vocab": {"hello": 0, "world": 1}, "unk_token": None},
    }
)

ROW = '{"results": [{"dataset": "d", "metric": "m", "k": 2, "value": VALUE}]}'

# Wrong types and absurd values, for every kind of field.
FIELD_VALUES = {
    "string": "x",
    "null": None,
    "list": [1, 2],
    "object": {"a": 1},
    "float": 1e9,
    "negative": -1,
    "zero": 0,
    "bool": True,
    "huge int": 10**12,
    "nan": float("nan"),
}
LM_FIELDS = [
    "task", "vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim", "ffn",
    "ffn.kind", "ffn.intermediate_size", "ffn.activation", "ffn.use_bias", "moe", "moe.num_experts", "moe.layers",
    "moe.expert", "moe.expert.intermediate_size", "moe.router", "moe.router.kind", "moe.router.normalize",
    "moe.experts_per_token", "moe.experts_per_token.default", "moe.experts_per_token.max", "attention_bias",
    "position", "max_position_embeddings", "rope_theta", "norm", "norm_eps", "norm_position", "final_norm",
    "embedding_scale", "tie_word_embeddings", "bos_token_id", "eos_token_id", "add_bos_token", "chat_template",
    "chat_stop", "qkv_clip", "qk_norm",
]  # fmt: skip

CASES: dict[str, tuple[str, Mutation]] = {
    # config.json as a file
    "config not UTF-8": ("lm", write(CONFIG_FILE, b'{"format": "moe-serve", "x": "\xff\xfe"}')),
    "config not JSON": ("lm", write(CONFIG_FILE, "{format: moe-serve")),
    "config empty": ("lm", write(CONFIG_FILE, "")),
    "config a list": ("lm", write(CONFIG_FILE, "[1, 2]")),
    "config nested 100000 deep": ("lm", write(CONFIG_FILE, "[" * 100000 + "]" * 100000)),
    "config truncated": ("lm", truncate(CONFIG_FILE, 0.5)),
    "format wrong": ("lm", edit_manifest(lambda m: m.update(format="other"))),
    "format_version 2": ("lm", edit_manifest(lambda m: m.update(format_version=2))),
    "format_version string": ("lm", edit_manifest(lambda m: m.update(format_version="1"))),
    "model missing": ("lm", edit_manifest(lambda m: m.pop("model"))),
    "model a list": ("lm", edit_manifest(lambda m: m.update(model=[1]))),
    "checksums a list": ("lm", edit_manifest(lambda m: m.update(checksums=["a"]))),
    "checksums of numbers": ("lm", edit_manifest(lambda m: m.update(checksums={WEIGHTS_FILE: 5}))),
    "checksum mismatch": ("lm", edit_manifest(lambda m: m["checksums"].update({WEIGHTS_FILE: "0" * 64}))),
    "checksums missing": ("lm", edit_manifest(lambda m: m.pop("checksums"))),
    "provenance a string": ("lm", edit_manifest(lambda m: m.update(provenance="x"))),
    # the fields the measurements named
    "moe.layers 5": ("lm", set_field("moe.layers", 5)),
    "num_layers 1e9": ("lm", set_field("num_layers", 1e9)),
    "num_layers 10^9": ("lm", set_field("num_layers", 10**9)),
    "hidden_size 2^40": ("lm", set_field("hidden_size", 2**40)),
    "norm_eps 'x'": ("lm", set_field("norm_eps", "x")),
    "embedding_scale null": ("lm", set_field("embedding_scale", None)),
    "chat_template 5": ("lm", set_field("chat_template", 5)),
    "chat_template unparsable": ("lm", set_field("chat_template", "{% for %}")),
    "normalize 'false'": ("lm", set_field("moe.router.normalize", "false")),
    "integer labels": ("clf", set_field("classifier.labels", [1, 2, 3])),
    "duplicate labels": ("clf", set_field("classifier.labels", ["a", "a", "b"])),
    "empty label": ("clf", set_field("classifier.labels", ["", "b", "c"])),
    "labels a string": ("clf", set_field("classifier.labels", "abc")),
    "position relative, weights for rotary": ("lm", set_field("position", "relative")),
    # weights
    "weights truncated": ("lm", truncate(WEIGHTS_FILE, 0.6)),
    "weights header only": ("lm", truncate(WEIGHTS_FILE, 0.02)),
    "weights empty": ("lm", write(WEIGHTS_FILE, b"")),
    "weights header length absurd": ("lm", write(WEIGHTS_FILE, struct.pack("<Q", 2**62) + b"{}")),
    "weights header not JSON": ("lm", write(WEIGHTS_FILE, struct.pack("<Q", 4) + b"{{{{")),
    "NaN weight": ("lm", first_tensor(with_nan)),
    "infinite weight": ("lm", first_tensor(lambda t: t.clone().fill_(float("inf")))),
    "int32 weight": ("lm", first_tensor(lambda t: t.to(torch.int32))),
    "float64 weight": ("lm", first_tensor(lambda t: t.to(torch.float64))),
    "wrong shape": ("lm", first_tensor(lambda t: t[:1])),
    "tensor missing": ("lm", edit_tensors(lambda ts: ts.pop(sorted(ts)[0]))),
    "tensor extra": ("lm", edit_tensors(lambda ts: ts.update(extra=torch.zeros(2)))),
    "weights missing": ("lm", lambda path: (path / WEIGHTS_FILE).unlink()),
    "weights a directory": ("lm", lambda path: ((path / WEIGHTS_FILE).unlink(), (path / WEIGHTS_FILE).mkdir())),
    "float16 weights": ("lm", edit_tensors(lambda ts: ts.update({n: t.half() for n, t in ts.items()}))),
    # tokenizer
    "tokenizer not JSON": ("lm", write(TOKENIZER_FILE, "not json")),
    "tokenizer empty object": ("lm", write(TOKENIZER_FILE, "{}")),
    "tokenizer not UTF-8": ("lm", write(TOKENIZER_FILE, b"\xff\xfe\x00")),
    "WordLevel tokenizer without unk": ("lm", write(TOKENIZER_FILE, WORDLEVEL_WITHOUT_UNK)),
    "tokenizer missing": ("lm", lambda path: (path / TOKENIZER_FILE).unlink()),
    # quality.json
    "quality not JSON": ("lm", write(QUALITY_FILE, "{")),
    "quality results not a list": ("lm", write(QUALITY_FILE, '{"results": 5}')),
    "quality k a string": ("lm", write(QUALITY_FILE, '{"results": [{"dataset": "d", "metric": "m", "k": "2"}]}')),
    "quality value NaN": ("lm", write(QUALITY_FILE, ROW.replace("VALUE", "NaN"))),
    "quality value a string": ("lm", write(QUALITY_FILE, ROW.replace("VALUE", '"high"'))),
    "quality not UTF-8": ("lm", write(QUALITY_FILE, b"\xff")),
}  # fmt: skip
for _field in LM_FIELDS:
    for _kind, _value in FIELD_VALUES.items():
        CASES[f"{_field} = {_kind}"] = ("lm", set_field(_field, _value))
for _field in ("classifier", "classifier.labels", "classifier.pooling", "classifier.pooler_dense"):
    for _kind, _value in FIELD_VALUES.items():
        CASES[f"{_field} = {_kind}"] = ("clf", set_field(_field, _value))


@pytest.fixture(scope="module")
def pristine(tiny_model) -> dict[str, Path]:
    """The artifacts every corruption starts from: each test corrupts a copy of one."""
    return {"lm": tiny_model(seed=1, chat_template=TEMPLATE), "clf": tiny_model("classifier", seed=2)}


def serves(path: Path) -> None:
    """Everything the loaded artifact offers answers: generation, chat rendering and scoring, or
    classification."""
    llm = LLM(path)
    config = llm.engine.model_config
    if config.task == "causal_lm":
        (out,) = llm.generate(["Hello"], SamplingParams(max_tokens=3, ignore_eos=True))
        assert len(out.outputs[0].token_ids) == 3
        assert llm.score(["Hello there"])[0].num_tokens > 0
        if config.chat_template is not None:
            render_chat(llm.engine.inputs, [p.ChatMessage(role="user", content="hi")])
    else:
        assert llm.classify(["Hello there"])[0].label in config.classifier.labels  # type: ignore[union-attr]


@pytest.mark.slow
def test_every_corruption_fails_cleanly_or_serves(pristine, tmp_path: Path) -> None:
    outcomes: dict[str, str] = {}
    for name, (base, mutate) in CASES.items():
        path = tmp_path / f"case-{len(outcomes)}" / "model"
        shutil.copytree(pristine[base], path)
        mutate(path)
        started = time.monotonic()
        try:
            load_artifact(path)
        except MoEServeError as exc:
            message = str(exc)
            assert message and "Traceback" not in message and len(message) < 600, (name, message)
            outcomes[name] = "refused"
        except Exception as exc:  # noqa: BLE001  # the failure this test exists to catch
            pytest.fail(f"{name}: {type(exc).__name__} escaped the loader: {exc}")
        else:
            serves(path)  # any exception here fails the test: it loaded, so it must serve
            outcomes[name] = "serves"
        assert time.monotonic() - started < 20, f"{name} took too long"
    refused = {name for name, outcome in outcomes.items() if outcome == "refused"}
    named = [
        "config not UTF-8", "moe.layers 5", "checksums a list", "num_layers 1e9", "num_layers 10^9", "norm_eps 'x'",
        "embedding_scale null", "chat_template 5", "normalize 'false'", "integer labels", "NaN weight",
        "weights truncated", "WordLevel tokenizer without unk", "quality not JSON", "config nested 100000 deep",
    ]  # fmt: skip
    assert set(named) <= refused
    assert outcomes["float16 weights"] == "serves" and outcomes["provenance a string"] == "refused"
    assert len(outcomes) > 300


@pytest.mark.parametrize(
    "mutation,message",
    [
        (truncate(WEIGHTS_FILE, 0.6), "cannot read"),
        (first_tensor(with_nan), "NaN or infinite"),
        (write(TOKENIZER_FILE, WORDLEVEL_WITHOUT_UNK), "tokenizer.json cannot be used"),
        (set_field("num_layers", 10**9), "num_layers must be an integer between 1 and 1024"),
    ],
    ids=["truncated weights", "NaN weights", "tokenizer", "absurd size"],
)
def test_inspect_validates_what_serve_validates(pristine, tmp_path, capsys, mutation: Mutation, message: str) -> None:
    path = tmp_path / "model"
    shutil.copytree(pristine["lm"], path)
    mutation(path)
    assert main(["inspect", str(path)]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and err.count("\n") == 1
    assert main(["inspect", str(pristine["lm"])]) == 0
