"""vllm.LLM(ARTIFACT_DIR) with per-request experts_per_token (SamplingParams.extra_args): requests with
different k share vLLM's batches without changing each other's tokens, match moe-serve's own engine, survive
chunked prefill and prefix caching, and a bad k is refused before anything runs."""

from __future__ import annotations

import dataclasses
import os
import random

import pytest

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # engine in this process: the test reads its model

from vllm import LLM, SamplingParams  # noqa: E402
from vllm.exceptions import VLLMValidationError  # noqa: E402

import moe_serve  # noqa: E402
from moe_serve.model_config import LatentAttentionConfig  # noqa: E402
from moe_serve.testing import create_random_artifact  # noqa: E402
from tests.conftest import lm_config  # noqa: E402
from tests.vllm.conftest import NUM_EXPERTS  # noqa: E402

pytestmark = pytest.mark.vllm_cpu

NEW_TOKENS = 12


@pytest.fixture(scope="module")
def vllm_llm(plugin_artifact):
    return LLM(
        str(plugin_artifact),
        dtype="float32",
        enforce_eager=True,
        max_model_len=512,
        block_size=32,  # prompts of a few blocks exercise prefix caching
        max_num_batched_tokens=64,  # and prompts longer than that are prefilled in chunks
        max_num_seqs=16,
        kv_cache_memory_bytes=2 << 20,  # 2,048 tokens: 16 requests of 160 preempt each other
        seed=0,
        disable_log_stats=False,  # get_metrics() counts preemptions
    )


def prompts(n: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(256) for _ in range(length)] for _ in range(n)]


def vllm_generate(
    llm: LLM, token_lists: list[list[int]], ks: list[int | None], new_tokens: int = NEW_TOKENS
) -> list[tuple[list[int], list[float]]]:
    params = [
        SamplingParams(
            max_tokens=new_tokens,
            temperature=0,
            ignore_eos=True,
            logprobs=0,
            extra_args=None if k is None else {"experts_per_token": k},
        )
        for k in ks
    ]
    outs = llm.generate([{"prompt_token_ids": p} for p in token_lists], params, use_tqdm=False)
    results = []
    for out in outs:
        completion = out.outputs[0]
        chosen = [lp[token].logprob for token, lp in zip(completion.token_ids, completion.logprobs, strict=True)]
        results.append((list(completion.token_ids), chosen))
    return results


def ours_generate(
    llm: moe_serve.LLM, token_lists: list[list[int]], k: int, new_tokens: int = NEW_TOKENS
) -> list[tuple[list[int], list[float]]]:
    params = moe_serve.SamplingParams(
        max_tokens=new_tokens, temperature=0, ignore_eos=True, logprobs=0, experts_per_token=k
    )
    outs = llm.generate(token_lists, params)
    return [(list(o.outputs[0].token_ids), list(o.outputs[0].logprobs or [])) for o in outs]


def test_mixed_k_batch_equals_each_request_alone(vllm_llm) -> None:
    token_lists = prompts(8, 20, seed=1)
    ks = [1, 2, 3, 4, 4, 3, 2, 1]
    together = vllm_generate(vllm_llm, token_lists, ks)
    for tokens, k, (batched, _) in zip(token_lists, ks, together, strict=True):
        assert vllm_generate(vllm_llm, [tokens], [k])[0][0] == batched
    assert len({tuple(t) for t, _ in together}) > 2, "k changes the output (else this test proves nothing)"


@pytest.mark.parametrize("k", [1, 2, NUM_EXPERTS])
def test_vllm_equals_moe_serve_engine(vllm_llm, ours, k) -> None:
    token_lists = prompts(4, 24, seed=2)
    theirs = vllm_generate(vllm_llm, token_lists, [k] * 4)
    mine = ours_generate(ours, token_lists, k)
    for (their_tokens, their_lps), (my_tokens, my_lps) in zip(theirs, mine, strict=True):
        assert their_tokens == my_tokens
        # measured: at most 3.1e-6 (vLLM's attention kernel against moe-serve's, fp32)
        assert max(abs(a - b) for a, b in zip(their_lps, my_lps, strict=True)) < 1e-4


