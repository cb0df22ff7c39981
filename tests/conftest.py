"""Puts tests/ on ``sys.path`` (pytest does so for this conftest's directory), so every test imports ``_procs``."""
