"""Hugging Face imports (Mixtral, Qwen2-MoE with shared experts and dense layers, Qwen3-MoE with per-head q/k
norms and YaRN, OLMoE with full q/k norms and clip_qkv, Phi-3.5-MoE with sparsemixer routing, LayerNorm, biases
and longrope, Granite-MoE with its multipliers and shared MLP, GLM-4.5 with group-limited routing and partial
rotary) served by vLLM through the plugin: greedy tokens equal moe-serve's own engine at k = 1 and the largest k,
both k in one vLLM batch. gpt-oss, Llama 4 and windowed Mixtral are refused by name (test_plugin_offline.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from moe_serve import LLM, SamplingParams
from moe_serve.exporters.base import ExportOptions
from moe_serve.exporters.hf import export_hf
from tests.exporters.hf_models import ALL, save_hf_model

pytestmark = pytest.mark.vllm_cpu

ROOT = Path(__file__).resolve().parents[2]
PROMPT = [5, 77, 190, 12, 43, 250, 9, 101]
HEAD_DIM_64 = dict(hidden_size=128, num_attention_heads=2, num_key_value_heads=1, head_dim=64)  # vLLM's CPU attention


SERVED = [n for n in ALL if n not in ("gpt_oss", "llama4", "mixtral_window")]  # attention features: refused


@pytest.mark.parametrize("name", SERVED)
def test_imported_models_match_moe_serve_in_vllm(tmp_path: Path, name: str) -> None:
    src = save_hf_model(name, tmp_path / "hf", seed=1, overrides=HEAD_DIM_64)
    artifact = export_hf(src, tmp_path / "artifact", ExportOptions(progress=False))
    ours = LLM(str(artifact))
    ks = [1, ours.config.moe.max_k]  # every expert, or GLM-4.5's: those of the groups its router keeps
    single_process = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}  # no engine-core process: faster start
    done = subprocess.run(
        [sys.executable, "-m", "tests.vllm.greedy_worker", str(artifact), "--ks", ",".join(map(str, ks)),
         "--prompt", ",".join(map(str, PROMPT))],
        capture_output=True, text=True, timeout=600, cwd=ROOT, env=single_process,
    )  # fmt: skip
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, done.stderr[-3000:]
    theirs = json.loads(lines[0].removeprefix("RESULT "))
    for k in ks:
        params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, experts_per_token=k)
        assert theirs[str(k)] == list(ours.generate([PROMPT], params)[0].outputs[0].token_ids), k
    assert theirs["1"] != theirs[str(ks[1])], "k changes the output (else this test proves nothing)"
