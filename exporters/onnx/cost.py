"""What an exported causal-LM graph costs against k: `python -m moe_serve.exporters.onnx.cost OUT_DIR`.

onnxruntime's CPU provider on one thread (so a busy machine shifts figures less), the minimum over
interleaved rounds, for a prefill batch and a decode batch with every row at each k, and one batch of
mixed k (1, 2, 4, 8, ... repeated). Random tokens: only the shapes and k matter to the cost.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from moe_serve.onnx_model import GRAPH_FILE, OnnxModel


def measure(directory: Path, rounds: int, prefill: tuple[int, int], decode: tuple[int, int]) -> dict[str, dict]:
    """k (or "mixed") -> {"prefill_ms", "decode_ms"}; prefill (rows, tokens), decode (rows, past tokens)."""
    import onnxruntime

    model = OnnxModel(directory)
    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = options.inter_op_num_threads = 1
    model.session = onnxruntime.InferenceSession(str(directory / GRAPH_FILE), options, ["CPUExecutionProvider"])
    moe = model.config.moe
    if moe is None or not model.config.is_causal:
        raise SystemExit("cost against k is measured on causal LMs with MoE layers")
    rng = np.random.default_rng(0)
    vocab = model.config.vocab_size
    cases = [*range(moe.min_k, moe.max_k + 1), "mixed"]

    def ks(case: int | str, rows: int) -> np.ndarray:
        mixed = [k for k in (1, 2, 4, 8, 16, 32, 64) if moe.min_k <= k <= moe.max_k]
        return np.asarray((mixed * rows)[:rows] if case == "mixed" else [case] * rows, dtype=np.int64)

    (b, t), (bd, p) = prefill, decode
    ids, mask = rng.integers(0, vocab, (b, t)), np.ones((b, t), dtype=np.int64)
    context = rng.integers(0, vocab, (bd, p))
    pasts = {case: model.lm_step(context, np.ones((bd, p), dtype=np.int64), ks(case, bd))[1] for case in cases}
    step_ids, step_mask = context[:, :1], np.ones((bd, p + 1), dtype=np.int64)
    best = {case: [float("inf"), float("inf")] for case in cases}
    for _ in range(rounds):  # interleaved, so a slow moment hits every k alike
        for case in cases:
            start = time.perf_counter()
            model.lm_step(ids, mask, ks(case, b))
            best[case][0] = min(best[case][0], time.perf_counter() - start)
            for _ in range(5):
                start = time.perf_counter()
                model.lm_step(step_ids, step_mask, ks(case, bd), pasts[case])
                best[case][1] = min(best[case][1], time.perf_counter() - start)
    return {str(c): {"prefill_ms": 1000 * v[0], "decode_ms": 1000 * v[1]} for c, v in best.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory", type=Path, help="an export-onnx output directory (causal LM)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--prefill", default="4x128", help="ROWSxTOKENS")
    parser.add_argument("--decode", default="16x128", help="ROWSxPAST_TOKENS")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    def shape(text: str) -> tuple[int, int]:
        rows, tokens = (int(n) for n in text.split("x"))
        return rows, tokens

    results = measure(args.directory, args.rounds, shape(args.prefill), shape(args.decode))
    if args.json:
        print(json.dumps(results, indent=2))
        return
    print(f"k        prefill {args.prefill} (ms)   decode {args.decode} (ms)")
    for case, r in results.items():
        print(f"{case:<8} {r['prefill_ms']:>18.1f}   {r['decode_ms']:>15.2f}")


if __name__ == "__main__":
    main()
