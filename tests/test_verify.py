"""verify's probes reach every kernel path by row count: a layout error confined to one path (the cpu
int4 dequantize path from 512 rows; tinygemm's copy of the codes at decode sizes, or the Triton
GEMM's copy above 16 rows, on cuda) fails the probe of that size and only that one. The errors are
injected into the unpackers those paths use, as a wrong layout would be."""

import pytest
import torch
from native_c import require_c

from quantprep.build.pipeline import prepack
from quantprep.tools.verify import verify_artifact


def _swap_nibble_order(unpack):
    def wrong(*args, **kwargs):
        codes = unpack(*args, **kwargs)
        return (codes.to(torch.int16) * 7 % 16).to(codes.dtype)  # a permuted code map, same range
    return wrong


def _failing_sizes(art) -> set[int]:
    return {r["rows"] for r in verify_artifact(art, strict=False)["probes"] if not r["ok"]}


def _swap_columns(write):
    def wrong(self, out, n_begin=0, n_end=None, *args):
        write(self, out, n_begin, n_end, *args)
        cols = (self.N if n_end is None else n_end) - n_begin
        out[:, :cols] = out[:, :cols].flip(-1).clone()  # the native dequantizer's columns, reversed
    return wrong


@pytest.mark.parametrize("target,module,function,failing", [
    ("cpu", "quantprep.targets.cpu", "unpack_int4", {520}),  # the dense path's tensor ops (no C compiler)
    ("cpu", "quantprep.targets.cpu", "NativeWeight", {520}),  # its native pass
    ("cuda", "quantprep.targets.cuda", "unpack_tinygemm", {1, 4}),
    ("cuda", "quantprep.targets.cuda", "unpack_rows", {520}),
])
def test_each_kernel_path_is_probed(random_gptq, tmp_path, monkeypatch, target, module, function, failing):
    if target == "cuda" and torch.cuda.is_available():
        pytest.skip("on a GPU the cuda modules run the real kernels, not the unpackers (tests/targets/test_cuda_gpu.py)")
    art = tmp_path / target
    prepack(random_gptq, target, art)
    assert _failing_sizes(art) == set()
    import importlib

    mod = importlib.import_module(module)
    if function == "NativeWeight":
        require_c(mod.native_dequantizer() is not None)  # without it, the tensor ops: the unpack_int4 case
        monkeypatch.setattr(mod.NativeWeight, "write", _swap_columns(mod.NativeWeight.write))
    else:
        if function == "unpack_int4":
            monkeypatch.setattr(mod, "native_dequantizer", lambda: None)
        monkeypatch.setattr(mod, function, _swap_nibble_order(getattr(mod, function)))
    assert _failing_sizes(art) == failing
