"""The version of arrayckpt, in a module of its own so that any layer can name it without importing the package."""

__version__ = "0.1.0"
