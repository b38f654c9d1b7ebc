"""The package's version (pyproject.toml's `version`), in a module that imports nothing, so that the renderers
can name it without importing the package root."""

__version__ = "0.1.0"
