"""hfjax's version, read by `hfjax.__version__` and by the package metadata (pyproject.toml)."""

__version__ = "0.2.0"
