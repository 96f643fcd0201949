"""xpu_env.py: the Intel GPU runtime's rules, read from its source (docs/xpu.md), checked on
the CPU. No Arc card is reachable: these test our reading of the source, not a driver.

The oneDNN verbose lines below are the verbatim examples of oneDNN's docs
(doc/performance_considerations/verbose.md, v0 format) and lines written to the v1 format of
src/common/verbose.cpp (v3.6+) for the int4 matmul that PyTorch's WoQMatmul.cpp creates.
"""

import pytest

from quantprep.targets.xpu_env import (
    ARCHITECTURES,
    aot_name,
    arch_warning,
    cache_warning,
    igc_disables_cache,
    int4_matmul_report,
    neo_cache_state,
    onednn_notes,
    parse_driver_version,
    parse_onednn_verbose,
    primitive_cache_env,
    xpu_cache_report,
)

LINUX_2_8 = ["pvc", "bmg", "dg2", "arl-h", "mtl-h", "lnl-m"]  # torch-xpu-ops release/2.8 cmake/BuildFlags.cmake
LINUX_2_10 = LINUX_2_8 + ["ptl-h", "ptl-u"]  # release/2.10 through 2.14

# Every card the issue names: (device name as Level Zero reports it, SYCL architecture, AOT name).
CARDS = [
    ("Intel(R) Arc(TM) A770 Graphics", 0x030DC00800, "dg2"),
    ("Intel(R) Arc(TM) A750 Graphics", 0x030DC00800, "dg2"),
    ("Intel(R) Arc(TM) A580 Graphics", 0x030DC00800, "dg2"),
    ("Intel(R) Arc(TM) A380 Graphics", 0x030E000500, "dg2"),
    ("Intel(R) Arc(TM) Pro A40/A50 Graphics", 0x030E000500, "dg2"),
    ("Intel(R) Arc(TM) Pro A60 Graphics", 0x030E400000, "dg2"),
    ("Intel(R) Arc(TM) B580 Graphics", 0x0500400400, "bmg"),
    ("Intel(R) Arc(TM) B570 Graphics", 0x0500400400, "bmg"),
    ("Intel(R) Arc(TM) Pro B50 Graphics", 0x0500400400, "bmg"),
    ("Intel(R) Arc(TM) Pro B60 Graphics", 0x0500400400, "bmg"),
    ("Intel(R) Arc(TM) Graphics", 0x0311C00400, "mtl-h"),  # Meteor Lake H
    ("Intel(R) Arc(TM) Graphics", 0x0312800400, "arl-h"),  # Arrow Lake H
    ("Intel(R) Arc(TM) 140V GPU (16GB)", 0x0501000400, "lnl-m"),  # Lunar Lake
]


@pytest.mark.parametrize("name,architecture,aot", CARDS)
def test_every_card_maps_to_the_aot_build_that_covers_it(name, architecture, aot):
    assert aot_name(architecture, name) == aot
    assert arch_warning(name, LINUX_2_8, architecture) is None  # torch's Linux wheels cover all of these
    others = [a for a in LINUX_2_10 if a != aot]
    assert f"({aot})" in arch_warning(name, others, architecture)  # a wheel without its build: warned


@pytest.mark.parametrize("name,aot", [(n, a) for n, _, a in CARDS if "Arc(TM) Graphics" not in n])
def test_the_name_is_the_fallback_without_architecture(name, aot):
    assert aot_name(None, name) == aot


def test_what_cannot_be_told_is_said():
    # The Meteor/Arrow Lake iGPUs share one name; only `architecture` tells them apart.
    assert aot_name(None, "Intel(R) Arc(TM) Graphics") is None
    assert "cannot tell" in arch_warning("Intel(R) Arc(TM) Graphics", LINUX_2_10)
    # Meteor Lake U/S (= Arrow Lake U/S): no Linux wheel has an AOT build for it.
    assert "(mtl-u)" in arch_warning("Intel(R) Graphics", LINUX_2_10, 0x0311800400)
    assert {aot for _, aot in ARCHITECTURES.values()} >= set(LINUX_2_10)  # every AOT target is reachable


@pytest.mark.parametrize("text,parsed", [("1.6.33578+38", (33578, 38)), ("1.3.29735", (29735, None)),
                                         ("1.17.39395+13", (39395, 13)), ("?", None), (None, None), ("25.18", None)])
