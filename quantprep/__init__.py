"""quantprep: prepare GPTQ-quantized LLMs offline so serving code loads them in seconds."""

from .errors import ArtifactError, ArtifactMismatch, QuantprepError, RecipeError, SourceError
from .load import load
from .version import __version__

__all__ = ["load", "QuantprepError", "ArtifactError", "ArtifactMismatch", "SourceError", "RecipeError", "__version__"]
