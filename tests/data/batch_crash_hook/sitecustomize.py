"""Crash injection for the batch tests, kept out of the product: a Python started with this folder on
PYTHONPATH wraps `corelm batch`'s worker so that it exits abruptly (os._exit, as a SIGKILL or a segfault
in native code would: no cleanup, no reply) on receiving a chosen task.

  CORELM_BATCH_TEST_CRASH=WORKER:TASK   the first incarnation of worker WORKER ("*": every worker) dies on
                                        its TASK-th task (1-based)
  CORELM_BATCH_TEST_CRASH_ON=CUSTOM_ID  every worker dies on a task that holds that request
"""
import os


def _install():
    crash, crash_on = os.environ.get("CORELM_BATCH_TEST_CRASH", ""), os.environ.get("CORELM_BATCH_TEST_CRASH_ON")
    if not crash and not crash_on:
        return
    from corelm.entrypoints.batch import runner, worker as module

    original = module.worker_main

    def worker_main(conn, index, incarnation, *args, **kwargs):
        crash_at = None
        if crash and incarnation == 0:
            w, _, t = crash.partition(":")
            if w == "*" or int(w) == index:
                crash_at = int(t)
        run_task, received = module.BatchWorker.run_task, [0]

        def crashing_run_task(self, requests):
            received[0] += 1
            if received[0] == crash_at or any(r.custom_id == crash_on for r in requests):
                os._exit(17)
            return run_task(self, requests)
        module.BatchWorker.run_task = crashing_run_task
        return original(conn, index, incarnation, *args, **kwargs)

    # pickled by name into each spawned worker, so it must stand where the original stood
    worker_main.__module__, worker_main.__qualname__ = original.__module__, original.__qualname__
    module.worker_main = runner.worker_main = worker_main


_install()
