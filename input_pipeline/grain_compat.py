"""What the input pipeline needs from Grain beyond its public API, in one place (Grain 0.2).

The input pipeline never imports meshpar, so this is its own counterpart of
:mod:`meshpar.jax_compat`: every use of a private Grain attribute lives here, and nowhere else
(tests/test_jax_compat.py checks the rest of the repository for reach-ins and exercises each
shim on the installed Grain). Each shim names the public API to move to once Grain has one.
Grain is imported inside the functions: only callers that use worker processes pay for it.
"""

from __future__ import annotations


def wait_for_unlinks(timeout_s: float) -> bool:
    """Wait (up to `timeout_s`) until Grain has closed and unlinked the shared memory of the
    ``SharedMemoryArray`` batches already dropped; False when there is nothing to wait on (Grain's
    asynchronous unlinking was never enabled, or this Grain keeps it elsewhere).

    Grain unlinks a dropped batch's segment in a background thread pool of one thread
    (``SharedMemoryArray.enable_async_del``, called by its multiprocessing prefetch): an empty
    task queued behind those unlinks is a barrier. Public API to move to: none in Grain 0.2 (the
    pool is the private class attribute ``SharedMemoryArray._del_thread_pool``).
    """
    from grain.multiprocessing import SharedMemoryArray

    pool = getattr(SharedMemoryArray, "_del_thread_pool", None)  # private: see above
    if pool is None:
        return False
    try:
        pool.apply_async(int).wait(timeout_s)
    except ValueError:  # the pool is already shut down (interpreter exit)
        pass
    return True
