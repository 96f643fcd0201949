"""quantprep's C kernels (quantprep/csrc, targets/c_library.py; issue 55): the ctypes side of the ABI is
the header's (targets/c_abi.py against quantprep.h, as the compiler lays the structs out), a file that
does not compile or load raises CompileError with the compiler's output where a missing compiler
gives None and a reason, CI=true turns the C tests' skips into failures, and the kernels' own tests
pass built with AddressSanitizer and UndefinedBehaviorSanitizer."""

import ctypes
import os
import platform
import re
import shutil
import subprocess
import sys

import pytest
from conftest import REPO
from native_c import require_c

from quantprep.errors import CompileError
from quantprep.targets import c_abi, c_library

FILES = sorted(p.stem for p in c_library.CSRC.glob("*.c"))
C_TYPES = {"int64_t": ctypes.c_int64, "int": ctypes.c_int, "float": ctypes.c_float}


def compiler() -> str:
    cc = shutil.which("cc")
    require_c(cc is not None)
    return cc


def test_every_c_file_builds_and_exports_what_c_abi_declares():
    assert FILES == sorted(c_abi.SIGNATURES) == ["a8", "attention", "dequant", "gemv", "layers", "pack"]
    for name in FILES:
        require_c(c_library.library(name) is not None)  # declare() looked every function up: a missing one raises


def header_prototypes() -> dict:
    """quantprep.h's function declarations as {name: (restype, argtypes)} in ctypes' terms."""
    text = re.sub(r"/\*.*?\*/", "", c_library.HEADER.read_text(), flags=re.S)
    found = {}
    for ret, name, params in re.findall(r"^(\w+) (\w+)\(([^)]*)\);", text, flags=re.M):
        args = []
        for param in ([] if params.strip() == "void" else params.split(",")):
            words = param.replace("*", " * ").split()[:-1]  # the type: all but the parameter's name
            args.append((c_abi.LAYER if "DecodeLayer" in words else c_abi.P) if "*" in words else C_TYPES[words[-1]])
        found[name] = (None if ret == "void" else C_TYPES[ret], args)
    return found


def test_each_signature_is_the_header_s():
    declared = {fn: sig for functions in c_abi.SIGNATURES.values() for fn, sig in functions.items()}
    header = header_prototypes()
    assert len(header) == 17 and header == declared


