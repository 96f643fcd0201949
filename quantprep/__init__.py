"""quantprep: prepare GPTQ-quantized LLMs offline so serving code loads them in seconds."""

import importlib.abc
import importlib.util
import sys

from quantprep.errors import ArtifactError, ArtifactMismatch, QuantprepError, RecipeError, SourceError
from quantprep.version import __version__

__all__ = ["load", "QuantprepError", "ArtifactError", "ArtifactMismatch", "SourceError", "RecipeError", "__version__"]


class _RegisterWithTransformers(importlib.abc.MetaPathFinder):
    """Registers quantprep's transformers quantizer (hf_quantizer.py) as soon as transformers loads
    its quantizer registry, so that `AutoModelForCausalLM.from_pretrained(artifact_dir)` works after
    `import quantprep`, without importing that registry (1.6 s, and torchao's import-time log
    lines) in processes that never call from_pretrained, such as every CLI command."""

    def find_spec(self, name, path, target=None):
        if name != "transformers.quantizers.auto":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            if "quantprep.runtime.hf_quantizer" not in sys.modules:  # else it is the one importing the registry; it registers when done
                from quantprep.runtime import hf_quantizer  # noqa: F401 (registers on import)

        spec.loader.exec_module = exec_module
        return spec


if "transformers.quantizers.auto" in sys.modules:
    from quantprep.runtime import hf_quantizer  # noqa: F401 (registers on import)
elif not any(isinstance(f, _RegisterWithTransformers) for f in sys.meta_path):
    sys.meta_path.insert(0, _RegisterWithTransformers())


def __getattr__(name: str):
    """`quantprep.load` imports torch and the load path on first use: `import quantprep` stays
    torch-free for runtime/engine.py and the commands that need no model."""
    if name == "load":
        from quantprep.runtime.load import load

        return load
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
