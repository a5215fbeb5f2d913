"""A command run in a process forked from the zygote (aligner/launch/zygote.py), where one is live.

`aligner train ...` with one rank trains in its own process, so the zygote, which starts ranks, servers and
workers, did not spare it its ~8 s of CPU importing torch, megatron-core and transformers. From the command
line (`aligner` and `python -m aligner.cli`, never `cli.main` called in-process) the command now runs in a
child the zygote forks, ready-imported, and this process only relays: it passes the signals sent to it on to
the child, and exits as the child did. The child is in this process's group, so a terminal's Ctrl-C and a
`kill -- -PGID` reach it directly. Without a live zygote in this session (unset, empty, under Slurm) the
command runs here as before.
"""
from __future__ import annotations

import os
import signal
import sys
import threading

from aligner.launch import zygote
from aligner.runtime import preemption

RELAYED = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP)  # what a launcher or Slurm sends one pid


def run_forked(module: str, argv: list[str]) -> int | None:
    """The exit code of `python -m MODULE ARGV` forked from the live zygote, or None where there is none, or
    where this process is a child of it already: run the command here then. Where `preemption.install` ran
    first, SIGUSR1 is blocked here and in the child from its start, and a stop asked at any moment is kept."""
    path = zygote.zygote_socket()
    if path is None or zygote.forked_here():
        return None
    child, early = None, []  # signals that came before the child existed are passed on once it does
    # SIGUSR1 comes from preemption's waiting thread, the others in this (main) thread's handlers: re-entrant
    hand_over = threading.RLock()

    def relay(signum, _frame=None):
        with hand_over:
            if child is None:
                early.append(signum)
            else:
                child.send_signal(signum)

    def relay_stop():
        relay(preemption.STOP_SIGNAL)

    previous = {sig: signal.signal(sig, relay) for sig in RELAYED}  # a blocked SIGUSR1 comes as `relay_stop`
    preemption.on_request(relay_stop)
    if preemption.requested():  # asked before there was a listener
        relay_stop()
    try:
        started = zygote.ZygoteProcess(path, [sys.executable, "-m", module, *argv])
    except zygote.UNREACHABLE:
        preemption.off_request(relay_stop)  # a stop asked meanwhile stays requested for the command run here
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for signum in early:  # as if they came now
            signal.raise_signal(signum)
        return None
    with hand_over:
        child = started
        for signum in early:
            child.send_signal(signum)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the terminal's Ctrl-C reaches the child itself (one group)
    code = child.wait()
    if code < 0:  # ended by a signal: end the same way, as a shell expects of the command it ran
        signal.signal(-code, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [-code])  # SIGUSR1 is blocked here after `preemption.install`
        os.kill(os.getpid(), -code)
    return code
