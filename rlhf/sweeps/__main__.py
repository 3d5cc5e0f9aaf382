import sys

from rlhf.sweeps.sweep import main

sys.exit(main())
