"""NPROC ranks from one command: `python -m rlhf.launch torchrun|accelerate LAUNCHER_OPTIONS -m rlhf STAGE ...`,
what `make <stage> NPROC=n` runs (torchrun over gloo without CUDA, `accelerate launch` with it). The launcher runs in
this process; around it, what a person at the console wants of N ranks:
- the command line and the config are checked once, here, before a rank starts: a typo is one line, not one per rank
  and the launcher's failure report; so is a global batch the ranks cannot split evenly (dist.check_split); what
  needs no rank (--print-config, --for, --reuse of a finished run) is answered here;
- each rank leaves its last line (`error: ...`, `stopped: ...`) in a folder of this launch (ranks.RANK_LINES) and
  rank 0 alone prints its own (ranks.say), so a line every rank had is said once; a line only rank r had is said
  here, naming r;
- a failed rank ends the launch with its exit status (2 for an expected error, as one process) in place of the
  launcher's traceback; a rank whose peer failed first leaves quietly (cli.main: a collective with a lost peer);
- a Ctrl-C or SIGTERM to the launcher ends it with the shell's 130 or 143, once the ranks it stopped have saved their
  checkpoint (runs.runtime.install_stop_handler), waited for up to SHUTDOWN_S; with 0 when the run had ended its
  training before the signal (it finishes its final checks, and rank 0 says so);
- without OMP_NUM_THREADS set, torchrun's ranks get 1 thread each, as torchrun does, without its banner.
Launched by torchrun or `accelerate launch` directly, each rank prints its own lines, as those launchers would."""

from __future__ import annotations

import importlib
import logging
import os
import re
import shutil
import signal
import sys
import tempfile
from pathlib import Path

from rlhf.infra import ranks


def others(folder: Path) -> list[str]:
    """The lines only ranks other than 0 left in `folder`, each once, naming the first rank that had it:
    `error: rank 1: <its message>`."""
    lines = {int(p.name): p.read_text() for p in folder.iterdir() if p.name.isdigit()}
    said, out = {lines.get(0)}, []
    for rank in sorted(lines):
        line = lines[rank]
        if line not in said:
            said.add(line)
            kind, sep, message = line.partition(": ")
            out.append(f"{kind}: rank {rank}: {message}" if sep else f"rank {rank}: {line}")
    return out


def _status(code: int) -> int:
    """A process's exit code as the shell reports it: a signal's death is 128 + its number."""
    return 128 - code if code < 0 else code


def processes(kind: str, launcher_argv: list[str]) -> int | None:
    """The number of ranks the launcher's options start (torchrun's nodes x processes per node, accelerate's
    --num_processes); None where the launcher decides it (torchrun's `auto` or an elastic MIN:MAX, an accelerate
    config file's)."""
    if kind == "torchrun":
        from torch.distributed.run import parse_args

        a = parse_args(launcher_argv)
        low, _, high = str(a.nnodes).partition(":")  # N, or MIN:MAX (torchrun's default: "1:1")
        n, nodes = str(a.nproc_per_node), low if high in ("", low) else ""
        return int(n) * int(nodes) if n.isdigit() and nodes.isdigit() else None
    from accelerate.commands.launch import launch_command_parser

    return launch_command_parser().parse_args(launcher_argv).num_processes


def _check(stage_argv: list[str], n: int | None) -> int | None:
    """The stage's command line and config checked in this process, its batches' split over the `n` ranks too
    (dist.check_split; n None: the ranks check it), and what it answers without running the stage (cli.answered:
    --print-config, --for, --reuse), said once: the status to exit with, or None to launch."""
    from rlhf.cli import answered, expected_errors, parse_args
    from rlhf.experiment import config
    from rlhf.infra import dist
    from rlhf.runs.records import scrub

    args = parse_args(stage_argv)  # a bad option: argparse's usage line and exit 2, once
    if args.stage == "memcheck":  # memcheck reads no experiment
        return None
    try:
        split = (lambda exp: dist.check_split(exp, args.stage, n)) if n else None
        said = answered(args, config.load(args.exp, args.overrides, check=split))
    except expected_errors() as e:
        print(f"error: {scrub(str(e))}", file=sys.stderr)
        return 2
    if said is not None:
        print(said, end="")
        return 0
    return None


def _launch(kind: str, argv: list[str]) -> None:
    """torchrun's or accelerate's launch of `argv` (their own options, then `-m rlhf ...`), in this process."""
    if kind == "torchrun":
        from torch.distributed.run import parse_args, run

        args = parse_args(argv)
        if args.nproc_per_node not in ("1", 1):
            os.environ.setdefault("OMP_NUM_THREADS", "1")  # torchrun's choice, without its banner
        run(args)
    else:
        from accelerate.commands.launch import launch_command, launch_command_parser

        launch_command(launch_command_parser().parse_args(argv))


