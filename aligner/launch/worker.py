"""One rank started by the embedded launcher: `python -m aligner.launch.worker module:function args...`.

A failure's report (its `error:` line, or a bug's traceback) goes to $ALIGNER_ERROR_FILE so that the
launcher can report it (aligner/errors.py). A rank that stopped at a checkpoint on request
(`preemption.Preempted`) is no failure: it exits with its code."""
from __future__ import annotations

import importlib
import sys

from aligner import errors
from aligner.observe.logs import send_warnings_to_log, silence_expected_warnings
from aligner.runtime import preemption


def main(argv: list[str]) -> int:
    preemption.install()  # before the heavy imports: SIGUSR1 would kill the rank until then
    silence_expected_warnings()
    send_warnings_to_log()  # $ALIGNER_LOG_DIR/warnings.log
    module, function = argv[0].split(":")
    try:
        getattr(importlib.import_module(module), function)(argv[1:])
    except preemption.Preempted as e:
        print(e, file=sys.stderr, flush=True)
        return e.code
    except BaseException as e:  # noqa: BLE001 - report everything, then fail
        if isinstance(e, SystemExit) and not e.code:
            return 0
        return errors.handle(e)  # to $ALIGNER_ERROR_FILE: the launcher reports the first failing rank
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
