import os
import signal
import sys

from rlhf.tools import forkserver


def _stopped_at_start(signum, frame):
    """Ctrl-C before a stage's own handler is in place (runtime.install_stop_handler replaces this one): one line,
    exit 130, at once. Nothing of a stage has started to finish, and a KeyboardInterrupt raised inside the libraries'
    imports does not come out as itself: one that lands in numpy's import, under torch's, under transformers', left
    numpy half-made and surfaced as transformers' ModuleNotFoundError, a screen of traceback, exit 1. (A command that
    never starts a stage, compare or memcheck, stops here at once too.)"""
    if os.environ.get("RANK", "0") == "0":  # data parallel: rank 0 says it for all
        print("\nstopped: interrupted before the stage could save anything; rerun the same command",
              file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(128 + signum)


# as Python's own: a process started with SIGINT ignored (in the background by a script) keeps it ignored
if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
    signal.signal(signal.SIGINT, _stopped_at_start)


def main() -> int:
    from rlhf.cli import main

    return main()


# with RLHF_FORKSERVER set, the test suite's pre-imported server runs the command (rlhf/tools/forkserver.py)
sys.exit(forkserver.main_of("rlhf", main))
