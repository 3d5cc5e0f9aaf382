import os
import sys

code = None
if os.environ.get("RLHF_FORKSERVER"):  # the test suite's pre-imported server runs the command (rlhf/tools/forkserver.py)
    from rlhf.tools import forkserver

    code = forkserver.run("rlhf", sys.argv[1:])
if code is None:
    from rlhf.cli import main

    code = main()
sys.exit(code)
