"""Where an openvino artifact's MoE decode token goes, by OpenVINO's own node timings (2026-11-29).

On moe_speed.py's 6-layer openvino artifact (Qwen3-30B-A3B's layer shapes, in --work): the IR compiled
for the CPU with PERF_COUNT and the plugin's defaults, a 16-token prompt, then 24 decode steps; the
real time of each (node type, kernel) summed over the last 16 steps, ms per step.

    PYTHONPATH=.:benchmarks python benchmarks/experiments/openvino_moe_profile.py --work /tmp/moe/bench \
        --out benchmarks/experiments/results/openvino-moe-profile-avx512.json
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict

import numpy as np
import openvino as ov
from common import machine, save


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work", required=True)
    p.add_argument("--out")
    args = p.parse_args()
    compiled = ov.Core().compile_model(f"{args.work}/layers-6/openvino/openvino_model.xml", "CPU", {"PERF_COUNT": "YES"})
    request, names = compiled.create_infer_request(), {i.get_any_name() for i in compiled.inputs}

    def step(ids: np.ndarray, length: int) -> float:
        inputs = {"input_ids": ids, "attention_mask": np.ones((1, length), dtype=np.int64),
                  "position_ids": np.arange(length - ids.shape[1], length, dtype=np.int64)[None], "beam_idx": np.zeros(1, dtype=np.int32)}
        t = time.perf_counter()
        request.infer({k: v for k, v in inputs.items() if k in names})
        return time.perf_counter() - t

    request.reset_state()
    step(np.arange(1, 17, dtype=np.int64)[None], 16)
    nodes, times = defaultdict(float), []
    for i in range(24):
        times.append(step(np.array([[5]], dtype=np.int64), 17 + i))
        if i >= 8:
            for info in request.profiling_info:
                nodes[f"{info.node_type} ({info.exec_type})"] += info.real_time.total_seconds()
    top = sorted(nodes.items(), key=lambda kv: -kv[1])[:12]
    result = {**machine(), "benchmark": "openvino-moe-profile", "layers": 6, "step_ms_median": round(sorted(times)[12] * 1e3, 3),
              "config": {k: str(compiled.get_property(k)) for k in ("INFERENCE_PRECISION_HINT", "DYNAMIC_QUANTIZATION_GROUP_SIZE")},
              "ms_per_step": {k: round(v / 16 * 1e3, 3) for k, v in top}}
    print(result)
    save(result, args.out)


if __name__ == "__main__":
    main()
