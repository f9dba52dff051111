"""The bundled demo models: present, small, trained (far better than chance), with their provenance."""

from __future__ import annotations

import json

import pytest

from moe_serve import LLM, SamplingParams
from moe_serve.evaluation.datasets.shakespeare import GENRES, passages, split
from moe_serve.registry import bundled_models, resolve_model
from recipes.build_demos import CLASSIFIERS, CONTROLS, LANGUAGE_MODELS


def provenance(name: str) -> dict:
    return json.loads((resolve_model(name) / "config.json").read_text())["provenance"]


def test_all_demos_are_bundled_and_small() -> None:
    models = bundled_models()
    assert set(models) == set(LANGUAGE_MODELS + CLASSIFIERS)
    size = sum(f.stat().st_size for path in models.values() for f in path.iterdir())
    assert size <= 30 * 2**20, f"bundled models take {size / 2**20:.1f} MiB"
    for name, path in models.items():
        recorded = provenance(name)
        assert {"recipe", "command", "seed", "split", "metrics", "source_sha256"} <= set(recorded), name
        assert (path / "quality.json").is_file(), name
        seeds = recorded["seeds"]  # every seed's figures; the bundled one is the best of them
        assert seeds["seeds"] and seeds["bundled_seed"] == recorded["seed"] in seeds["seeds"], name
        assert all(set(cell["values"]) == {str(s) for s in seeds["seeds"]} for cell in seeds["quality"]), name
        if name in LANGUAGE_MODELS and name != "shakespeare-dense":
            diagnostics = recorded["metrics"]["diagnostics"]  # the router learned: putting it back costs bits
            assert min(d["delta"] for d in diagnostics["swap_to_init_bits_per_byte"].values()) > 0.01, name
        assert resolve_model(name) == path


def test_every_recipe_records_three_seeds_controls_included() -> None:
    """What `moe-serve eval --stored` prints: three seeds of every demo's recipe and of every control."""
    for name in LANGUAGE_MODELS + CLASSIFIERS:
        assert provenance(name)["seeds"]["seeds"] == [0, 1, 2], name
    for control, (_, _, host) in CONTROLS.items():
        assert provenance(host)["controls"][control]["seeds"] == [0, 1, 2], control


@pytest.mark.parametrize("name", ["shakespeare-similarity", "shakespeare-attention"])
def test_graph_demos_mixing_matters_beyond_the_seed_spread(name: str) -> None:
    """At the trained k, every seed's plain-routing delta (the same weights, mixing off) exceeds three seed
    standard deviations of the model's own bits per byte."""
    seeds = provenance(name)["seeds"]
    (k,) = seeds["trained_k"]
    quality = next(q for q in seeds["quality"] if (q["k"], q["metric"]) == (k, "bits_per_byte"))
    delta = next(d for d in seeds["diagnostics"] if (d["name"], d["k"]) == ("plain_routing_delta_bits_per_byte", k))
    assert set(delta["values"]) == {"0", "1", "2"}
    assert min(delta["values"].values()) > 3 * quality["std"], (delta, quality)


@pytest.mark.slow
@pytest.mark.parametrize("name", LANGUAGE_MODELS)
def test_language_models_learned_shakespeare(name: str) -> None:
    llm = LLM(name)
    text = "".join(t for t, _ in passages(split(held_out=True), 400)[:8])
    k = None if llm.config.moe is None else llm.config.moe.max_k
    assert llm.score(text, experts_per_token=k)[0].bits_per_byte < 3.2  # uniform bytes: 8; a constant guess: about 4.5
    if llm.config.moe is not None:
        for k in (1, llm.config.moe.max_k):
            out = llm.generate("ROMEO.\n", SamplingParams(max_tokens=60, temperature=0.7, seed=0, experts_per_token=k))[
                0
            ]
            assert sum(c.isalpha() or c.isspace() for c in out.outputs[0].text) > 45


@pytest.mark.slow
@pytest.mark.parametrize("name", CLASSIFIERS)
def test_classifiers_beat_chance_on_held_out_plays(name: str) -> None:
    llm = LLM(name)
    items = passages(split(held_out=True), 256, stride=1500)[:120]
    results = llm.classify([t for t, _ in items])
    assert {r.label for r in results} <= set(GENRES)
    accuracy = sum(r.label == g for r, (_, g) in zip(results, items, strict=True)) / len(items)
    assert accuracy > 1.5 / len(GENRES), accuracy
