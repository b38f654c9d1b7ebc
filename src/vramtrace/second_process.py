"""One independent analysis run in a second process, beside the one this process runs.

`--compile` reports the compiled step beside the same step run eagerly: two traces that share nothing but the
model's reference. The compiled trace is bound to one core (dynamo, AOTAutograd and Inductor's code generation are
Python); most of the eager trace's time on a first run is its CPU kernel probes (`tracer/probe.py`), and the
largest of them, bf16 matmuls on a CPU without native bf16, run on one thread. So on a machine with two or more
cores the eager analysis runs in a second Python process while this one compiles (Llama-2-7b: docs/compile.md).

The probes measure allocations through the profiler, which sees every thread of its own process: a second process
cannot disturb them, where a second thread would. The child takes this process's `sys.path` and its intra-op and
inter-op thread counts (CPU kernels pick their blocking, and so their workspaces, by the thread count), and inherits
its environment (`VRAMTRACE_CPU_PROBE_CACHE`, `ONEDNN_MAX_CPU_ISA`, `HF_HUB_OFFLINE`, ...).

It is a plain `subprocess` running `python -c`, not `multiprocessing`: a spawned multiprocessing child imports the
caller's `__main__` again, which runs a user's script a second time when its code is not under
`if __name__ == "__main__":`.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from typing import Any, Callable

# the child: sys.path, then (threads, fn, args) from stdin; (ok, value) pickled to the file descriptor in argv[1]
_CHILD = ("import pickle, sys; sys.path[:] = pickle.load(sys.stdin.buffer); "
          "from vramtrace.second_process import _serve; _serve(int(sys.argv[1]))")


class SecondProcess:
    """`fn(*args)` computed in a second Python process, started at construction. `fn` and `args` must pickle (a
    module-level function; a RunSpec). `result()` returns its value or raises its exception; `stop()` ends the
    process if it still runs (use the instance as a context manager, so that an error here stops it). The child's
    own output goes nowhere: what it has to say comes back as its value or its exception. Raises OSError when no
    process can be started, pickle.PicklingError (before starting one) when `fn` or `args` do not pickle."""

    def __init__(self, fn: Callable, *args: Any):
        torch = sys.modules.get("torch")  # not imported yet: the child's defaults are this process's
        threads = (torch.get_num_threads(), torch.get_num_interop_threads()) if torch is not None else None
        payload = pickle.dumps(list(sys.path)) + pickle.dumps((threads, fn, args))  # fails before a process starts
        read, write = os.pipe()
        try:
            self._proc = subprocess.Popen([sys.executable, "-c", _CHILD, str(write)], stdin=subprocess.PIPE,
                                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, pass_fds=(write,))
        except BaseException:
            os.close(read)
            raise
        finally:
            os.close(write)  # the child holds the only writing end: its exit ends the reading with EOF
        self._answer = os.fdopen(read, "rb")
        try:
            self._proc.stdin.write(payload)
            self._proc.stdin.close()
        except BrokenPipeError:  # the child is gone already: result() says so
            pass

    def result(self) -> Any:
        """`fn(*args)`'s value, waiting for it. Raises what `fn` raised, or ChildProcessError when the process
        ended without an answer (killed, out of memory, no vramtrace on its path)."""
        try:
            ok, value = pickle.load(self._answer)
        except (EOFError, pickle.UnpicklingError) as e:
            raise ChildProcessError(f"the second process ended without an answer (exit code {self._proc.wait()}, "
                                    f"{type(e).__name__})") from None
        finally:
            self._answer.close()
        self._proc.wait()
        if not ok:
            raise value
        return value

    def stop(self) -> None:
        if self._proc.poll() is None:
            self._proc.kill()
        self._proc.wait()
        self._answer.close()

    def __enter__(self) -> "SecondProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def cores() -> int:
    """The CPU cores this process may run on (its affinity mask, as `nproc` counts them)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _serve(fd: int) -> None:
    """The child's side: run what stdin holds, write (ok, value or exception) to `fd`."""
    threads, fn, args = pickle.load(sys.stdin.buffer)
    if threads is not None:
        import torch

        torch.set_num_threads(threads[0])
        if torch.get_num_interop_threads() != threads[1]:
            torch.set_num_interop_threads(threads[1])  # allowed once, before any inter-op work
    try:
        answer = (True, fn(*args))
    except BaseException as e:  # noqa: BLE001 - handed to the parent, which raises it
        answer = (False, e)
    with os.fdopen(fd, "wb") as out:
        try:
            data = pickle.dumps(answer)
        except Exception as e:  # noqa: BLE001 - an answer that does not pickle: what it was reaches the parent
            what = f"{type(answer[1]).__name__}: {answer[1]}" if not answer[0] else type(answer[1]).__name__
            data = pickle.dumps((False, RuntimeError(f"the second process's answer ({what}) could not be sent "
                                                     f"back: {e}")))
        out.write(data)
