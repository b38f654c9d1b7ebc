"""Print how long the CLI takes to answer "the Hub cannot be reached" for a Hub id it cannot resolve.

Reproduce: python benchmarks/bench_hub_unreachable.py [--runs 3]
Two local endpoints, no traffic leaves the machine: one that accepts connections and never answers (a Hub that
hangs) and a closed port (connection refused). Each run is the CLI in a fresh process (`python -m vramtrace.cli
microsoft/phi-2 --seq 8`, online, empty HF home), so the figure includes Python's start and vramtrace's imports.
Goal (issue 38): about loading.HUB_TIMEOUT_S (3 s) on an idle machine, not huggingface_hub's retries (48 s); the
tests (tests/test_errors.py) assert the answer, not the time.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SRC = str(Path(__file__).resolve().parent.parent / "src")


def _run(endpoint: str) -> tuple[float, int, str]:
    """Seconds, exit code and last stderr line of one CLI run against `endpoint`."""
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    with tempfile.TemporaryDirectory(prefix="bench-hub-") as home:
        env.update(HF_ENDPOINT=endpoint, HF_HOME=home, PYTHONPATH=SRC)
        t0 = time.perf_counter()
        p = subprocess.run([sys.executable, "-m", "vramtrace.cli", "microsoft/phi-2", "--seq", "8"],
                           capture_output=True, text=True, env=env, timeout=300)
        seconds = time.perf_counter() - t0
    lines = p.stderr.strip().splitlines()
    return seconds, p.returncode, lines[-1] if lines else ""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3)
    a = ap.parse_args()
    for name, listens in (("hangs", True), ("refused", False)):
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        if listens:
            sock.listen(16)
        try:
            runs = [_run(f"http://127.0.0.1:{sock.getsockname()[1]}") for _ in range(a.runs)]
        finally:
            sock.close()
        times = ", ".join(f"{s:.2f}" for s, _, _ in runs)
        print(f"{name:8}: {times} s (exit {sorted({rc for _, rc, _ in runs})}); {runs[-1][2][:110]}")


if __name__ == "__main__":
    main()
