"""A child for tests/integration/test_zygote.py, run as `python -m tests.zygote_child WHAT [CODE]`: reports the
process context it was given as one JSON line, then exits with CODE (`raise`: an uncaught exception; `sleep`:
waits to be signalled; `preempt`: takes SIGUSR1 as aligner's commands do)."""
import json
import os
import signal
import sys
import time

if __name__ == "__main__":
    what = sys.argv[1]
    if what == "preempt":  # shield from SIGUSR1 as a CLI does, then say whether a request came
        from aligner.runtime import preemption
        preemption.install()
        print("shielded", flush=True)
        deadline = time.monotonic() + 30
        while not preemption.requested() and time.monotonic() < deadline:
            time.sleep(0.01)
        print("requested" if preemption.requested() else "none", flush=True)
        sys.exit(0)
    print(json.dumps({"argv": sys.argv[1:], "cwd": os.getcwd(), "marker": os.environ.get("ZYGOTE_TEST_MARKER"),
                      "blocked": sorted(int(s) for s in signal.pthread_sigmask(signal.SIG_BLOCK, [])),
                      "pgid": os.getpgrp(), "sid": os.getsid(0), "main": __name__, "ppid": os.getppid()}), flush=True)
    print("to stderr", file=sys.stderr)
    if what == "raise":
        raise RuntimeError("an uncaught error")
    if what == "sleep":
        time.sleep(60)
    sys.exit(int(sys.argv[2]) if len(sys.argv) > 2 else 0)
