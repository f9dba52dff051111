"""The whole model on the Triton kernels, under the interpreter on CPU tensors: what a GPU would run (the
kernels' arguments, layouts and dtypes as the layers pass them), checked against the CPU path's tokens.
Tiny model, few tokens: each Triton program costs milliseconds here."""

from __future__ import annotations

import pytest
import torch

from moe_serve import LLM, SamplingParams
from moe_serve.engine.decode_graphs import DecodeGraphs
from moe_serve.engine.model_runner import TorchRunner
from moe_serve.kernels import cuda, ops
from moe_serve.testing import create_random_artifact
from tests.conftest import NUM_EXPERTS, lm_config, moe_config
from tests.host_reads import HostReads

pytestmark = [
    pytest.mark.triton_interp,
    pytest.mark.slow,  # about 20 s each: every kernel of every layer, program by program
]

PROMPTS = ["To be, or not", "x", "Now is the winter"]


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    config = lm_config(num_layers=2, moe=moe_config(layers=(0, 1)), qk_norm="per_head")
    return create_random_artifact(tmp_path_factory.mktemp("triton-model") / "model", config, seed=9)


@pytest.fixture
def triton_ops(monkeypatch):
    """ops dispatches CPU tensors to the Triton kernels, as it does CUDA ones (and never to the C++ ones)."""
    kernels = cuda.kernels()
    assert kernels is not None
    monkeypatch.setattr(ops, "_cpu_ext", lambda x: None)
    monkeypatch.setattr(ops, "_cuda_kernels", lambda x: None if torch.jit.is_tracing() else kernels)


def params() -> list[SamplingParams]:
    return [
        SamplingParams(max_tokens=3, temperature=0, experts_per_token=1 + i % NUM_EXPERTS, logprobs=2, ignore_eos=True)
        for i in range(len(PROMPTS))
    ]


def assert_same(a, b) -> None:
    for x, y in zip(a, b, strict=True):
        assert x.outputs[0].token_ids == y.outputs[0].token_ids
        torch.testing.assert_close(
            torch.tensor(x.outputs[0].logprobs), torch.tensor(y.outputs[0].logprobs), atol=1e-4, rtol=0
        )


def test_eager_steps_on_triton_equal_the_cpu_path(artifact, triton_ops) -> None:
    llm = LLM(artifact, max_num_seqs=4, enable_prefix_caching=False)
    assert_same(llm.generate(PROMPTS, params()), _reference(artifact))


def test_static_decode_on_triton_equals_the_cpu_path(artifact, triton_ops) -> None:
    reference = _reference(artifact)
    llm = LLM(artifact, max_num_seqs=4, enable_prefix_caching=False)
    runner = llm.engine.runner
    assert isinstance(runner, TorchRunner) and runner.cache is not None
    runner.decode_graphs = DecodeGraphs(runner.model, runner.cache, 4, runner.device, capture=False)
    assert_same(llm.generate(PROMPTS, params()), reference)


_references: dict = {}


def _reference(artifact):
    """The CPU path's outputs (C++ kernels), computed once, before any patch applies."""
    if artifact not in _references:
        raise AssertionError("reference not computed")
    return _references[artifact]


@pytest.fixture(scope="module", autouse=True)
def cpu_reference(artifact):
    _references[artifact] = LLM(artifact, max_num_seqs=4, enable_prefix_caching=False).generate(PROMPTS, params())


def test_static_decode_forward_reads_nothing_on_the_host(artifact, triton_ops) -> None:
    """What a CUDA graph captures, op by op: no host read, no host value made into a tensor (on CUDA either
    one fails the capture, or stalls every eager step)."""
    llm = LLM(artifact, max_num_seqs=4, enable_prefix_caching=False)
    runner = llm.engine.runner
    assert isinstance(runner, TorchRunner) and runner.cache is not None
    graphs = DecodeGraphs(runner.model, runner.cache, 4, runner.device, capture=False)
    runner.decode_graphs = graphs
    forward = graphs._forward
    reads: list[list[str]] = []

    def watched(batch):
        with HostReads() as seen:
            logits = forward(batch)
        reads.append(seen.seen)
        return logits

    graphs._forward = watched  # type: ignore[method-assign]
    policy = {"policy": "top_p", "p": 0.6, "min": 1, "max": NUM_EXPERTS}
    llm.generate(PROMPTS[:2], [SamplingParams(max_tokens=2, temperature=0, ignore_eos=True, moe=policy)] * 2)
    assert reads and all(seen == [] for seen in reads), reads
