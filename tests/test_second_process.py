"""`vramtrace.second_process`: a function run in a second Python process (`--compile`'s eager comparison runs
there while the compiled step is traced). Its use by `analyze` is checked in test_compile_step.py (the eager
figures from the second process against a real eager step, and against the same analysis made in one process)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from vramtrace.second_process import SecondProcess


def test_the_function_runs_in_another_process_with_this_process_thread_count():
    threads = torch.get_num_threads()
    torch.set_num_threads(3)  # not the default (the core count) of a one- or two-core machine such as CI
    try:
        with SecondProcess(torch.get_num_threads) as job:
            assert job.result() == 3
        with SecondProcess(os.getpid) as job:
            assert job.result() != os.getpid()
    finally:
        torch.set_num_threads(threads)


def test_the_function_exception_is_raised_here():
    with SecondProcess(int, "seven") as job:
        with pytest.raises(ValueError, match="invalid literal for int"):
            job.result()


def test_a_process_that_ends_without_answering_is_a_child_process_error():
    with SecondProcess(os._exit, 3) as job:
        with pytest.raises(ChildProcessError, match="exit code 3"):
            job.result()


def test_stop_ends_a_running_process():
    """stop() kills the process (SIGKILL), it does not wait for the function to return (600 s from now)."""
    job = SecondProcess(time.sleep, 600)
    job.stop()
    assert job._proc.returncode == -signal.SIGKILL


def test_a_script_without_a_main_guard_runs_once(tmp_path):
    """multiprocessing's spawn would import the caller's __main__ again in the child; the second process does not."""
    script = tmp_path / "script.py"
    script.write_text("import os\nfrom vramtrace.second_process import SecondProcess\nprint('top level ran')\n"
                      "with SecondProcess(os.getpid) as job:\n    print(job.result() != os.getpid())\n")
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout == "top level ran\nTrue\n"
