"""``irgen run --inputs``: the samples spread over worker processes, ``-j N`` cores."""

from __future__ import annotations

import os
from typing import Callable

from irgen.api import IrgenError
from irgen.output import Progress


def split_cores(jobs: int | None, samples: int) -> tuple[int, int]:
    """``-j``'s cores as (worker processes, TVM kernel threads in each). ``jobs`` is the cores
    to use (``None``: every core this process may run on); each worker takes one sample at a
    time, and with fewer samples than cores the workers share out the rest as kernel threads.
    ``TVM_NUM_THREADS``, when set, is each worker's thread count. A worker per core is the
    faster split: a sample's file writing and hashing run on one core, so a worker with two
    kernel threads leaves one idle for that part (64 ResNet-18 samples on 2 cores: 152 ms a
    sample as one worker with two threads, 108 ms as two workers). TVM's own default, half
    the cores on x86 for hyper-threading, is not used."""
    if jobs is None:
        try:
            jobs = len(os.sched_getaffinity(0))
        except AttributeError:  # not Linux
            jobs = os.cpu_count() or 1
    workers = max(1, min(jobs, samples))
    given = os.environ.get("TVM_NUM_THREADS", "").strip()
    if given.isdigit() and int(given) > 0:
        return workers, int(given)
    return workers, max(1, jobs // workers)


def in_workers(names: list[str], jobs: int, threads: int, work: Callable[[str], None], progress: Progress) -> None:
    """``work(name)`` for every name in ``jobs`` forked worker processes (the compiled plan
    is inherited, not reloaded), each taking the next name when it is free, with one progress
    line. A worker runs the kernels on a new thread whose TVM thread pool has ``threads``
    workers (TVM keeps a pool per thread: one inherited from the parent through the fork
    would have lost its threads). The first failure stops the others and is raised."""
    import multiprocessing as mp
    import signal
    import threading
    import time

    from irgen import vm

    ctx = mp.get_context("fork")
    queue = ctx.SimpleQueue()
    taken = ctx.Value("q", 0)  # names handed out so far

    def next_name() -> str | None:
        with taken.get_lock():
            i = taken.value
            taken.value = i + 1
        return names[i] if i < len(names) else None

    def samples() -> None:
        name = None
        try:
            vm.use_threads(threads)
            while (name := next_name()) is not None:
                work(name)
                queue.put(("done", name, None))
        except BaseException as err:  # noqa: BLE001  reported to the parent, which raises it
            queue.put(("error", name, f"{type(err).__name__}: {err}" if not isinstance(err, IrgenError)
                       else str(err)))

    def worker() -> None:
        # the parent stops a worker with SIGTERM (on an error, or one still exiting when all
        # samples are written): it dies quietly, not through the CLI's handler (a traceback)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        t = threading.Thread(target=samples, name="irgen-samples")
        t.start()
        t.join()
        os._exit(0)  # an error went to the parent, which stops the others

    procs = [ctx.Process(target=worker, daemon=True) for _ in range(jobs)]
    for p in procs:
        p.start()
    done = 0
    try:
        while done < len(names):
            if queue.empty():
                lost = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
                if (lost or not any(p.is_alive() for p in procs)) and queue.empty():
                    why = f" (exit code {lost[0]})" if lost else ""
                    raise IrgenError(f"--inputs: a worker process died{why}; {done} of {len(names)} samples "
                                     "were written")
                time.sleep(0.02)
                continue
            status, name, message = queue.get()
            if status == "error":
                raise IrgenError(f"--inputs: sample {name!r}: {message}" if name is not None
                                 else f"--inputs: a worker could not start: {message}")
            done += 1
            progress.step("samples", done, len(names))
    finally:
        if done == len(names):  # every sample written: the workers are exiting on their own
            for p in procs:
                p.join(timeout=5)
        for p in procs:
            if p.is_alive():
                p.terminate()
        for p in procs:
            p.join()
