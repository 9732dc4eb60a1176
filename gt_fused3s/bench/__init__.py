"""Benchmark harness shared by the scripts (``scripts/*.py`` are thin CLIs
over these modules)."""
