"""Which rank this process is, and its last console line (`error: ...`, `stopped: ...`): under rlhf.launch each rank
leaves it with its exit status in the launch's folder and the launcher says once what every rank said; elsewhere
every process prints it. Standard library only: rlhf/__main__ leaves a Ctrl-C's line before any library is
imported."""

from __future__ import annotations

import os
import signal
import sys

RANK_LINES = "RLHF_RANK_LINES"
"""The environment variable naming the folder where each rank leaves its last console line (set by rlhf/launch.py,
which says once what every rank said and with its rank what only one said)."""

LAUNCHER_PID = "RLHF_LAUNCHER_PID"
"""The environment variable holding rlhf/launch.py's pid: a rank that finds it gone when it looks (after its imports,
dist.die_with_launcher) lost its launcher and ends."""


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


def is_main() -> bool:
    return rank() == 0


def leave(line: str, status: int) -> bool:
    """Under rlhf.launch, `line` and the exit status left in its folder (the launcher ends with the status of the
    rank that said why, however that rank's process then ended): True; False elsewhere, or when the folder is gone."""
    folder = os.environ.get(RANK_LINES)
    if not folder:
        return False
    try:
        with open(os.path.join(folder, f"{rank()}.status"), "w") as f:
            f.write(str(status))
        with open(os.path.join(folder, str(rank())), "w") as f:
            f.write(line)
    except OSError:
        return False  # the launcher's folder is gone: say it here
    return True


def say(line: str, status: int) -> int:
    """A rank's last line for the person at the console (stderr), and the exit status it ends with, returned: under
    rlhf.launch left in its folder and printed by rank 0 alone; elsewhere printed by every process."""
    if not leave(line, status) or is_main():
        print(line, file=sys.stderr, flush=True)
    return status


def started() -> None:
    """Under rlhf.launch, this rank's mark that its stage's signal handler is in (runtime.install_stop_handler): from
    here a signal makes it save and say so. A launch stopped before rank 0 left it saved nothing (the launcher says
    STOPPED, not that the ranks ended before saying they saved)."""
    folder = os.environ.get(RANK_LINES)
    if folder:
        try:
            open(os.path.join(folder, f"{rank()}.started"), "w").close()
        except OSError:
            pass  # the launcher's folder is gone


STOPPED = "stopped: interrupted before anything was saved; rerun the same command"
"""A command's line for a Ctrl-C before it started anything to save (its imports, its checks)."""


def say_stopped() -> None:
    """STOPPED, said as `say` says a line (left for rlhf.launch, printed by rank 0) but written straight to the file
    descriptor: it may be said from a signal handler that landed inside a write to stderr."""
    if not leave(STOPPED, 130) or is_main():
        os.write(2, f"\n{STOPPED}\n".encode())


def _stopped_while_importing(signum, frame):
    """Ctrl-C while a command imports its libraries: STOPPED, exit 130, at once. Nothing has started, and a
    KeyboardInterrupt raised inside the libraries' imports does not come out as itself: one that landed in numpy's
    import, under torch's, under transformers', left numpy half-made and surfaced as transformers'
    ModuleNotFoundError, a screen of traceback, exit 1."""
    say_stopped()
    os._exit(128 + signum)


def while_importing() -> None:
    """A command's first call, before it imports a library: a Ctrl-C exits at once (_stopped_while_importing) until
    `imported()`. As Python itself, a process started with SIGINT ignored is left so."""
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, _stopped_while_importing)


def imported() -> None:
    """The libraries are imported: from here a Ctrl-C raises KeyboardInterrupt again, so that a command ends through
    its cleanups (memcheck stops its stage process and removes its folder); a stage puts its own handler in next
    (runtime.install_stop_handler)."""
    if signal.getsignal(signal.SIGINT) is _stopped_while_importing:
        signal.signal(signal.SIGINT, signal.default_int_handler)
