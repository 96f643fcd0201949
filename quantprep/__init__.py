"""quantprep: prepare GPTQ-quantized LLMs offline so serving code loads them in seconds."""

__version__ = "0.1.0"

from .errors import ArtifactError, ArtifactMismatch, QuantprepError, RecipeError, SourceError  # noqa: E402
from .load import load  # noqa: E402

__all__ = ["load", "QuantprepError", "ArtifactError", "ArtifactMismatch", "SourceError", "RecipeError", "__version__"]
