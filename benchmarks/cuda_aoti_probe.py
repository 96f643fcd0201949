"""Which AOTInductor packages load on this GPU machine? (issue 4: on the device's torch 2.11 the
MLP packages crashed at load.) Builds three tiny packages in this process, then loads and runs
each in a fresh process with a time limit: a plain matmul, tinygemm (`aten._weight_int4pack_mm`),
and quantprep's prefill GEMM (`quantprep::int4_kn_gemm`, a triton_op).

    PYTHONPATH=. python3 benchmarks/cuda_aoti_probe.py OUT_DIR
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

from quantprep.targets.cuda import int4_kn_gemm_op, pack_tinygemm


class Plain(torch.nn.Module):
    def forward(self, x, w):
        return torch.nn.functional.silu(x @ w)


class Tinygemm(torch.nn.Module):
    def forward(self, x, q, sz):
        return torch.ops.aten._weight_int4pack_mm(x, q, 128, sz)


class Triton(torch.nn.Module):
    def forward(self, x, q, sz):
        return int4_kn_gemm_op(x, q, sz, 128)


def inputs(kind: str) -> tuple:
    K, N = 256, 128
    codes = torch.randint(0, 16, (K, N), dtype=torch.uint8)
    sz = torch.stack([torch.rand(K // 128, N) * 0.01, torch.zeros(K // 128, N)], -1).to(torch.bfloat16).cuda()
    if kind == "plain":
        return torch.randn(8, K, dtype=torch.bfloat16, device="cuda"), torch.randn(K, N, dtype=torch.bfloat16, device="cuda")
    if kind == "tinygemm":
        return torch.randn(1, K, dtype=torch.bfloat16, device="cuda"), pack_tinygemm(codes, 8).cuda(), sz
    from quantprep.gptq_format import pack_rows

    return torch.randn(64, K, dtype=torch.bfloat16, device="cuda"), pack_rows(codes, 4).cuda(), sz


LOAD = """
import faulthandler, sys, torch
faulthandler.enable()
import quantprep.targets.cuda  # registers quantprep::int4_kn_gemm
sys.path.insert(0, "benchmarks")
from cuda_aoti_probe import inputs
from torch._inductor import aoti_load_package
run = aoti_load_package(sys.argv[1])
print("loaded", flush=True)
y = run(*inputs(sys.argv[2]))
torch.cuda.synchronize()
print("ran", tuple(y.shape), flush=True)
"""


def main() -> None:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    from torch._inductor import aoti_compile_and_package

    result = {"torch": torch.__version__, "device": torch.cuda.get_device_name()}
    for kind, mod in (("plain", Plain()), ("tinygemm", Tinygemm()), ("triton", Triton())):
        pkg = out / f"{kind}.pt2"
        try:
            aoti_compile_and_package(torch.export.export(mod, inputs(kind), strict=False), package_path=str(pkg))
        except Exception as e:
            result[kind] = f"build failed: {type(e).__name__}: {str(e)[:300]}"
            continue
        try:
            proc = subprocess.run([sys.executable, "-c", LOAD, str(pkg), kind], capture_output=True, text=True, timeout=120)
            result[kind] = {"rc": proc.returncode, "stdout": proc.stdout.strip()[-300:], "stderr": proc.stderr.strip()[-1500:]}
        except subprocess.TimeoutExpired:
            result[kind] = "load did not finish in 120 s"
        print(kind, json.dumps(result[kind])[:600], flush=True)
    (out / "aoti-probe.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
