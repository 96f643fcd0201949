"""Typed errors. Every message is one line that names the file/tensor and says what to do.

The CLI prints `str(err)` to stderr and exits 2 for any `QuantprepError`; tracebacks are for bugs.
"""


class QuantprepError(Exception):
    """Base class: a user-facing error (bad input, mismatch, corruption)."""


class SourceError(QuantprepError):
    """The GPTQ checkpoint (or float model) given as a source is unusable."""


class RecipeError(QuantprepError):
    """A recipe TOML file or CLI option is invalid."""


class ArtifactError(QuantprepError):
    """An artifact is missing, corrupted or malformed."""


class ArtifactMismatch(ArtifactError):
    """An artifact is valid but was built for another target, torch version or machine."""
