"""Weights live in memory advised for transparent huge pages (moe_serve.kernels.hugepages), hold exactly the
values they were given, and small tensors and the KV-cache pool stay ordinary allocations."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from moe_serve import LLM, EngineConfig, SamplingParams
from moe_serve.kernels import hugepages
from moe_serve.model_config import FFNConfig
from tests.conftest import lm_config

pytestmark = pytest.mark.skipif(not hugepages.supported(), reason="huge-page advice is Linux-only")


def advised_huge(tensor: torch.Tensor) -> bool:
    """Whether the mapping holding tensor's first byte carries the MADV_HUGEPAGE flag ("hg" in VmFlags)."""
    address = tensor.data_ptr()
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:  # a mapping's header line: start-end perms ...
            start, end = (int(part, 16) for part in head.split("-"))
            inside = start <= address < end
        elif inside and line.startswith("VmFlags:"):
            return "hg" in line.split()
    return False


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_place_copies_exactly_into_advised_memory(dtype) -> None:
    source = torch.randn(2048, 1024).to(dtype)[:, :768]  # 6 MiB fp32 / 3 MiB bf16, not contiguous
    placed = hugepages.place(source)
    assert torch.equal(placed, source) and placed.dtype == dtype and placed.is_contiguous()
    big_enough = source.numel() * source.element_size() >= hugepages.HUGE_PAGE
    assert advised_huge(placed) == big_enough
    assert (placed is source) == (not big_enough)


def test_small_tensors_are_ordinary_allocations() -> None:
    small = hugepages.empty((16, 16), torch.float32)
    assert small.shape == (16, 16) and not advised_huge(small)
    source = torch.randn(256, 256)  # 256 KiB
    assert not advised_huge(hugepages.place(source))
    assert hugepages.place(source, torch.bfloat16).dtype == torch.bfloat16


def test_place_converts_dtype_in_one_copy() -> None:
    source = torch.randn(2048, 1024)
    placed = hugepages.place(source, torch.bfloat16)
    assert placed.dtype == torch.bfloat16 and torch.equal(placed, source.to(torch.bfloat16)) and advised_huge(placed)


def test_engine_weights_use_huge_pages_and_the_kv_pool_does_not(make_artifact) -> None:
    config = lm_config(hidden_size=1024, ffn=FFNConfig("mlp", 1024, "gelu", use_bias=True))
    llm = LLM(make_artifact(config), EngineConfig(kv_cache_memory=8 << 20))
    model = llm.artifact.model
    large = [p for p in model.parameters() if p.numel() * p.element_size() >= hugepages.HUGE_PAGE]
    assert large, "the test model has weights of 2 MiB and more"
    assert all(advised_huge(p) for p in large)
    # The pool commits 4 KiB at a time as blocks fill: no step pays for 2 MiB of every layer at once.
    assert not any(advised_huge(keys) or advised_huge(values) for keys, values in llm.engine.runner.cache.layers)
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    assert len(llm.generate([[1, 2, 3]], params)[0].outputs[0].token_ids) == 4
