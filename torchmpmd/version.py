"""The package version (one place: the runtime and the docs read it here)."""

__version__ = "0.1.0"