# The build here compiles only this CPU's branches (-march=native): a syntax error in another ISA's would
# pass. Each file for each ISA it has code for (x86), with and without OpenMP, checked without building.
ISAS = {"x86-64": [], "avx2": ["-mavx2", "-mfma"],
        "avx512": ["-mavx2", "-mfma", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni", "-mavx512vbmi", "-mavx512bf16"]}


@pytest.mark.skipif(platform.machine() != "x86_64", reason="the kernels' ISA branches are x86's")
@pytest.mark.parametrize("isa", ISAS)
def test_every_isa_s_branch_compiles_without_warnings(isa):
    cc = compiler()
    for name in FILES:
        for openmp in ([], ["-fopenmp"]):
            command = [cc, "-fsyntax-only", "-Wall", "-Werror", "-Wno-unknown-pragmas", "-march=x86-64", *ISAS[isa], *openmp]
            done = subprocess.run([*command, str(c_library.CSRC / f"{name}.c")], capture_output=True, text=True)
            assert done.returncode == 0, f"{name}.c: {' '.join(command)}\n{done.stderr}"


ABI_C = r"""
#include <stddef.h>
#include <stdio.h>
#include "quantprep.h"
#define KIND(v) _Generic((v), float: "float", double: "double", int: "int", int64_t: "int64_t", QuantLinear: "QuantLinear", default: "pointer")
int main(void) {
    DecodeLayer DecodeLayer_; QuantLinear QuantLinear_;
    printf("MAX_D %d\n", MAX_D);
    printf("ROUTER_TIE %d\n", ROUTER_TIE);
%s
    return 0;
}
"""
KIND = {ctypes.c_void_p: "pointer", ctypes.c_float: "float", ctypes.c_int64: "int64_t", c_abi.QuantLinearArgs: "QuantLinear"}


def test_the_structs_are_laid_out_as_the_compiler_lays_out_the_header_s(tmp_path):
    """Each ctypes field at the C field's offset, of its size and kind, and each struct of C's size
    (a field C has and Python lacks changes one or the other); MAX_D is MAX_HEAD_DIM, ROUTER_TIE ROUTER_TIE."""
    lines, want = [], ["MAX_D 256", f"ROUTER_TIE {c_abi.ROUTER_TIE}"]
    for struct, c_name in ((c_abi.DecodeLayerArgs, "DecodeLayer"), (c_abi.QuantLinearArgs, "QuantLinear")):
        lines.append(f'    printf("{c_name} %zu\\n", sizeof({c_name}));')
        want.append(f"{c_name} {ctypes.sizeof(struct)}")
        for field, kind in struct._fields_:
            c_field = {"in_features": "in"}.get(field, field)
            lines.append(f'    printf("{c_name}.{c_field} %zu %zu %s\\n", offsetof({c_name}, {c_field}), sizeof {c_name}_.{c_field}, '
                         f"KIND({c_name}_.{c_field}));")
            want.append(f"{c_name}.{c_field} {getattr(struct, field).offset} {ctypes.sizeof(kind)} {KIND[kind]}")
    (tmp_path / "abi.c").write_text(ABI_C.replace("%s", "\n".join(lines)))
    subprocess.run([compiler(), f"-I{c_library.CSRC}", str(tmp_path / "abi.c"), "-o", str(tmp_path / "abi")], check=True)
    assert subprocess.run([str(tmp_path / "abi")], capture_output=True, text=True, check=True).stdout.splitlines() == want
    assert c_abi.MAX_HEAD_DIM == 256


@pytest.fixture
def csrc_copy(tmp_path, monkeypatch):
    """A copy of quantprep/csrc that c_library.py compiles in place of the package's, into a fresh cache."""
    copy = tmp_path / "csrc"
    shutil.copytree(c_library.CSRC, copy)
    monkeypatch.setattr(c_library, "CSRC", copy)
    monkeypatch.setattr(c_library, "HEADER", copy / "quantprep.h")
    monkeypatch.setenv("QUANTPREP_NATIVE_DIR", str(tmp_path / "cache"))
    return copy


@pytest.mark.parametrize("broken", [*FILES, "quantprep.h"])
def test_a_syntax_error_raises_with_the_compiler_s_output(csrc_copy, broken):
    """Not None and the slow path: CompileError, one line naming the file and the first error, the
    whole stderr on the exception (attribute and note)."""
    compiler()
    target = csrc_copy / (broken if broken.endswith(".h") else f"{broken}.c")
    target.write_text(target.read_text() + "int broken(void) { return 0 }\n")
    name = FILES[0] if broken.endswith(".h") else broken
    with pytest.raises(CompileError) as caught:
        c_library.library.__wrapped__(name)  # not the per-process cache
    message = str(caught.value)
    assert message.startswith(f"{csrc_copy / name}.c: does not compile with `") and "\n" not in message
    assert re.search(r"\.[ch]:\d+:\d+: error: expected .;. before .}.", message) and "QUANTPREP_NATIVE=0" in message
    assert "error" in caught.value.stderr and caught.value.__notes__ == [caught.value.stderr]


def test_a_library_that_does_not_load_raises(csrc_copy):
    compiler()
    (csrc_copy / "pack.c").write_text((csrc_copy / "pack.c").read_text() + "int missing(void);\nint broken(void) { return missing(); }\n")
    with pytest.raises(CompileError, match=r"pack\.c: its library .* does not load \(.*undefined symbol: missing"):
        c_library.library.__wrapped__("pack")


def test_a_compiler_without_openmp_builds_without_it(csrc_copy, monkeypatch):
    """-fopenmp that fails where the compiler cannot build OpenMP at all (Apple's clang): the library
    without it; where it can, the failure is the file's and raises."""
    compiler()
    (csrc_copy / "pack.c").write_text("#ifdef _OPENMP\n#error as a compiler without OpenMP would\n#endif\n" + (csrc_copy / "pack.c").read_text())
    monkeypatch.setattr(c_library, "openmp", lambda cc: False)
    assert c_library.library.__wrapped__("pack", ("-fopenmp",)).pack_int4_cpu
    monkeypatch.setattr(c_library, "openmp", lambda cc: True)
    with pytest.raises(CompileError, match="as a compiler without OpenMP would"):
        c_library.library.__wrapped__("pack", ("-fopenmp",))


def test_without_a_compiler_or_with_c_turned_off_there_is_no_library_and_a_reason(monkeypatch):
    monkeypatch.setattr(c_library, "_compiler", lambda: None)
    assert c_library.library.__wrapped__("pack") is None and c_library.unavailable_reason() == "no C compiler: put `cc` on PATH"
    monkeypatch.undo()
    monkeypatch.setenv("QUANTPREP_NATIVE", "0")
    assert c_library.library.__wrapped__("pack") is None and c_library.unavailable_reason() == "QUANTPREP_NATIVE=0"


def test_ci_fails_where_a_missing_library_would_skip(monkeypatch):
    monkeypatch.setattr(c_library, "_compiler", lambda: None)
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception, match="C kernels are not built here: no C compiler"):
        require_c(False)
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="no C compiler.*CI=true"):
        require_c(False)
    require_c(True)


