from __future__ import annotations

import sys
from pathlib import Path

# --import-mode=importlib does not put the test folder on sys.path; the shared helpers live here.
sys.path.insert(0, str(Path(__file__).parent))
