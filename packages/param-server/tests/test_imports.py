"""The pure pieces import nothing heavy; the service pieces load lazily."""

from __future__ import annotations

import subprocess
import sys


def test_import_is_light() -> None:
    code = (
        "import sys, param_server\n"
        "from param_server import ParamServerCore, plan_transfers\n"
        "heavy = [m for m in ('torch', 'nixl', 'nixl_cu12', 'ray', 'vllm') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
        "param_server.ParamServerClient\n"
        "assert 'torch' in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
