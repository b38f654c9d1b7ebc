"""Print the end-to-end time of the main job at this checkout next to the same job at an earlier git revision.

Reproduce: python benchmarks/bench_vs_revision.py REV [MODEL] [--batch 4] [--seq 2048] [--repeat 12]

REV is checked out once into a temporary `git worktree`; each repeat runs `python -m vramtrace.cli MODEL
--batch B --seq S` (the terminal report) with PYTHONPATH at REV's `src/`, then at this checkout's, alternating so
that a noisy machine affects both alike. Medians and minimums are printed with their ratio. Used for issue 12's
"end-to-end time within 10% of today's" (REV 9657def, the last commit before it).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _timed(cmd: list[str], src: Path) -> float:
    env = {**os.environ, "PYTHONPATH": str(src), "HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE", "1")}
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tempfile.gettempdir())
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        sys.exit(f"{src}: {p.stderr.strip().splitlines()[-1] if p.stderr.strip() else p.returncode}")
    return wall


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("rev")
    ap.add_argument("model", nargs="?", default="meta-llama/Llama-2-7b")
    ap.add_argument("--batch", default="4")
    ap.add_argument("--seq", default="2048")
    ap.add_argument("--repeat", type=int, default=12)
    a = ap.parse_args()
    cmd = [sys.executable, "-m", "vramtrace.cli", a.model, "--batch", a.batch, "--seq", a.seq]
    with tempfile.TemporaryDirectory() as tmp:
        tree = Path(tmp) / "rev"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(tree), a.rev], check=True,
                       capture_output=True)
        try:
            walls: dict[str, list[float]] = {a.rev: [], "this checkout": []}
            for _ in range(a.repeat):
                walls[a.rev].append(_timed(cmd, tree / "src"))
                walls["this checkout"].append(_timed(cmd, ROOT / "src"))
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)], capture_output=True)
    print(f"command: vramtrace {' '.join(cmd[3:])}  ({a.repeat} runs each, alternating)")
    for name, w in walls.items():
        print(f"{name:>14}: median {statistics.median(w):.2f} s, min {min(w):.2f} s")
    old, new = walls[a.rev], walls["this checkout"]
    print(f"{'ratio':>14}: median {statistics.median(new) / statistics.median(old):.3f}, "
          f"min {min(new) / min(old):.3f}")


if __name__ == "__main__":
    main()
