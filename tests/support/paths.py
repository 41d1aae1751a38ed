"""Where the tests find the repository, the examples, the recorded data and the installed CLI."""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples"
DATA = REPO / "tests" / "data"
TPU_AGENT = Path(sys.executable).parent / "tpu-agent"
