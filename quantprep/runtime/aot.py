"""Compiled decoder MLPs: built at warm, loaded at load without dynamo.

torch.compile with every kernel in the cache still costs seconds per process on a CPU (the first
compile call, the dynamo trace, Inductor hashing its sources for the cache key, loading the graph:
mode b2 in benchmarks/results/kcache-cpu-smollm2-aot.json). Two formats skip the trace, tried in
this order (FORMATS):
- "aoti": an AOTInductor package, the compiled graph as a shared library in a zip (no pickle);
  loading one takes ~0.15 s. AOTInductor's loader crashes on some installs (every package,
  even a plain matmul, under the GPU machine's torch 2.11): warm's check then rejects it.
- "inductor": Inductor's standalone compile of the same exported graph, its Python wrapper and
  kernels in Inductor's own cache format (`CompiledArtifact`, the bytes of the mega-cache);
  loading imports Inductor and hashes torch's sources (~1 s) but still skips dynamo.
The weights stay in the artifact: the MLP is exported as a function of (tokens x hidden, *its
tensors), so one package serves every layer of the same shape, and a new package is not a second
copy of the model.

The kernels choose a code path by token count (cpu int4 dequantizes from 384 rows, cuda runs
tinygemm up to 16), so export specializes: `export_ranges` exports from 1 token up, and each
export's range constraint says where the next one starts. A token count outside every range
(longer than the model's context) runs eagerly.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import threading
import warnings
from pathlib import Path

import torch
from torch import nn
from torch.func import functional_call

from quantprep.errors import QuantprepError
from quantprep.format.artifact import AOT_FORMATS as FORMATS
from quantprep.format.artifact import package_format

MAX_RANGES = 6  # more means export keeps specializing on exact sizes: give up (torch.compile is used)
CHECK_REL_ERR = 2e-2  # package vs eager MLP: bf16 activations, Inductor keeps silu*mul in float32
AOT_DIR = "aot"


def _tensors(mlp: nn.Module) -> tuple[list[str], list[torch.Tensor]]:
    named = [(n, t) for n, t in [*mlp.named_parameters(), *mlp.named_buffers()] if t is not None]
    return [n for n, _ in named], [t for _, t in named]


def signature(mlp: nn.Module, dtype: torch.dtype) -> str:
    """What the traced graph depends on: module classes, their plain attributes (a kernel plan too), and each
    tensor's name, shape, dtype and device. Layers with equal signatures share a package."""
    parts = [str(dtype)]
    for name, m in mlp.named_modules():
        # plain attributes, and a kernel plan's ranges: export follows the planned paths
        attrs = sorted((k, v) for k, v in vars(m).items()
                       if (isinstance(v, (bool, int, float, str, type(None))) or k == "plan") and not k.startswith("_"))
        parts.append(f"{name}:{type(m).__qualname__}:{attrs}")
    names, tensors = _tensors(mlp)
    parts += [f"{n}:{tuple(t.shape)}:{t.dtype}:{t.device.type}" for n, t in zip(names, tensors, strict=True)]
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:16]


class _AsFunction(nn.Module):
    """The MLP as a function of (x [tokens, hidden], *tensors): the weights are inputs."""

    def __init__(self, mlp: nn.Module, names: list[str]):
        super().__init__()
        self.mlp, self.names = mlp, names

    def forward(self, x: torch.Tensor, *tensors: torch.Tensor) -> torch.Tensor:
        return functional_call(self.mlp, dict(zip(self.names, tensors, strict=True)), (x,))


def export_ranges(mlp: nn.Module, hidden: int, max_tokens: int) -> list[tuple[int, int, object]]:
    """[(lo, hi, ExportedProgram)] covering 1..max_tokens tokens."""
    from torch.export import Dim
    from torch.utils._sympy.numbers import int_oo

    names, tensors = _tensors(mlp)
    device, dtype = tensors[0].device, next(t.dtype for t in tensors if t.is_floating_point())
    fn, out, lo = _AsFunction(mlp, names), [], 1
    while lo <= max_tokens:
        if len(out) == MAX_RANGES:
            raise RuntimeError(f"export specialized into more than {MAX_RANGES} token ranges")
        x = torch.randn(lo, hidden, device=device, dtype=dtype)
        dynamic = None if lo == 1 else ({0: Dim.AUTO}, (None,) * len(tensors))  # size 1 is always static
        ep = torch.export.export(fn, (x, *tensors), dynamic_shapes=dynamic, strict=False)
        size = next(n for n in ep.graph.nodes if n.op == "placeholder" and n.name == "x").meta["val"].shape[0]
        expr = size if isinstance(size, int) else size.node.expr  # a range of one length (a plan's switch) is a number
        hi = int(expr) if isinstance(expr, int) or expr.is_number else ep.range_constraints[expr].upper  # a sympy number
        hi = max_tokens if hi == int_oo or int(hi) > max_tokens else int(hi)
        out.append((lo, hi, ep))
        lo = hi + 1
    return out


