"""The package version, in a module of its own so that any module can read it without importing the package root."""

VERSION = "0.1.0"