# The kernels' numerics against torch (each exported function, both ISAs' a8 kernels), in a process
# whose libraries are built with the sanitizers into a cache of their own. ctypes loads them into a
# python that is not built with ASan: its runtime is preloaded, with libstdc++ (its __cxa_throw
# interceptor must find the real one at start-up), and it aborts the process on the first report.
SANITIZED = ["tests/test_cpu_attention.py", "tests/test_cpu_layers.py", "tests/targets/test_cpu.py", "tests/test_moe.py", "-k",
             "matches_float64 or past_exps or strided or rms_norm_matches or silu_mul or gemv_matches or decode_layer_is_one or "
             "native_pack_from_gptq or native_dequantize or unaligned or int4_a8_is_the or avx2_int4_a8 or int8_a8_is or int4_gemv or "
             "c_silu_product or sparse_decoder_layer or two_threads_decoding or equal_router"]
SANITIZE = ["-O1", "-g", "-march=native", "-shared", "-fPIC", "-fsanitize=address,undefined", "-fno-omit-frame-pointer",
            "-fno-sanitize-recover=all"]
RUN = """import sys
from quantprep.targets import c_library
c_library.FLAGS[:] = sys.argv[1].split()
import pytest
sys.exit(pytest.main(sys.argv[2:]))
"""


def test_the_kernels_tests_pass_under_address_and_undefined_behavior_sanitizers(tmp_path):
    cc = compiler()
    runtimes = [subprocess.run([cc, f"-print-file-name={n}"], capture_output=True, text=True).stdout.strip() for n in ("libasan.so", "libstdc++.so")]
    if not all(os.path.isabs(r) and os.path.exists(r) for r in runtimes):
        pytest.fail(f"`{cc}` has no AddressSanitizer runtime here") if os.environ.get("CI") == "true" else \
            pytest.skip(f"`{cc}` has no AddressSanitizer runtime here")
    env = dict(os.environ, LD_PRELOAD=" ".join(runtimes), ASAN_OPTIONS="detect_leaks=0", UBSAN_OPTIONS="print_stacktrace=1",
               QUANTPREP_NATIVE_DIR=str(tmp_path / "native"), CI="true")  # CI: a library that is missing fails, never skips
    out = subprocess.run([sys.executable, "-c", RUN, " ".join(SANITIZE), "-q", "-s", "-p", "no:cacheprovider", "-o", "addopts=",
                          *SANITIZED], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, (out.stdout + out.stderr)[-6000:]
    assert re.search(r"\b[1-9]\d+ passed", out.stdout) and " skipped" not in out.stdout, out.stdout[-3000:]
