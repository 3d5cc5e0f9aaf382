import sys

from .tools import forkserver

code = forkserver.run("rlhf", sys.argv[1:])  # a pre-imported server's child runs it when RLHF_FORKSERVER is set
if code is None:
    from .cli import main

    code = main()
sys.exit(code)