SHUTDOWN_S = "600"
"""How long the launcher waits, after a Ctrl-C or SIGTERM, for its ranks to save their checkpoint and exit before it
kills them (torch's TORCH_ELASTIC_SHUTDOWN_TIMEOUT, 30 s by default: less than a 7B iteration and its save)."""


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    module = argv[argv.index("-m") + 1:][:1] if "-m" in argv else []
    if not argv or argv[0] not in ("torchrun", "accelerate") or module != ["rlhf"]:
        print("usage: python -m rlhf.launch torchrun|accelerate LAUNCHER_OPTIONS -m rlhf STAGE [--exp X] "
              "[key=value ...]", file=sys.stderr)
        return 2
    kind, launcher_argv = argv[0], argv[1:]
    saved = dict(os.environ)  # what this process's environment was (a caller in-process gets it back)
    try:
        status = _check(launcher_argv[launcher_argv.index("-m") + 2:], processes(kind, launcher_argv))
        ranks.imported()  # the checks imported the libraries: a Ctrl-C from here is a KeyboardInterrupt again
        return _run(kind, launcher_argv) if status is None else status
    except KeyboardInterrupt:  # Ctrl-C before the ranks started
        ranks.say_stopped()
        return 128 + signal.SIGINT
    finally:
        os.environ.clear()
        os.environ.update(saved)


def _run(kind: str, launcher_argv: list[str]) -> int:
    """The launch, its failures said once (the module's docstring)."""
    import subprocess

    importlib.import_module("torch.distributed.run")  # its loggers exist from here on
    from torch.distributed import DistNetworkError
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    for name, logger in list(logging.root.manager.loggerDict.items()):  # each has its own level (LOGLEVEL's)
        if name.startswith("torch.distributed.elastic") and isinstance(logger, logging.Logger):
            logger.setLevel(logging.CRITICAL)  # a failure or a signal is said below, once
    folder = Path(tempfile.mkdtemp(prefix="rlhf-ranks-"))
    os.environ[ranks.RANK_LINES] = str(folder)
    os.environ[ranks.LAUNCHER_PID] = str(os.getpid())  # a rank still importing when this process goes dies too
    os.environ.setdefault("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", SHUTDOWN_S)
    try:
        _launch(kind, launcher_argv)
        return 0
    except ChildFailedError as e:
        said = [r for r in sorted(e.failures) if (folder / f"{r}.status").exists()]  # why, where a rank said it
        # else the first to fail of those that did not leave for a lost peer (dist.leave_for_peer), by torchrun's
        # timestamps (whole seconds: a peer's leaving can tie with the death it followed)
        died = {r: f for r, f in e.failures.items() if not (folder / f"{r}.left").exists()}
        if not said and not died:  # each lost its peer (their lines are above): none died, the link between them did
            print("error: every failed rank left because its peer went away mid-collective (their lines above): the "
                  "ranks' connection failed, or a rank ended without a failure torchrun saw", file=sys.stderr)
            return 1
        rank = said[0] if said else min(sorted(died), key=lambda r: died[r].timestamp)
        failure = e.failures[rank]
        lines = others(folder)
        if not (folder / str(rank)).exists():  # the rank that failed first said nothing: a traceback above, a signal
            how = (f"was killed by {signal.Signals(-failure.exitcode).name}" if failure.exitcode < 0
                   else f"exited with status {failure.exitcode} (its output is above)")
            lines.append(f"error: rank {rank} {how}; the launcher stopped the other ranks")
        for line in lines:
            print(line, file=sys.stderr)
        # the status the rank that said why ended with (its process may then have been stopped with its peers)
        return int((folder / f"{rank}.status").read_text()) if said else _status(failure.exitcode)
    except SignalException as e:  # Ctrl-C or SIGTERM to the launcher: it stopped its ranks, which save first
        lines = others(folder)
        if not (folder / "0").exists() and not (folder / "0.started").exists():  # stopped as it started, before
            lines.append(ranks.STOPPED)  # its stage's handler was in: nothing was saved
        elif not (folder / "0").exists():  # rank 0 never said it stopped: killed before it could save
            lines.append(f"stopped: the ranks ended before saying they saved (a second signal, or past "
                         f"TORCH_ELASTIC_SHUTDOWN_TIMEOUT={os.environ['TORCH_ELASTIC_SHUTDOWN_TIMEOUT']} s); a rerun "
                         f"resumes from the last complete checkpoint")
        for line in lines:
            print(line, file=sys.stderr)
        # rank 0's status: 143 or 130 once it saved and stopped, 0 when the run had finished its training first
        ended = folder / "0.status"
        return int(ended.read_text()) if ended.exists() else 128 + int(e.sigval)
    except subprocess.CalledProcessError as e:  # accelerate's launches through a subprocess (one process, --cpu)
        return e.returncode
    except DistNetworkError as e:
        taken = re.search(r"port: (\d+).*EADDRINUSE", str(e))
        print(f"error: the launcher's port {taken.group(1)} is in use: another launch may hold it; set PORT= (make) "
              f"or the launcher's port option to a free port" if taken else
              f"error: the launcher could not reach its ranks' rendezvous: {str(e).splitlines()[0]}", file=sys.stderr)
        return 2
    finally:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    ranks.while_importing()  # a Ctrl-C during the checks' imports: one line, exit 130
    sys.exit(main())
