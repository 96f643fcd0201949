"""Tests that need quantprep's C kernels (quantprep/csrc, targets/c_library.py) call `require_c`: where
the libraries are not built here (no compiler, QUANTPREP_NATIVE=0, a cache that is not this user's)
the test skips, naming why; under CI=true it fails instead, because CI must run the C and a skip
would hide a C that no longer builds. A C file that does not compile raises CompileError from
c_library.library, which fails a test wherever it runs."""

import os

import pytest

from quantprep.targets import c_library


def require_c(built: bool) -> None:
    """Skip (fail under CI=true) unless `built`; at a module's top level too (then the whole module)."""
    if built:
        return
    reason = f"quantprep's C kernels are not built here: {c_library.unavailable_reason()}"
    if os.environ.get("CI") == "true":
        pytest.fail(f"{reason} (CI=true: CI runs the C kernels, it does not skip them)", pytrace=False)
    pytest.skip(reason, allow_module_level=True)


def require_int4_a8() -> None:
    """require_c for the int8-activation kernels, then a skip (under CI too) where this CPU has neither
    of their ISAs (AVX2 and FMA, or AVX512-VNNI and VBMI)."""
    from quantprep.targets.cpu import native_a8_block

    require_c(c_library.library_with_torch_openmp("a8") is not None)
    if native_a8_block() == 0:
        pytest.skip("no int4_a8 on this CPU (AVX2 and FMA, or AVX512-VNNI and VBMI)", allow_module_level=True)


def require_engine() -> None:
    """require_int4_a8, and runtime/engine.py's libraries built."""
    from quantprep.runtime import engine

    require_c(engine.libraries() is not None)
    require_int4_a8()
