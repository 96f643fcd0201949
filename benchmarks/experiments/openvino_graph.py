"""The traced openvino graph against the hand-written one it replaced, side by side in one run.

Each artifact's openvino_model.xml is compiled by the CPU plugin with its defaults (what serving
runs), then, in alternating order for `--rounds` rounds: a prefill of `--prompt` tokens from an
empty state, and `--decode` single-token steps after it. Medians per artifact; the ratios are
traced / hand-written. The hand-written artifacts were built at 6198dec (its targets/openvino_decoder.py),
the traced ones at a8dafd0, both from the same random GPTQ checkpoints of the real models' shapes.

    python benchmarks/openvino_graph.py --pair qwen2 /tmp/ovbig/qwen2/handwritten /tmp/ovbig/qwen2/traced \
        --pair llama /tmp/ovbig/llama/handwritten /tmp/ovbig/llama/traced --out benchmarks/results/openvino-graph-cpu-avx512.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np


def compile_ir(path: Path):
    import openvino as ov

    return ov.Core().compile_model(str(path / "openvino_model.xml"), "CPU").create_infer_request()


def run(request, ids: np.ndarray, decode: int) -> tuple[float, float]:
    """(prefill seconds, decode tokens per second) from an empty state."""
    request.reset_state()
    n = ids.shape[1]
    t0 = time.perf_counter()
    out = request.infer({"input_ids": ids, "attention_mask": np.ones((1, n), np.int64), "position_ids": np.arange(n)[None],
                         "beam_idx": np.zeros(1, np.int32)})
    prefill = time.perf_counter() - t0
    token = np.array([[int(out["logits"][0, -1].argmax())]])
    t0 = time.perf_counter()
    for step in range(decode):
        out = request.infer({"input_ids": token, "attention_mask": np.ones((1, n + step + 1), np.int64),
                             "position_ids": np.array([[n + step]]), "beam_idx": np.zeros(1, np.int32)})
        token = np.array([[int(out["logits"][0, -1].argmax())]])
    return prefill, decode / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pair", nargs=3, action="append", metavar=("NAME", "HANDWRITTEN", "TRACED"), required=True)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--decode", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    ids = np.random.default_rng(0).integers(0, 256, (1, args.prompt))
    rows = []
    for name, handwritten, traced in args.pair:
        requests = {"handwritten": compile_ir(Path(handwritten)), "traced": compile_ir(Path(traced))}
        for request in requests.values():
            run(request, ids[:, :16], 2)  # the first inference prepares the weights
        runs = {k: [] for k in requests}
        for r in range(args.rounds):
            for kind in (("handwritten", "traced") if r % 2 == 0 else ("traced", "handwritten")):
                runs[kind].append(run(requests[kind], ids, args.decode))
        med = {k: {"prefill_s": statistics.median(p for p, _ in v), "decode_tok_s": statistics.median(d for _, d in v),
                   "runs": [{"prefill_s": round(p, 4), "decode_tok_s": round(d, 2)} for p, d in v]} for k, v in runs.items()}
        row = {"model": name, **med, "prefill_ratio": med["traced"]["prefill_s"] / med["handwritten"]["prefill_s"],
               "decode_ratio": med["traced"]["decode_tok_s"] / med["handwritten"]["decode_tok_s"]}
        rows.append(row)
        print(f"{name}: prefill {args.prompt} tokens {med['handwritten']['prefill_s']:.3f}s -> {med['traced']['prefill_s']:.3f}s "
              f"(x{row['prefill_ratio']:.3f}); decode {med['handwritten']['decode_tok_s']:.2f} -> {med['traced']['decode_tok_s']:.2f} tok/s "
              f"(x{row['decode_ratio']:.3f})", flush=True)
        del requests
    import openvino

    args.out.write_text(json.dumps({"openvino": openvino.__version__, "prompt": args.prompt, "decode": args.decode,
                                    "rounds": args.rounds, "rows": rows, "date": time.strftime("%Y-%m-%d %H:%M")}, indent=1) + "\n")


if __name__ == "__main__":
    main()