def test_default_k_is_the_artifacts(vllm_llm, ours) -> None:
    token_lists = prompts(2, 16, seed=4)
    assert [t for t, _ in vllm_generate(vllm_llm, token_lists, [None, None])] == [
        t for t, _ in ours_generate(ours, token_lists, 2)
    ]


def test_prefix_cache_keeps_each_k_apart_under_chunked_prefill(vllm_llm, ours) -> None:
    """A 150-token prompt (4 full blocks, prefilled in 64-token chunks) at k=1 fills the prefix cache; the same
    prompt at k=4 must not reuse those keys and values."""
    prompt = prompts(1, 150, seed=5)
    for k in (1, NUM_EXPERTS, 1, NUM_EXPERTS):
        assert vllm_generate(vllm_llm, prompt, [k])[0][0] == ours_generate(ours, prompt, k)[0][0], k


def preemptions(llm: LLM) -> float:
    return sum(m.value for m in llm.get_metrics() if m.name == "vllm:num_preemptions")


def test_preempted_requests_recompute_at_their_own_k(vllm_llm, ours) -> None:
    token_lists, ks = prompts(16, 100, seed=7), [1 + i % NUM_EXPERTS for i in range(16)]
    before = preemptions(vllm_llm)
    outs = vllm_generate(vllm_llm, token_lists, ks, new_tokens=60)
    assert preemptions(vllm_llm) > before, "the KV cache holds 2,048 tokens: 16 x 160 must preempt"
    for tokens, k, (out, _) in zip(token_lists, ks, outs, strict=True):
        assert out == ours_generate(ours, [tokens], k, new_tokens=60)[0][0]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"experts_per_token": 0}, "experts_per_token must be between 1 and 4, got 0"),
        ({"experts_per_token": NUM_EXPERTS + 1}, "experts_per_token must be between 1 and 4, got 5"),
        ({"experts_per_token": "auto"}, "experts_per_token must be an integer"),
        ({"moe": "top_p"}, "moe: top-p policies"),
    ],
)
def test_bad_k_is_refused_before_generation(vllm_llm, extra, message) -> None:
    params = SamplingParams(max_tokens=2, extra_args=extra)
    with pytest.raises(VLLMValidationError, match=message):
        vllm_llm.generate([{"prompt_token_ids": [1, 2, 3]}], params, use_tqdm=False)
    assert vllm_generate(vllm_llm, prompts(1, 8, seed=6), [1])  # and the engine keeps serving


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        (dict(position="relative"), "Transformer-XL relative attention"),
        (dict(hidden_size=32, num_heads=4, num_kv_heads=2), "head_dim 8"),
        (dict(attention_sinks=True), "attention sinks .the plugin's attention is vLLM's"),  # gpt-oss
        (  # DeepSeek
            dict(latent_attention=LatentAttentionConfig(16, 16, 8, 12), head_dim=8, num_kv_heads=4),
            "multi-head latent attention",
        ),
    ],
)
def test_what_vllm_cannot_run_is_refused_at_load_by_name(tmp_path, overrides, named) -> None:
    config = dataclasses.replace(lm_config(max_position_embeddings=512), **overrides)
    artifact = create_random_artifact(tmp_path / "refused", config)
    with pytest.raises(Exception, match=named):
        LLM(str(artifact), dtype="float32", enforce_eager=True, max_model_len=256, kv_cache_memory_bytes=32 << 20)


def test_pooling_runner_is_refused_by_name(plugin_artifact) -> None:
    with pytest.raises(Exception, match="--runner pooling"):
        LLM(str(plugin_artifact), runner="pooling", dtype="float32", enforce_eager=True, max_model_len=256)


def test_a_quantized_artifact_is_refused_by_name(tmp_path, plugin_artifact) -> None:
    from moe_serve.quantize import quantize_artifact

    packed = quantize_artifact(plugin_artifact, tmp_path / "int8", "int8", progress=False)
    with pytest.raises(Exception, match="stores int8 weights .* the vLLM plugin takes artifacts of float weights"):
        LLM(str(packed), dtype="float32", enforce_eager=True, max_model_len=256, kv_cache_memory_bytes=32 << 20)
