"""The package version, in a module of its own so that every stage can import it without the package."""

__version__ = "0.1.0"
