import os
import signal
import sys

from rlhf.tools import forkserver

STOPPED = "stopped: interrupted before anything was saved; rerun the same command"


def _say_stopped() -> None:
    if os.environ.get("RANK", "0") == "0":  # data parallel: rank 0 says it for all
        os.write(2, f"\n{STOPPED}\n".encode())  # not print: the signal may land inside a write to the same stream


def _stopped_while_importing(signum, frame):
    """Ctrl-C while the command imports its libraries (cli.imported puts Python's handler back after them): one line,
    exit 130, at once. Nothing has started, and a KeyboardInterrupt raised inside the libraries' imports does not
    come out as itself: one that landed in numpy's import, under torch's, under transformers', left numpy half-made and
    surfaced as transformers' ModuleNotFoundError, a screen of traceback, exit 1."""
    _say_stopped()
    os._exit(128 + signum)


_stopped_while_importing.while_importing = True  # what cli.imported looks for
if signal.getsignal(signal.SIGINT) is signal.default_int_handler:  # as Python: one started with SIGINT ignored is left
    signal.signal(signal.SIGINT, _stopped_while_importing)


def main() -> int:
    try:
        from rlhf.cli import main

        return main()
    except KeyboardInterrupt:  # after the imports, before a stage's own handler (runtime.install_stop_handler), or in a
        _say_stopped()  # command that starts no stage (memcheck's stage processes stopped, its folder removed)
        sys.stdout.flush()
        # exits here: a Ctrl-C that lands in a library's import run through PyRun_* marks the KeyboardInterrupt
        # unhandled in CPython, which then ends `python -m` by SIGINT (status -2), whatever status it is given.
        os._exit(130)


# with RLHF_FORKSERVER set, the test suite's pre-imported server runs the command (rlhf/tools/forkserver.py)
sys.exit(forkserver.main_of("rlhf", main))
