"""Work that overlaps other work: file reads, hashing, downloads release the GIL."""

from __future__ import annotations

import threading
from concurrent.futures import Future


def in_thread(fn, *args, **kwargs) -> Future:
    """fn(*args, **kwargs) in a daemon thread, so an error exit does not wait for it. Only for work
    that is safe to abandon at exit (reads, hashing, downloads into a staging directory): never
    torch ops, whose C++ frames abort the process when a daemon thread is stopped inside them."""
    job: Future = Future()

    def run() -> None:
        try:
            job.set_result(fn(*args, **kwargs))
        except BaseException as e:
            job.set_exception(e)

    threading.Thread(target=run, daemon=True).start()
    return job
