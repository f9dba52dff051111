"""The plugin under vLLM's tensor parallelism (`tensor_parallel_size=2`: two CPU worker processes, each with
half the heads and half of every FFN, all-reduced) and expert parallelism (`enable_expert_parallel`: each
rank with half the experts): greedy tokens equal moe-serve's own engine at several k in one batch. Also: a
bf16 model keeps its routers in fp32.
tests/unit/vllm_plugin/test_vllm_parallel.py checks the split layer by layer without vLLM."""

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
from tests.exporters.hf_models import NUM_EXPERTS, save_hf_model

pytestmark = pytest.mark.vllm_cpu

ROOT = Path(__file__).resolve().parents[2]
PROMPT = [5, 77, 190, 12, 43, 250, 9, 101]
# vLLM's CPU attention takes head_dim 64; two key/value heads, so that OLMoE's q/k norm over all heads splits.
HEAD_DIM_64 = dict(hidden_size=128, num_attention_heads=2, num_key_value_heads=2, head_dim=64)


def thread_binding(ranks: int) -> str:
    """VLLM_CPU_OMP_THREADS_BIND for `ranks` workers: this process's CPUs in equal parts ("0|1" on 2 cores);
    vLLM's automatic binding wants a NUMA node per worker."""
    cpus = sorted(os.sched_getaffinity(0))
    per_rank = max(1, len(cpus) // ranks)
    parts = [cpus[i * per_rank : (i + 1) * per_rank] or cpus[-1:] for i in range(ranks)]
    return "|".join(",".join(map(str, part)) for part in parts)


def vllm_greedy(artifact: Path, ks: list[int], parallel: list[str]) -> tuple[dict[str, list[int]], list[str]]:
    """-> ({k: greedy tokens}, [each parameter of rank 0 with its dtype])."""
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_OMP_THREADS_BIND": thread_binding(2)}
    done = subprocess.run(
        [sys.executable, "-m", "tests.vllm.greedy_worker", str(artifact), "--ks", ",".join(map(str, ks)),
         "--prompt", ",".join(map(str, PROMPT)), "--tensor-parallel-size", "2", *parallel],
        capture_output=True, text=True, timeout=600, cwd=ROOT, env=env,
    )  # fmt: skip
    lines = {line.split(" ", 1)[0]: line.split(" ", 1)[1] for line in done.stdout.splitlines() if " " in line}
    assert "RESULT" in lines, done.stderr[-3000:]
    return json.loads(lines["RESULT"]), json.loads(lines["DTYPES"])


@pytest.mark.parametrize(
    ("name", "parallel"),
    [("plugin", []), ("olmoe", []), ("qwen2_moe", ["--enable-expert-parallel"])],
    ids=["baby-tensor-parallel", "olmoe-tensor-parallel", "qwen2_moe-expert-parallel"],
)
def test_parallel_ranks_give_moe_serves_tokens(tmp_path: Path, plugin_artifact: Path, name: str, parallel: list[str]):
    """The baby rotary LM (one key/value head: each rank keeps it), OLMoE (q/k norm over all heads, its mean
    square summed across ranks), Qwen2-MoE (shared experts with a gate, a dense layer; experts per rank)."""
    if name == "plugin":
        artifact, ks = plugin_artifact, [1, 2, 4]
    else:
        src = save_hf_model(name, tmp_path / "hf", seed=1, overrides=HEAD_DIM_64)
        artifact, ks = export_hf(src, tmp_path / "artifact", ExportOptions(progress=False)), [1, 2, NUM_EXPERTS]
    theirs, _ = vllm_greedy(artifact, ks, parallel)
    ours = LLM(str(artifact))
    for k in ks:
        params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, experts_per_token=k)
        assert theirs[str(k)] == list(ours.generate([PROMPT], params)[0].outputs[0].token_ids), k
    assert theirs["1"] != theirs[str(ks[-1])], "k changes the output (else this test proves nothing)"


def test_router_weights_stay_fp32_in_a_bf16_model(plugin_artifact: Path) -> None:
    """As moe-serve's own loader (docs/architecture.md §3: bf16 rounding flips top-k sets): a bf16 model, fp32
    routers."""
    tokens, dtypes = vllm_greedy(plugin_artifact, [1, 4], ["--dtype", "bfloat16"])
    routers = [d for d in dtypes if ".moe.router." in d]
    assert routers and all(d.endswith("torch.float32") for d in routers), routers
    assert all(d.endswith("torch.bfloat16") for d in dtypes if d not in routers)
    assert tokens["1"] != tokens["4"]


def test_a_model_that_does_not_split_is_refused(plugin_artifact: Path) -> None:
    """Three ranks cannot split two query heads: refused at load, naming why."""
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_OMP_THREADS_BIND": thread_binding(3)}
    done = subprocess.run(
        [sys.executable, "-m", "tests.vllm.greedy_worker", str(plugin_artifact), "--ks", "1", "--prompt", "1,2",
         "--tensor-parallel-size", "3"],
        capture_output=True, text=True, timeout=600, cwd=ROOT, env=env,
    )  # fmt: skip
    assert done.returncode != 0
    assert "num_heads 2 is not divisible by tensor_parallel_size 3" in done.stderr
