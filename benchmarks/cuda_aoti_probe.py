"""Which AOTInductor packages load on this GPU machine? (issue 4: on the device's torch 2.11 the
MLP packages crashed at load.) Builds three tiny packages in this process, then loads and runs
each in a fresh process with a time limit: a plain matmul, tinygemm (`aten._weight_int4pack_mm`),
and quantprep's prefill GEMM (`quantprep::int4_kn_gemm`, a triton_op). Then variants of the plain
one that narrow down a crash: the same on the CPU (is loading any shared library broken?), with
the kernel binaries embedded in the .so, and a bare .so loaded without the package loader.

    PYTHONPATH=. python3 benchmarks/cuda_aoti_probe.py OUT_DIR [VARIANT ...]   # default: all
    PYTHONPATH=. python3 benchmarks/cuda_aoti_probe.py load PACKAGE KIND   # one load (e.g. under cuda-gdb)
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
    if kind == "plain_cpu":
        return torch.randn(8, K, dtype=torch.bfloat16), torch.randn(K, N, dtype=torch.bfloat16)
    codes = torch.randint(0, 16, (K, N), dtype=torch.uint8)
    sz = torch.stack([torch.rand(K // 128, N) * 0.01, torch.zeros(K // 128, N)], -1).to(torch.bfloat16).cuda()
    if kind.startswith("plain"):
        return torch.randn(8, K, dtype=torch.bfloat16, device="cuda"), torch.randn(K, N, dtype=torch.bfloat16, device="cuda")
    if kind == "tinygemm":
        return torch.randn(1, K, dtype=torch.bfloat16, device="cuda"), pack_tinygemm(codes, 8).cuda(), sz
    from quantprep.gptq_format import pack_rows

    return torch.randn(64, K, dtype=torch.bfloat16, device="cuda"), pack_rows(codes, 4).cuda(), sz


def load(pkg: str, kind: str) -> None:
    import faulthandler

    faulthandler.enable()
    if pkg.endswith(".so"):  # the pre-package API: a bare shared library and its own runner
        run = torch._export.aot_load(pkg, "cuda")
    else:
        from torch._inductor import aoti_load_package

        run = aoti_load_package(pkg)
    print("loaded", flush=True)
    y = run(*inputs(kind))
    torch.cuda.synchronize()
    print("ran", tuple(y.shape), flush=True)


VARIANTS = {  # name: (module, inputs kind, inductor config)
    "plain": (Plain(), "plain", {}),
    "tinygemm": (Tinygemm(), "tinygemm", {}),
    "triton": (Triton(), "triton", {}),
    "plain_cpu": (Plain(), "plain_cpu", {}),
    "plain_embed": (Plain(), "plain", {"aot_inductor.embed_kernel_binary": True}),
    "plain_so": (Plain(), "plain", {}),
}


def main() -> None:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    from torch._inductor import aoti_compile_and_package

    result = {"torch": torch.__version__, "device": torch.cuda.get_device_name()}
    for name in sys.argv[2:] or VARIANTS:
        mod, kind, config = VARIANTS[name]
        pkg = out / (f"{name}.so" if name.endswith("_so") else f"{name}.pt2")
        try:
            ep = torch.export.export(mod, inputs(kind), strict=False)
            with torch._inductor.config.patch(config):
                if name.endswith("_so"):
                    built = torch._inductor.aot_compile(ep.module(), inputs(kind))
                    pkg.write_bytes(Path(built).read_bytes())
                else:
                    aoti_compile_and_package(ep, package_path=str(pkg))
        except Exception as e:
            result[name] = f"build failed: {type(e).__name__}: {str(e)[:300]}"
            continue
        try:
            cmd = [sys.executable, __file__, "load", str(pkg), kind]
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
            result[name] = {"rc": proc.returncode, "stdout": proc.stdout.strip()[-300:], "stderr": proc.stderr.strip()[-1500:]}
        except subprocess.TimeoutExpired:
            result[name] = "load did not finish in 120 s"
        print(name, json.dumps(result[name])[:600], flush=True)
        (out / "aoti-probe.json").write_text(json.dumps(result, indent=1))
    (out / "aoti-probe.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    load(*sys.argv[2:4]) if sys.argv[1] == "load" else main()
