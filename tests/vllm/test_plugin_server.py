"""`vllm serve ARTIFACT_DIR` (a real vLLM server process, loopback only) with the plugin, and the openai client
choosing k per request through `extra_body={"vllm_xargs": {"experts_per_token": k}}`; a bad k is a 400."""

from __future__ import annotations

import subprocess
import sys
import time

import httpx
import openai
import pytest

import moe_serve
from tests.conftest import free_port

pytestmark = pytest.mark.vllm_cpu

PROMPT = [72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100]  # token ids: no tokenizer differences


@pytest.fixture(scope="module")
def vllm_server(plugin_artifact, tmp_path_factory):
    port = free_port()
    log = (tmp_path_factory.mktemp("vllm-serve") / "server.log").open("w")
    # `vllm serve` itself: vllm-cpu 0.32.0's `vllm` command fails before parsing its arguments (it asks
    # importlib for the version of a distribution named "vllm"; this one is "vllm-cpu"), so the server
    # module it runs is started directly.
    command = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(plugin_artifact),
        "--served-model-name", "baby-moe",
        "--host", "127.0.0.1",
        "--port", str(port),
        "--dtype", "float32",
        "--enforce-eager",
        "--max-model-len", "512",
        "--kv-cache-memory-bytes", str(64 << 20),
    ]  # fmt: skip
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):  # up to 5 minutes: vLLM starts slowly on 2 cores
            if process.poll() is not None:
                pytest.fail(f"vllm serve exited with {process.returncode}; see {log.name}")
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        else:
            pytest.fail(f"vllm serve did not come up; see {log.name}")
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    finally:
        process.terminate()
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
        log.close()


def complete(client: openai.OpenAI, k: int | None, max_tokens: int = 8) -> list[int]:
    extra = {"return_token_ids": True}
    if k is not None:
        extra["vllm_xargs"] = {"experts_per_token": k}
    response = client.completions.create(
        model="baby-moe", prompt=PROMPT, max_tokens=max_tokens, temperature=0, extra_body=extra
    )
    return list(response.choices[0].model_extra["token_ids"])


@pytest.mark.parametrize("k", [1, 4])
def test_per_request_k_over_rest_equals_moe_serve(vllm_server, ours, k) -> None:
    params = moe_serve.SamplingParams(max_tokens=8, temperature=0, experts_per_token=k)
    expected = ours.generate([PROMPT], params)[0].outputs[0].token_ids
    assert complete(vllm_server, k) == list(expected)


def test_bad_k_is_a_400(vllm_server) -> None:
    with pytest.raises(openai.BadRequestError, match="experts_per_token must be between 1 and 4"):
        complete(vllm_server, 9)
    assert complete(vllm_server, 2)  # and the server keeps serving
