"""The package version (one place: the CLI, ``freetoken info`` and the facade read it)."""

__version__ = "0.1.0"
