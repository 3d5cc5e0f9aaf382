import os
import sys

from rlhf.tools import forkserver


def main() -> int:
    try:
        from rlhf.cli import main

        return main()
    except KeyboardInterrupt:  # Ctrl-C before a stage's own handler was in place (runtime.install_stop_handler)
        if os.environ.get("RANK", "0") == "0":  # data parallel: rank 0 says it for all
            print("\nstopped: interrupted before the stage could save anything; rerun the same command",
                  file=sys.stderr, flush=True)
        sys.stdout.flush()
        # exits here: a Ctrl-C that lands in a library's import run through PyRun_* marks the KeyboardInterrupt
        # unhandled in CPython, which then ends `python -m` by SIGINT (status -2), whatever status it is given.
        # Nothing of a stage has started to finish.
        os._exit(130)


# with RLHF_FORKSERVER set, the test suite's pre-imported server runs the command (rlhf/tools/forkserver.py)
sys.exit(forkserver.main_of("rlhf", main))
