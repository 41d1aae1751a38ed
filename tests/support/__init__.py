"""Helpers shared by the tests: paths, subprocess runners, recorded and hand-built profiles, a fake Claude client.

Tests import them as `from support.processes import run_tool` (pyproject's pytest
`pythonpath` puts tests/ on sys.path).
"""
