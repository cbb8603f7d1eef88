"""CLI commands that are thin wrappers over the library (the others live next to their library module)."""
