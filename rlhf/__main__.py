import os
import sys

from rlhf.infra import ranks
from rlhf.tools import forkserver

ranks.while_importing()  # a Ctrl-C during the imports: one line, exit 130 (cli.main's ranks.imported ends it)


def main() -> int:
    try:
        from rlhf.cli import main

        return main()
    except KeyboardInterrupt:  # after the imports, before a stage's own handler (runtime.install_stop_handler), or in a
        ranks.say_stopped()  # command that starts no stage (memcheck's stage processes stopped, its folder removed)
        sys.stdout.flush()
        # exits here: a Ctrl-C that lands in a library's import run through PyRun_* marks the KeyboardInterrupt
        # unhandled in CPython, which then ends `python -m` by SIGINT (status -2), whatever status it is given.
        os._exit(130)


# with RLHF_FORKSERVER set, the test suite's pre-imported server runs the command (rlhf/tools/forkserver.py)
sys.exit(forkserver.main_of("rlhf", main))
