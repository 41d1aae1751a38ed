"""Shared set-up for every test. The helpers live in the `support` package (tests/support/).

`EXAMPLES` and the process helpers are re-exported here for the backend tests that still
import them from conftest (tests/test_sharding.py).
"""

from __future__ import annotations

import os

# Tests build Hugging Face models from configs; nothing may reach the hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from support.paths import EXAMPLES, REPO, TPU_AGENT  # noqa: E402,F401 - re-exported
from support.processes import clean_env, one_error_line, run_python, run_tool  # noqa: E402,F401 - re-exported
