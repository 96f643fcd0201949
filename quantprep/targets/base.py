"""What a target is (`Target`): the questions the rest of quantprep asks of a kernel target and
its device, and the defaults of one that needs nothing. Torch-free, so that an artifact OpenVINO
runs loads without torch; the torch modules targets share are in packed.py.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from quantprep.targets import KERNEL_GROUP_SIZES

if TYPE_CHECKING:
    import torch
    from torch import nn

    from quantprep.format.gptq import PrepackLayer


class Target:
    """What a kernel target is: each target module subclasses this once and exposes the instance as
    `TARGET` (targets/__init__.py). The defaults here are what a target without a CPU path has.

    Besides packing, it answers what the rest of quantprep asks of its device, so nothing there
    branches on a name: the defaults are those of a device that needs nothing (the CPU's, mostly).
    Callers that know only a torch device type ask `targets.device_target(type)`."""

    name: str
    device: str  # the torch device type its kernels run on
    # "torch": load builds a transformers model of its modules; "graph": the artifact is an OpenVINO IR
    # that runtime/openvino.py runs (load returns that pipeline; build writes the IR, build/openvino_ir.py)
    kind: str = "torch"
    default_act_dtype: torch.dtype
    act_dtypes: tuple[torch.dtype, ...]
    act_dtype_note = ""  # why only act_dtypes, appended to targets.act_dtype_problem's message
    cpu_emulator: bool = False  # off its device, its modules still run on the CPU (slowly): for verify and tests
    group_sizes: tuple[int, ...] = KERNEL_GROUP_SIZES  # its int4 kernels' groups (regroup)
    # Among targets that fit a machine, the lowest is taken first (an accelerator before the CPU): a
    # pull without --target, gptqmodel's and selftest's default device. None: only when named.
    preference: int | None = None
    warm_at_build = True  # `build --warm` warms its artifacts where its device is present
    quantized_lm_head = True  # `--lm-head int8/int4` may quantize the lm_head for it
    # Its eager kernels are compiled or set up at run time (Triton, a GPU driver, oneDNN's primitives), so a
    # kcache serves a load without compile too and `serve` warms each process; where False (built ahead),
    # such a load reads only the kcache's kernel plan and there is nothing to warm per process.
    jit_kernels = True
    # Prefixes of kcache.cache_env's variables its driver reads once, when the device starts: load
    # sets them before that, and checks the kcache key's device fields (which start it) after.
    driver_cache: tuple[str, ...] = ()
    log_env: dict[str, str] = {}  # makes its kernel library log which implementation runs (selftest, read_log)
    model_format = "safetensors"  # the weights' format, as an OCI model config names it (distribution/registry.py)

    def compat_key(self) -> dict:
        """What the packed layout depends on: an artifact is refused where this differs."""
        raise NotImplementedError

    def runtime_problem(self) -> str | None:
        """Why this machine cannot run the target's kernels, else None."""
        raise NotImplementedError

    def kernel(self, bits: int) -> str:
        raise NotImplementedError

    def pack(self, layer: PrepackLayer, act_dtype: torch.dtype) -> tuple[dict[str, torch.Tensor], dict]:
        """A layer -> (its tensors for the artifact, its manifest metadata)."""
        raise NotImplementedError

    def meta_problem(self, meta: dict) -> str | None:
        """What in a module's manifest metadata `make_module` would not read as `pack` wrote it, or
        None. Load asks before it makes a module (format/artifact.read_manifest has checked the
        fields every target writes), so a module's constructor never sees a malformed artifact and
        an exception from it is a bug. Here: the paddings a PackedLinear reads."""
        for key, size in (("padded_in", meta["in_features"]), ("padded_out", meta["out_features"])):
            if key in meta and not (type(meta[key]) is int and size <= meta[key] <= 2 * size + 256):
                return f"{key} {str(meta[key])[:40]!r} for {size} features"
        return None

    def make_module(self, meta: dict, act_dtype: torch.dtype) -> nn.Module:
        """The module that reads what `pack` wrote, on the meta device until the tensors are assigned
        (for metadata that passed `meta_problem`)."""
        raise NotImplementedError

    def load_warning(self) -> str | None:
        """A note for whoever loads an artifact of this target here (xpu: caches the driver cannot keep)."""
        return None

    def present(self) -> bool:
        """This machine has the device (torch sees it), whether or not its kernels run here."""
        return False

    def synchronize(self) -> None:
        """Wait for the kernels queued on the device (timings); nothing where calls return done."""

    def cache_key_fields(self, started: bool = True) -> dict:
        """The device's part of the kernel cache's key (runtime/kcache.py, cache_key): what compiled
        kernels depend on. started=False: only what needs no started device (no name, no driver)."""
        return {}

    def plan_key_fields(self) -> dict:
        """What a kernel plan's timings depend on beyond cache_key_fields (runtime/plan.py)."""
        return {}

    def describe(self) -> dict:
        """The device as `quantprep selftest` reports it; "notes": lines on what makes first runs slow."""
        return {}

    def variant_name(self, manifest: dict) -> str:
        """A published variant's name (distribution/publish.py): the target, plus what its packed
        layout or kcache depends on where one reference may hold several."""
        return self.name

    def run_env(self, manifest: dict, env: dict[str, str]) -> dict[str, str]:
        """Variables a process running this artifact on the device needs before it starts (load, exec)."""
        return {}

    def warm_env(self, manifest: dict, env: dict[str, str]) -> dict[str, str]:
        """Variables warm's child process gets beyond kcache.cache_env."""
        return self.run_env(manifest, env)

    def cache_warning(self, env: dict[str, str]) -> str | None:
        """Why the device's driver will not keep what it compiles under `env`, else None."""
        return None

    def started(self) -> bool:
        """The device started in this process already (then driver_cache is read too late)."""
        return True

    def read_log(self, lines: list[str]) -> tuple[list[dict], list[str]]:
        """What a run under log_env printed: rows for selftest's report and notes in plain words."""
        return [], []


def base_meta(layer: PrepackLayer) -> dict:
    return {"bits": layer.bits, "in_features": layer.in_features, "out_features": layer.out_features,
            "group_size": layer.group_size, "act_order": layer.perm is not None, "bias": layer.bias is not None}
