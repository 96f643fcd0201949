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


class CompileError(QuantprepError):
    """quantprep's own C (quantprep/csrc) did not compile or load though a compiler is here: a bug in
    quantprep, never a missing compiler. `stderr` holds the compiler's whole output, which is also a
    note on the exception (tracebacks show it); the message names the file and the first error."""

    def __init__(self, message: str, stderr: str = ""):
        super().__init__(message)
        self.stderr = stderr
        if stderr:
            self.add_note(stderr)
