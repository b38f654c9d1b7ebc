import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never touch the network
# OpenMP's threads (torch's intra-op pool, oneDNN) sleep at a barrier instead of spinning: the suite runs two xdist
# workers (each with as many threads as cores) beside the processes its tests start (ranks, the compile step's
# second process, the CLI) on a 2-core machine, where a spinning thread burns the core a working one waits for.
# Nothing computed or allocated changes (libgomp's wait policy only); read when torch loads libgomp, so set before
# any test module imports torch; a value the caller set is kept (OMP_WAIT_POLICY= restores libgomp's default).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# tests measure the CPU kernels: no result of an earlier run from the probe's disk cache (its own test sets one)
os.environ["VRAMTRACE_CPU_PROBE_CACHE"] = "off"
# and every lever traced (tests/test_levers.py turns the lever outcome cache on in a directory of its own)
os.environ["VRAMTRACE_LEVER_CACHE"] = "off"
sys.path.insert(0, str(Path(__file__).parent))

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "configs"


def deep_config(tmp_path, config: str, layers: int) -> str:
    """A copy of fixture `config` with `layers` layers, written under `tmp_path`; returns its path."""
    cfg = json.loads((FIXTURES / f"{config}.json").read_text())
    cfg["n_layer" if "n_layer" in cfg else "num_hidden_layers"] = layers
    path = tmp_path / f"{config}-{layers}l.json"
    path.write_text(json.dumps(cfg))
    return str(path)


def run_cli(capsys, *args) -> SimpleNamespace:
    """The CLI in this process (`cli.main`, what the console script calls; tests/test_cli.py also runs the script
    itself): its exit status and what it printed, as `returncode`, `stdout`, `stderr`."""
    from vramtrace.cli import main

    status = main([str(a) for a in args])
    printed = capsys.readouterr()
    return SimpleNamespace(returncode=status, stdout=printed.out, stderr=printed.err)