def _standalone_compile(ep, example: list[torch.Tensor]):
    """Inductor on the exported graph, no dynamo. Export lifted the MLP's own buffers as inputs
    that nothing reads (functional_call passes the tensors instead): they are dropped, so the
    compiled graph takes (x, *tensors) like the AOTInductor package."""
    gm = ep.graph_module
    lifted = {spec.arg.name for spec in ep.graph_signature.input_specs if spec.kind.name != "USER_INPUT"}
    for node in [n for n in gm.graph.nodes if n.op == "placeholder" and n.name in lifted]:
        gm.graph.erase_node(node)  # raises if the graph reads it
    gm.recompile()
    return torch._inductor.standalone_compile(gm, example, dynamic_shapes="from_graph")


def build_packages(model, out_dir: Path, dtype: torch.dtype, fmt: str = "aoti") -> list[dict]:
    """Export and compile (format `fmt`, see FORMATS) every distinct decoder MLP; returns the
    manifest's `aot` list."""
    from torch._inductor import aoti_compile_and_package

    max_tokens = getattr(model.config, "max_position_embeddings", None) or 8192
    entries, done = [], set()
    for mlp in decoder_mlps(model):
        if (sig := signature(mlp, dtype)) in done:
            continue
        done.add(sig)
        tensors = _tensors(mlp)[1]
        for lo, hi, ep in export_ranges(mlp, model.config.hidden_size, max_tokens):
            rel = f"{AOT_DIR}/mlp-{sig}-{lo}-{hi}{FORMATS[fmt]}"
            (out_dir / AOT_DIR).mkdir(parents=True, exist_ok=True)
            if fmt == "aoti":
                aoti_compile_and_package(ep, package_path=str(out_dir / rel))
            else:
                x = torch.randn(lo, model.config.hidden_size, dtype=dtype, device=tensors[0].device)
                _standalone_compile(ep, [x, *tensors]).save(path=str(out_dir / rel), format="binary")
            entries.append({"file": rel, "signature": sig, "tokens": [lo, hi], "format": fmt})
    return entries


def load_package(root: Path, entry: dict):
    """A callable (x, *tensors) -> y for the `aot` entry's package under `root`, of either format."""
    path = root / entry["file"]
    if package_format(entry) == "aoti":
        from torch._inductor import aoti_load_package

        return aoti_load_package(str(path))
    compiled = torch._inductor.CompiledArtifact.load(path=str(path), format="binary")
    return lambda *args: compiled(*args)[0]  # the graph's outputs, a list of one


# What CompiledArtifact.load imports before its first package: compile_fx is most of Inductor.
INDUCTOR_RUNTIME = ["torch._inductor.standalone_compile", "torch._inductor.compile_fx"]


def _import_inductor_runtime() -> None:
    try:
        for name in INDUCTOR_RUNTIME:
            importlib.import_module(name)
        from torch._inductor.codecache import torch_key

        torch_key()  # the hash of torch's sources that the artifacts are keyed by (cached per process)
    except Exception:  # install() imports again in the main thread and reports what fails
        pass


def prefetch_runtime(entries: list[dict]) -> threading.Thread | None:
    """When the packages are Inductor artifacts, import Inductor in a background thread while
    load copies the weights; the caller must have done its own imports first (two threads
    importing modules that import each other can see a partly initialised module).

    The copies to the GPU release the GIL, so part of the import overlaps them: less load time on
    the H100 (mode b4, without the thread, in benchmarks/results/kcache-cuda-h100-prefetch*.json);
    on the CPU (mmapped weights) neither gain nor loss.
    AOTInductor packages import little once dynamo is loaded (0.03 s): no thread for them."""
    if not any(package_format(e) == "inductor" for e in entries):
        return None
    thread = threading.Thread(target=_import_inductor_runtime, name="quantprep-prefetch", daemon=True)
    thread.start()
    return thread


CHECK_BYTES = 256 << 20  # activations of one check run, eager and package: caps the high end of a range


