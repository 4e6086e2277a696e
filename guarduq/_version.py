"""The package version, in its own module so lower layers can read it without importing the root."""

__version__ = "0.1.0"
