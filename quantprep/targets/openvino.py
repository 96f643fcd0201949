"""openvino target: GPTQ layers as OpenVINO compressed weights, the integers as they are, act-order right.

OpenVINO's plugins keep a weight compressed when it reaches the MatMul through
Convert -> Subtract(zero point) -> Multiply(scale) -> Reshape -> Convert(f32); a Convert to f32
before the Reshape gets the weight folded to f32 (docs/openvino.md). A GPTQ layer maps onto that
pattern without requantizing:

- the codes [K, N] in act-order (a PrepackLayer's: row k belongs to group k // group_size) become
  the weight [N, G, gs]: u4 (two codes a byte, low nibble first) or u8;
- zeros and scales [G, N] become [N, G, 1], one per group. Never per element ([N, K], a gather by
  g_idx inside the weight): the CPU plugin computes those wrong, or crashes;
- a symmetric layer (every zero 2^(bits-1)) becomes i4/i8 holding code - zero, with no Subtract: a
  relabelling of the same integers;
- the activation takes a Gather with the act-order permutation, x @ W = x[:, perm] @ W_perm
  (optimum-intel's export and OpenVINO's PyTorch frontend read groups as contiguous and skip this);
- a partial last group: K padded with zero codes up to G * gs, the activation with zeros.

`pack` gives these as plain tensors (no openvino needed); `linear` makes the graph nodes, from
those tensors at build time, or from the constants of a written IR (verify). The IR names each
constant `<module>.<part>`, so a module can be found in it again.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import re
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from quantprep.format.expert_names import expert_linear
from quantprep.targets.base import Target, base_meta

if TYPE_CHECKING:  # torch is imported where a function needs it: an openvino artifact loads without torch
    import torch

    from quantprep.format.gptq import PrepackLayer

IR_VERSION = 11  # what ov.save_model writes (openvino 2026.4)
PARTS = ("weight", "zeros", "scales", "perm", "bias")


def package_version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "none"


def openvino_version() -> str | None:
    """major.minor of the installed openvino: IR written by one is read the same by the other patches."""
    try:
        return ".".join(importlib.metadata.version("openvino").split(".")[:2])
    except importlib.metadata.PackageNotFoundError:
        return None


def pack_nibbles(values: np.ndarray) -> np.ndarray:
    """Integers in [-8, 16) -> bytes, two a byte, the even element in the low nibble (OpenVINO's u4/i4)."""
    nibbles = (values.reshape(-1).astype(np.int16) & 0xF).astype(np.uint8)
    return nibbles[0::2] | (nibbles[1::2] << 4)


def float_storage(t: torch.Tensor) -> torch.Tensor:
    """The narrowest of float16 / bfloat16 / float32 that holds `t` exactly: GPTQ checkpoints keep
    their float tensors in f16 or bf16, so the IR needs no float32 copy of the embeddings."""
    import torch

    t = t.detach()
    for dtype in (torch.float16, torch.bfloat16):
        narrow = t.to(dtype)
        if t.dtype == dtype or torch.equal(narrow.to(t.dtype), t):
            return narrow
    return t.float()


class OpenVINOTarget(Target):
    name = "openvino"
    device = "openvino"  # OpenVINO picks the device (CPU, GPU) at load; torch runs nothing
    kind = "graph"
    # its model cache is for the serving device (`quantprep warm DIR --device GPU` on the Arc); on a CPU
    # it did not shorten the start and doubled the artifact (BENCHMARKS.md, "OpenVINO target")
    warm_at_build = False
    quantized_lm_head = False  # the IR keeps the checkpoint's lm_head
    model_format = "openvino"
    layout_version = 3  # 2: the pad value explicit in the IR (a rebuilt graph compares equal); 3: traced from transformers

    @property
    def default_act_dtype(self) -> torch.dtype:
        """The IR's activations; the plugin's inference precision is a load option."""
        import torch

        return torch.float32

    @property
    def act_dtypes(self) -> tuple[torch.dtype, ...]:
        return (self.default_act_dtype,)

    def compat_key(self) -> dict:
        """The IR is transformers' modeling code traced by torch and converted by OpenVINO: load's check
        makes it again, which gives the same IR only with the same three."""
        return {"openvino": openvino_version(), "openvino_ir": IR_VERSION, "transformers": package_version("transformers"),
                "torch": ".".join(package_version("torch").split("+")[0].split(".")[:2])}

    def runtime_problem(self) -> str | None:
        if openvino_version() is None:
            return "openvino is not installed: pip install 'quantprep[openvino]'"
        return None

    def kernel(self, bits: int) -> str:
        return f"openvino-compressed-int{bits}"

    def pack(self, layer: PrepackLayer, act_dtype: torch.dtype) -> tuple[dict[str, torch.Tensor], dict]:
        """weight uint8 [N, G * gs / 2] (4-bit, packed) or [N, G * gs] (8-bit; int8 when symmetric),
        zeros uint8 [N, G] (asymmetric only), scales [N, G] (f16 where exact), perm int64 [K]
        (act-order), bias (as stored)."""
        import torch

        K, N, gs = layer.in_features, layer.out_features, layer.group_size
        G = layer.zeros.shape[0]
        if G * gs < K or (G * gs) % 2:
            raise ValueError(f"{layer.name}: {G} groups of {gs} do not cover K={K} in whole bytes")
        codes = np.zeros((N, G * gs), dtype=np.int16)
        codes[:, :K] = layer.codes.numpy().T  # padded columns: code 0, read against zero activations
        zeros = layer.zeros.numpy().T  # [N, G]
        half = 1 << (layer.bits - 1)
        sym = bool((zeros == half).all())
        if sym:
            codes -= half
        if layer.bits == 4:
            weight = torch.from_numpy(pack_nibbles(codes).reshape(N, G * gs // 2))
        else:
            weight = torch.from_numpy(codes.astype(np.int8 if sym else np.uint8))
        tensors = {"weight": weight, "scales": float_storage(layer.scales.T.contiguous())}
        if not sym:
            tensors["zeros"] = torch.from_numpy(np.ascontiguousarray(zeros.astype(np.uint8)))
        if layer.perm is not None:
            tensors["perm"] = layer.perm.to(torch.int64)
        if layer.bias is not None:
            tensors["bias"] = float_storage(layer.bias)
        return tensors, dict(base_meta(layer), sym=sym, groups=G, padded_in=G * gs)

    def make_module(self, meta: dict, act_dtype: torch.dtype):
        raise ValueError("an openvino artifact runs in OpenVINO (quantprep.load returns its pipeline), not as torch modules")


TARGET = OpenVINOTarget()


def constants(tensors: dict[str, torch.Tensor], meta: dict, name: str, experts: int | None = None) -> dict:
    """A module's tensors from `pack` -> OpenVINO Constants named `<name>.<part>`; `experts`: the
    tensors of that many modules stacked on a first axis (runtime/openvino_graph.py's tiled experts)."""
    import openvino as ov
    import torch

    N, G, gs = meta["out_features"], meta["groups"], meta["padded_in"] // meta["groups"]
    lead = [experts] if experts else []
    out = {}
    for part, t in tensors.items():
        if part == "weight" and meta["bits"] == 4:
            data = ov.Tensor(np.ascontiguousarray(t.numpy()), ov.Shape([*lead, N, G, gs]), ov.Type.i4 if meta["sym"] else ov.Type.u4)
        elif part == "zeros" and meta["bits"] == 4:
            data = ov.Tensor(np.ascontiguousarray(pack_nibbles(t.numpy())), ov.Shape([*lead, N, G, 1]), ov.Type.u4)
        else:
            shape = {"weight": [*lead, N, G, gs], "zeros": [*lead, N, G, 1], "scales": [*lead, N, G, 1]}.get(part, list(t.shape))
            if t.dtype == torch.bfloat16:  # numpy has no bfloat16: its bits, relabelled
                data = ov.Tensor(np.ascontiguousarray(t.view(torch.int16).numpy().reshape(shape)), ov.Shape(shape), ov.Type.bf16)
            else:
                data = ov.Tensor(np.ascontiguousarray(t.numpy().reshape(shape)))
        # shared_memory=False: a Constant sharing a temporary buffer would read freed memory
        out[part] = ov.op.Constant(data, shared_memory=False)
        out[part].set_friendly_name(f"{name}.{part}")
    return out


def float_constant(t: torch.Tensor, name: str):
    """A Constant named `name` holding `t` in the narrowest float type that holds it exactly."""
    import openvino as ov
    import torch

    t = float_storage(t)
    if t.dtype == torch.bfloat16:  # numpy has no bfloat16: its bits, relabelled
        data = ov.Tensor(np.ascontiguousarray(t.view(torch.int16).numpy()).view(np.uint16), ov.Shape(list(t.shape)), ov.Type.bf16)
    else:
        data = ov.Tensor(np.ascontiguousarray(t.numpy()))
    c = ov.op.Constant(data, shared_memory=False)
    c.set_friendly_name(name)
    return c


def ir_constants(model, name: str, meta: dict) -> dict:
    """A module's constants found again in a read IR (verify), by the names `constants` gave them;
    an expert's, where its layer's experts are stacked (tiled), as its rows of the stacked ones; a
    permutation, where OpenVINO kept one of equal Gathers (`perm_of`), as the one kept."""
    import openvino.opset13 as ops

    wanted = {f"{name}.{part}": part for part in PARTS} | ({f"{meta['perm_of']}.perm": "perm"} if "perm_of" in meta else {})
    named = {op.get_friendly_name(): op for op in model.get_ops() if op.get_type_name() == "Constant"}
    found = {part: named[n] for n, part in wanted.items() if n in named}
    if found or (e := expert_linear(name)) is None:
        return found
    kinds = ("gate_proj", "up_proj") if e.projection == "gate_up_proj" else (e.projection,)
    for part in ("weight", "zeros", "scales"):
        if all(f"{e.experts}.{kind}.{part}" in named for kind in kinds):
            rows = [ops.gather(named[f"{e.experts}.{kind}.{part}"], ops.constant(np.int64(e.index)), ops.constant(np.int64(0)))
                    for kind in kinds]
            found[part] = rows[0] if len(rows) == 1 else ops.concat(rows, 0)
    return found


def decompressed(consts: dict, shape: list[int]):
    """The f32 weight of compressed constants (codes, zero points, scales), reshaped to `shape`, in
    the pattern the plugins keep compressed."""
    import openvino as ov
    import openvino.opset13 as ops

    half = consts["scales"].get_output_element_type(0)
    w = ops.convert(consts["weight"], half)
    if "zeros" in consts:
        w = ops.subtract(w, ops.convert(consts["zeros"], half))
    w = ops.reshape(ops.multiply(w, consts["scales"]), ops.constant(np.array(shape, dtype=np.int64)), False)
    return ops.convert(w, ov.Type.f32)


def linear(x, consts: dict, meta: dict):
    """x [..., K] f32 @ the module's weight (+ bias): the activation gathered into act-order and
    padded to whole groups, the weight decompressed in the pattern the plugins keep compressed."""
    import openvino as ov
    import openvino.opset13 as ops

    padded = meta["padded_in"]
    w = decompressed(consts, [meta["out_features"], padded])
    if "perm" in consts:
        x = ops.gather(x, consts["perm"], ops.constant(np.int64(-1)))
    if padded != meta["in_features"]:
        rank = x.get_output_partial_shape(0).rank.get_length() if hasattr(x, "get_output_partial_shape") else x.get_partial_shape().rank.get_length()
        x = ops.pad(x, ops.constant(np.zeros(rank, dtype=np.int64)),
                    ops.constant(np.array([0] * (rank - 1) + [padded - meta["in_features"]], dtype=np.int64)), "constant",
                    ops.constant(np.float32(0)))  # the pad value explicit: a read IR holds it, so a rebuilt graph compares equal
    y = ops.matmul(x, w, False, True)
    if "bias" in consts:
        y = ops.add(y, ops.convert(consts["bias"], ov.Type.f32))
    return y


# --- an IR's files compared as text and bytes, never read by OpenVINO first ---
# OpenVINO's IR reader infers shapes as it reads, which evaluates constant subgraphs: reading an IR
# runs part of it. So an IR from an artifact is compared with one quantprep writes before any reader sees it.

AUTO_NAME = re.compile(r"[A-Za-z]+_[0-9]+")  # OpenVINO's name for an unnamed node or tensor: no runtime looks one up
WRITER_RT_INFO = ("OpenVINO Runtime",)  # the writing runtime's version, which no reader acts on


def ir_tree(data: bytes) -> ET.Element:
    """An IR's .xml parsed by Python's XML parser: its root must be <net>; no DTD (no entities)."""
    if b"<!DOCTYPE" in data or b"<!ENTITY" in data:
        raise ValueError("it declares a DTD, which no IR has")
    try:
        root = ET.fromstring(data)
    except ET.ParseError as e:
        raise ValueError(f"not XML ({e})") from None
    if root.tag != "net":
        raise ValueError(f"its root element is <{root.tag[:40]}>, not <net>")
    return root


def canonical_ir(root: ET.Element, ignore_rt_info: tuple[str, ...] = ()) -> bytes:
    """The IR's .xml as what it computes: layer names and OpenVINO's automatic tensor names dropped,
    the writer's version and `ignore_rt_info` entries left out; everything else as written."""
    root = ET.fromstring(ET.tostring(root))  # a copy
    for layer in root.iter("layer"):
        layer.attrib.pop("name", None)
    for element, attribute in [(port, "names") for port in root.iter("port")] + [(layer, "output_names") for layer in root.iter("layer")]:
        if attribute in element.attrib:
            kept = [n for n in element.attrib[attribute].split(",") if not AUTO_NAME.fullmatch(n.strip())]
            element.attrib[attribute] = ",".join(kept)
    for info in root.findall("rt_info"):
        for entry in list(info):  # only a bare value: an entry with children or other attributes is compared
            named = entry.tag in (*WRITER_RT_INFO, *ignore_rt_info) or entry.get("name") in (*WRITER_RT_INFO, *ignore_rt_info)
            if named and len(entry) == 0 and set(entry.attrib) <= {"name", "value"}:
                info.remove(entry)
    return ET.tostring(root)


def saved_ir(model, directory: Path, name: str = "model") -> tuple[ET.Element, str]:
    """`model` as ov.save_model writes it (as prepack does): its .xml parsed and its .bin's sha256."""
    import openvino as ov

    ov.save_model(model, directory / f"{name}.xml", compress_to_fp16=False)
    digest = hashlib.sha256()
    with open(directory / f"{name}.bin", "rb") as f:
        for chunk in iter(lambda: f.read(1 << 24), b""):
            digest.update(chunk)
    return ir_tree((directory / f"{name}.xml").read_bytes()), digest.hexdigest()


def ir_difference(want: ET.Element, want_bin: str, got: ET.Element, got_bin: str, ignore_rt_info: tuple[str, ...] = ()) -> str | None:
    """The first difference between two IRs as programs (canonical_ir, and the .bin's bytes), or None."""
    a, b = canonical_ir(want, ignore_rt_info).splitlines(), canonical_ir(got, ignore_rt_info).splitlines()
    if a != b:
        i = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
        line = lambda lines: lines[i].strip()[:160].decode(errors="replace") if i < len(lines) else "(the end)"  # noqa: E731
        return f"line {i + 1} of its graph is {line(b)!r} where quantprep writes {line(a)!r}"
    if want_bin != got_bin:
        return "its .bin holds other bytes than quantprep writes for it"
    return None
