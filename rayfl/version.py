"""rayfl's version, in a module of its own so that any module can read it without importing
the package's API (`rayfl/__init__.py` imports everything)."""

__version__ = "0.1.0"