def test_driver_version(text, parsed):
    assert parse_driver_version(text) == parsed


@pytest.mark.parametrize("driver,off", [("1.6.33578+38", True), ("1.6.33578+36", True), ("1.6.33578+31", False),
                                        ("1.6.33578", None), ("1.6.33944+13", False), ("1.6.34303+9", False),
                                        ("1.6.34666+3", True), ("1.3.29735", False), (None, None)])
def test_igc_variables_disable_the_cache_only_on_some_drivers(driver, off):
    assert igc_disables_cache(parse_driver_version(driver)) is off


def test_neo_cache_state(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    on = neo_cache_state({"HOME": str(home)})
    assert on["enabled"] is True and on["dir"] == str(home / ".cache" / "neo_compiler_cache") and "1 GiB" in on["why"]
    assert neo_cache_state({})["enabled"] is False  # neither HOME nor XDG_CACHE_HOME
    assert neo_cache_state({"HOME": str(home), "NEO_CACHE_PERSISTENT": "0"})["enabled"] is False
    missing = neo_cache_state({"HOME": str(home), "NEO_CACHE_DIR": str(tmp_path / "nope")})
    assert missing["enabled"] is False and "does not exist" in missing["why"]
    assert neo_cache_state({"NEO_CACHE_DIR": str(tmp_path), "NEO_CACHE_MAX_SIZE": "0"}) == {
        "enabled": True, "dir": str(tmp_path), "why": "on, no size limit"}
    assert neo_cache_state({"HOME": str(home), "XDG_CACHE_HOME": str(tmp_path / "nope")})["enabled"] is False  # no fallback
    assert neo_cache_state({"XDG_CACHE_HOME": str(tmp_path)})["dir"] == str(tmp_path / "neo_compiler_cache")
    igc = {"HOME": str(home), "IGC_ShaderDumpEnable": "1"}
    assert neo_cache_state(igc, "1.6.33578+38")["enabled"] is False
    assert neo_cache_state(igc, "1.6.34303+9")["enabled"] is True
    unknown = neo_cache_state(igc, None)
    assert unknown["enabled"] is None and "IGC_ShaderDumpEnable" in unknown["why"]
    assert cache_warning(igc, "1.6.33578+38").startswith("the Intel driver's kernel cache is off: IGC_ShaderDumpEnable")
    assert "maybe off" in cache_warning(igc) and cache_warning({"HOME": str(home)}) is None


DOC_LINES = """\
onednn_verbose,v0,primitive,info,template:operation,engine,primitive,implementation,prop_kind,memory_descriptors,attributes,auxiliary,problem_desc,exec_time
onednn_verbose,v0,1693533460193.346924,primitive,create:cache_miss,cpu,convolution,jit:avx512_core,forward_training,src_f32:a:blocked:aBcd16b::f0 wei_f32:a:blocked:ABcd16b16a::f0 bia_f32:a:blocked:a::f0 dst_f32:a:blocked:aBcd16b::f0,,alg:convolution_direct,mb2_ic16oc16_ih7oh7kh5sh1dh0ph2_iw7ow7kw5sw1dw0pw2,0.709961
onednn_verbose,v0,1693533460194.199951,primitive,create:cache_hit,cpu,convolution,jit:avx512_core,forward_training,src_f32:a:blocked:aBcd16b::f0 wei_f32:a:blocked:ABcd16b16a::f0 bia_f32:a:blocked:a::f0 dst_f32:a:blocked:aBcd16b::f0,,alg:convolution_direct,mb2_ic16oc16_ih7oh7kh5sh1dh0ph2_iw7ow7kw5sw1dw0pw2,0.0161133
onednn_verbose,v0,1693533460229.437012,primitive,exec,cpu,reorder,jit:uni,undef,src_f32::blocked:abcd::f0 dst_f32::blocked:ABcd16b16a::f0,,,16x16x5x5,16.481
""".splitlines()

INT4_LINES = """\
onednn_verbose,v1,info,gpu,runtime:DPC++,nthr:1
onednn_verbose,v1,primitive,create:cache_miss,gpu,matmul,jit:gemm:any,undef,src:f16::blocked:ab::f0 wei:u4::blocked:ba::f0 dst:f16::blocked:ab::f0,attr-scales:wei:3:f16:128x1 attr-zero-points:wei:3:s8:128x1,,1x1024:1024x1024,312.5
onednn_verbose,v1,primitive,exec,gpu,matmul,jit:gemm:any,undef,src:f16::blocked:ab::f0 wei:u4::blocked:ba::f0 dst:f16::blocked:ab::f0,attr-scales:wei:3:f16:128x1 attr-zero-points:wei:3:s8:128x1,,1x1024:1024x1024,0.051
onednn_verbose,v1,primitive,exec,gpu,matmul,jit:gemm:any,undef,src:f16::blocked:ab::f0 wei:u4::blocked:ba::f0 dst:f16::blocked:ab::f0,attr-scales:wei:3:f16:128x1 attr-zero-points:wei:3:s8:128x1,,1x1024:1024x1024,0.049
onednn_verbose,v1,primitive,create:cache_miss,gpu,matmul,ocl:ref:any,undef,src:f16::blocked:ab::f0 wei:u4::blocked:ba::f0 dst:f16::blocked:ab::f0,attr-scales:wei:3:f16:128x1 attr-zero-points:wei:3:s8:128x1,,512x1024:1024x1024,25.0
onednn_verbose,v1,primitive,exec,gpu,matmul,ocl:ref:any,undef,src:f16::blocked:ab::f0 wei:u4::blocked:ba::f0 dst:f16::blocked:ab::f0,attr-scales:wei:3:f16:128x1 attr-zero-points:wei:3:s8:128x1,,512x1024:1024x1024,41.7
onednn_verbose,v1,primitive,exec,gpu,matmul,jit:gemm:any,undef,src:f16::blocked:ab::f0 wei:f16::blocked:ba::f0 dst:f16::blocked:ab::f0,,,4x1024:1024x1024,0.02
""".splitlines()


def test_the_verbose_parser_reads_the_docs_lines():
    rows = parse_onednn_verbose(DOC_LINES + ["not a verbose line", "onednn_verbose,v0,primitive,exec,too,short"])
    assert [(r["op"], r["primitive"], r["impl"], r["weights"], r["ms"]) for r in rows] == [
        ("create:cache_miss", "convolution", "jit:avx512_core", "f32", 0.709961),
        ("create:cache_hit", "convolution", "jit:avx512_core", "f32", 0.0161133),
        ("exec", "reorder", "jit:uni", None, 16.481)]
    assert not any(r["reference"] for r in rows)


def test_int4_matmul_report_names_the_implementation_and_the_fallback():
    report = int4_matmul_report(INT4_LINES)
    assert [(p["problem"], p["impl"], p["reference"], p["create_ms"], p["exec_ms"]) for p in report] == [
        ("1x1024:1024x1024", "jit:gemm:any", False, 312.5, [0.051, 0.049]),
        ("512x1024:1024x1024", "ocl:ref:any", True, 25.0, [41.7])]  # the f16-weight matmul is not int4


def test_selftest_notes_say_when_the_card_falls_back():
    notes = onednn_notes(int4_matmul_report(INT4_LINES))
    assert "REFERENCE" not in notes[0] and "created in 312.5 ms" in notes[0]
    assert "REFERENCE kernel" in notes[1] and "ocl:ref:any" in notes[1]
    assert "no int4 matmul" in onednn_notes([])[0]
    env = {"HOME": "/nonexistent-home", "IGC_ForceOCLSIMDWidth": "16"}
    cache = xpu_cache_report(env, LINUX_2_10, "Intel(R) Arc(TM) A770 Graphics", 0x030DC00800, "1.6.33578+38")
    assert "AOT kernels for Intel(R) Arc(TM) A770 Graphics (dg2)" in cache[0]
    assert "driver kernel cache OFF: IGC_ForceOCLSIMDWidth set" in cache[1]
    assert "MAYBE OFF" in xpu_cache_report(env, LINUX_2_10, "Intel(R) Arc(TM) A770 Graphics", None, None)[1]


def test_primitive_cache_capacity_is_raised_only_when_needed():
    assert primitive_cache_env(5, 4, {}) == {}  # 20 primitives: the default 1024 holds them
    assert primitive_cache_env(300, 4, {}) == {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "1200"}
    assert primitive_cache_env(300, 4, {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "64"}) == {}  # the user's choice stands
