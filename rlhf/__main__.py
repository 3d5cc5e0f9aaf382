import sys

from rlhf.tools import forkserver


def main() -> int:
    from rlhf.cli import main

    return main()


# with RLHF_FORKSERVER set, the test suite's pre-imported server runs the command (rlhf/tools/forkserver.py)
sys.exit(forkserver.main_of("rlhf", main))
