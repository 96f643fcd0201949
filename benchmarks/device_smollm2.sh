#!/usr/bin/env bash
# Issues 16 and 17 on the GPU machine with real weights (SmolLM2-135M, the GPTQ checkpoint `make build`
# quantized, carried in two parts since a call carries at most 64 MiB): the cuda artifact's perplexity
# on the held-out text (to set beside the cpu and emulated xpu artifacts' on the same windows), then the
# cold start of `quantprep serve` against the quantprep.load + generate floor (no GPTQModel there).
#   bash benchmarks/device_smollm2.sh   (after a call carrying .dev/p1 ran `cp -r .dev/p1 /tmp/p1`: a call's carry replaces the last one's; OUT=DIR)
set -euo pipefail
unset PYTHONDONTWRITEBYTECODE  # the image sets it: every process would compile torch's sources again
export PYTHONPYCACHEPREFIX=/tmp/pycache PYTHONPATH=$PWD:${PYTHONPATH:-} HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
out=${OUT:-/tmp/out}; mkdir -p "$out"
g=/tmp/smollm2-gptq; mkdir -p $g
cp /tmp/p1/*.json /tmp/p1/*.jinja $g/  # part 1: a previous call carried .dev/p1 and copied it to /tmp/p1
cat /tmp/p1/part-a .dev/p2/part-b > $g/model.safetensors
echo "fd7c43f1c4d13e19d5b81157bfdd126f0fb0a4f9eebc56720bcb430e623535e5  $g/model.safetensors" | sha256sum -c
python3 -m quantprep prepack $g --target cuda --out /tmp/smollm2-cuda --json > "$out/prepack-smollm2-cuda.json"
python3 -m quantprep warm /tmp/smollm2-cuda --no-compile --json > "$out/warm-smollm2-cuda.json"
python3 -m quantprep eval /tmp/smollm2-cuda --reference $g --max-tokens 8192 --json --no-store > "$out/eval-smollm2-cuda.json"
python3 benchmarks/serve.py --artifact smollm2=/tmp/smollm2-cuda --variants a,c --runs 3 --out "$out/serve-smollm2-cuda.json"
