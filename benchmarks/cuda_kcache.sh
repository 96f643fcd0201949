#!/usr/bin/env bash
# Issue 4 on the GPU machine: build a Qwen2.5-1.5B-shaped cuda artifact (random GPTQ codes), warm
# it with torch.compile (+ AOTInductor packages), then time the modes of benchmarks/kcache.py.
#   PYTHONPATH=. bash benchmarks/cuda_kcache.sh OUT_DIR [kcache.py args, e.g. --modes b_compile_kcache c_eager]
set -euo pipefail
# The GPU machine's image sets PYTHONDONTWRITEBYTECODE=1, so every process compiled torch's and
# transformers' sources again (imports 12-16 s instead of ~6 s, worse for the modes that import
# Inductor): a served model's environment has its bytecode cached, so the benchmark does too.
unset PYTHONDONTWRITEBYTECODE
export PYTHONPYCACHEPREFIX=${PYTHONPYCACHEPREFIX:-/tmp/pycache}
out=${1:-/tmp/kcache-cuda}
work=${WORK:-$(mktemp -d)}  # WORK=DIR keeps the artifact where a later command can reuse it; BUILD_ONLY=1 stops after warm
python3 - "$work" <<'PY'
import sys
from pathlib import Path
from benchmarks.cuda_kernels import QWEN_CFG
from quantprep.build import build_artifacts
from quantprep.synthetic import write_random_checkpoint
work = Path(sys.argv[1])
gptq = write_random_checkpoint(work / "gptq", QWEN_CFG, bits=4, group_size=128, desc_act=True, sym=True)
build_artifacts(gptq, {"path": str(gptq)}, ["cuda"], lambda t: work / "cuda", progress=False,
                serving={"shapes": [1, 16, 128, 512], "compile": True}, warm_here=False)
PY
python3 -m quantprep warm "$work/cuda" --json ${WARM_ARGS:-} > "$out/warm-cuda.json"  # WARM_ARGS=--no-aot: skip the AOT phases
[ -n "${BUILD_ONLY:-}" ] || python3 benchmarks/kcache.py "$work/cuda" --runs 3 --out "$out/kcache-cuda.json" "${@:2}"