def check_points(lo: int, hi: int, bytes_per_token: int) -> list[int]:
    """Token counts a package is checked at: its range's low end, 64 tokens in, and its high end as
    far as CHECK_BYTES of activations allow (a range can reach the model's whole context)."""
    top = min(hi, max(lo, CHECK_BYTES // bytes_per_token))
    return sorted({lo, min(hi, lo + 63), top})


def check_packages(model, root: Path, entries: list[dict], dtype: torch.dtype) -> dict[str, str]:
    """Run each package (fresh process: warm's check phase) at both ends of its token range (and 64
    tokens in) against the eager MLP it stands for; returns {file: problem} for those that must not ship."""
    mlps = {signature(mlp, dtype): mlp for mlp in decoder_mlps(model)}
    per_token = 4 * (model.config.hidden_size * 2 + 3 * getattr(model.config, "intermediate_size", model.config.hidden_size * 4))
    gen = torch.Generator().manual_seed(0)
    bad = {}
    for e in entries:
        mlp = mlps.get(e["signature"])
        if mlp is None:
            bad[e["file"]] = "no MLP of this signature in the model"
            continue
        tensors = _tensors(mlp)[1]
        try:
            run = load_package(root, e)
            for tokens in check_points(*e["tokens"], per_token):
                x = torch.randn(tokens, model.config.hidden_size, generator=gen).to(tensors[0].device, dtype)
                with torch.inference_mode():
                    want, got = mlp(x).float(), run(x, *tensors).float()
                rel = ((got - want).norm() / want.norm()).item()
                if not rel <= CHECK_REL_ERR:  # also NaN
                    bad[e["file"]] = f"{tokens} tokens: relative error {rel:.2e} vs eager"
        except Exception as exc:  # any failure to load or run: the package is not shipped
            bad[e["file"]] = f"{type(exc).__name__}: {str(exc)[:200]}"
    return bad


class AotForward:
    """Replaces an MLP's forward: picks the package by token count, the MLP's own tensors as inputs."""

    def __init__(self, mlp: nn.Module, runners: list[tuple[int, int, object]]):
        self.eager, self.runners = mlp.forward, runners
        self.tensors = _tensors(mlp)[1]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1]).contiguous()  # the package was traced on contiguous input
        tokens = flat.shape[0]
        for lo, hi, run in self.runners:
            if lo <= tokens <= hi:
                y = run(flat, *self.tensors)
                return y.reshape(*x.shape[:-1], y.shape[-1])
        return self.eager(x)


def install(model, root: Path, entries: list[dict], dtype: torch.dtype) -> int:
    """Put the packages under `root` on every MLP whose signature they were built for; returns how many."""
    by_sig: dict[str, list] = {}
    for e in entries:
        by_sig.setdefault(e["signature"], []).append(e)
    loaded: dict[str, list] = {}
    n = 0
    for mlp in decoder_mlps(model):
        if (sig := signature(mlp, dtype)) not in by_sig:
            continue
        if sig not in loaded:
            try:
                loaded[sig] = [(e["tokens"][0], e["tokens"][1], load_package(root, e)) for e in by_sig[sig]]
            except Exception as exc:  # e.g. torch's sources changed since warm: torch.compile this MLP instead
                warnings.warn(f"{root}: compiled MLP packages not usable here ({type(exc).__name__}: {str(exc)[:200]}); "
                              "torch.compile is used instead", stacklevel=2)
                loaded[sig] = None
        if loaded[sig] is None:
            continue
        mlp.forward = AotForward(mlp, loaded[sig])
        n += 1
    return n


def compile_regions(model) -> int:
    """torch.compile each decoder layer's MLP (regional compilation); returns how many.

    Not the whole layer: attention updates transformers' KV cache, whose per-layer state makes
    dynamo recompile for every layer (then, past its recompile limit, run eager silently). The MLPs
    are identical across layers, so one trace per shape class serves them all. Compiling the
    attention projections too was measured once (SmolLM2, CPU): three times the graphs, a slower
    first token with a warm cache, and slower decode, so they stay eager."""
    n = 0
    for mlp in decoder_mlps(model):
        if not isinstance(mlp.forward, AotForward):
            mlp.compile(dynamic=True)  # lazy: dynamo runs at the first call
            n += 1
    return n


def _decoder_layers(model) -> list:
    base = getattr(model, model.base_model_prefix, model)
    layers = getattr(base, "layers", None)
    if layers is None:
        raise QuantprepError(f"{type(model).__name__}: no decoder `layers` to compile; load with compile=False")
    return list(layers)


def decoder_mlps(model) -> list:
    """Each decoder layer's MLP: what compile_regions and the compiled MLP packages (aot.py) compile.
    Not a mixture of experts: the experts it runs depend on the data (runtime/experts.py), which
    export cannot capture and torch.compile breaks its graph at; it runs eager."""
    from quantprep.runtime.experts import QuantizedExperts

    return [layer.mlp for layer in _decoder_layers(model) if getattr(layer, "mlp", None) is not None
            and not any(isinstance(m, QuantizedExperts) for m in layer.mlp.modules())]
