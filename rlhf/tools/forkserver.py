"""A pre-imported launcher for `python -m rlhf ...`: one server process imports torch, transformers, peft, TRL and the
stages once (about 8 s on two CPU cores), then forks a child per command. The test suite starts one per pytest
worker, so its ~100 stage processes (`make sft`, memcheck's stages, sweep trials, ...) skip the imports.

    python -m rlhf.tools.forkserver SOCKET     # serve until killed; writes `ready` on stdout once listening

A client is any `python -m rlhf ...` (rlhf/__main__.py), `python -m rlhf.tools.gpucheck` or `... decodebench` run
with RLHF_FORKSERVER=SOCKET in its environment (main_of). It passes its argv, working directory, environment and
standard streams (the file descriptors themselves); the child runs the command with exactly those, and the client
exits with the child's status. SIGTERM, SIGINT and SIGHUP sent to the client are forwarded to the child; if the
client dies (SIGKILL included), the child is killed at once. The server declines a command, and the client then runs
it itself as usual, when the client's interpreter differs or an environment variable read at import time (HF_*,
TORCH*, OMP_*, PYTHON*, ...) differs from the server's (but PYTHONUNBUFFERED, which the child applies to its streams,
and a variable the server's own imports set, as they set it). With RLHF_FORKSERVER_LOG=FILE in its environment the
server appends each declined command's reason to FILE, a line each (the suite counts them in its last lines).
Without RLHF_FORKSERVER nothing changes: users never need it."""

from __future__ import annotations

import json
import os
import re
import selectors
import signal
import socket
import sys

ENV = "RLHF_FORKSERVER"
LOG = "RLHF_FORKSERVER_LOG"
# variables that libraries read when imported: a command that sets them differently is not served (PYTHONUNBUFFERED
# apart: the child sets its streams' buffering from it)
# and torchrun's per-launch variables for its ranks (TORCHELASTIC_*, TORCH_NCCL_*), read when a rank joins its group
IMPORT_TIME = re.compile(r"^(HF_|HUGGINGFACE|TRANSFORMERS|DATASETS|TOKENIZERS|TORCH(?!ELASTIC_|_NCCL_)|PYTORCH|CUDA|"
                         r"NVIDIA|OMP_|MKL_|OPENBLAS|BNB_|BITSANDBYTES|TRL_|PYTHON(?!UNBUFFERED$)|LD_|XDG_CACHE)")
_in_child = False
_startup_env: dict[str, str] = {}  # the server's environment before its imports
_import_env: dict[str, str] = {}  # what its imports added (cli's defaults): set in each child as they would be


def _send(sock: socket.socket, obj: dict) -> None:
    sock.sendall(json.dumps(obj).encode() + b"\n")


def _recv_line(sock: socket.socket) -> dict | None:
    buf = b""
    while not buf.endswith(b"\n"):
        chunk = sock.recv(4096)
        if not chunk:
            return None
        buf += chunk
    return json.loads(buf)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("client closed the connection")
        buf += chunk
    return buf


# ---------------------------------------------------------------------------------------------------- the client
def run(module: str, argv: list[str]) -> int | None:
    """Run `python -m MODULE ARGV` in a child of the server named by $RLHF_FORKSERVER and return its exit code; None
    when there is no server, it declined, or this process is itself a served command (run it here as usual)."""
    path = os.environ.get(ENV)
    if not path or _in_child:
        return None
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(path)
    except OSError:
        return None
    body = json.dumps({"module": module, "argv": argv, "cwd": os.getcwd(), "env": dict(os.environ),
                       "prefix": sys.prefix, "version": sys.version}).encode()
    socket.send_fds(sock, [b"\0"], [0, 1, 2])
    sock.sendall(len(body).to_bytes(8, "big") + body)
    reply = _recv_line(sock)
    if reply is None or "pid" not in reply:
        return None
    pid = reply["pid"]
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda n, _frame: os.kill(pid, n))
    done = _recv_line(sock)
    status = done["status"] if done else (signal.SIGKILL & 0x7F)  # the server died: report a killed command
    if os.WIFSIGNALED(status):  # die by the same signal, as the command itself would have
        sig = os.WTERMSIG(status)
        if sig not in (signal.SIGKILL, signal.SIGSTOP):  # these two have no handler to reset
            signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
    return os.waitstatus_to_exitcode(status)


def main_of(module: str, main) -> int:
    """A `python -m MODULE` entry point's exit code: the server's child runs it where there is a server that serves it
    (run), else `main()` runs here."""
    code = run(module, sys.argv[1:])
    return main() if code is None else code


# ---------------------------------------------------------------------------------------------------- the server
def _declines(req: dict) -> str | None:
    if req["prefix"] != sys.prefix or req["version"] != sys.version:
        return "another interpreter"
    if req["module"] != "rlhf" and not req["module"].startswith("rlhf."):
        return f"module {req['module']}"
    ours = {k: v for k, v in _startup_env.items() if IMPORT_TIME.match(k)}
    # what the imports themselves set (torch's TORCHINDUCTOR_CACHE_DIR), as they set it, is no difference: a client
    # that imported them has it too, and each child gets it
    theirs = {k: v for k, v in req["env"].items() if IMPORT_TIME.match(k) and _import_env.get(k) != v}
    if ours != theirs:
        return "import-time environment differs: " + "=".join(sorted(set(ours.items()) ^ set(theirs.items()))[0])
    return None


def _child(conn: socket.socket, fds: list[int], req: dict, inherited: list) -> None:
    """In the forked child: become the client's command, run it, exit with its code."""
    global _in_child
    _in_child = True
    for other in inherited:  # the listener and the other commands' connections are the server's
        other.close()
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGCHLD):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(req["cwd"])
    os.environ.clear()
    os.environ.update(req["env"])
    for k, v in _import_env.items():
        os.environ.setdefault(k, v)
    sys.path[0] = req["cwd"]  # `python -m` puts the working directory first: the user's own modules import
    unbuffered = bool(os.environ.get("PYTHONUNBUFFERED"))
    for stream, fd in ((sys.stdout, 1), (sys.stderr, 2)):
        # PYTHONUNBUFFERED: each line reaches the fd (write_through alone stops at the byte buffer it inherited)
        stream.reconfigure(line_buffering=os.isatty(fd) or fd == 2 or unbuffered, write_through=unbuffered)

    import threading

    def watch():  # the client went away (killed, even by SIGKILL): so does the command
        try:
            conn.recv(1)
        finally:
            os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, daemon=True).start()
    import atexit
    import runpy
    import traceback

    code = 0
    try:
        sys.argv = [req["module"], *req["argv"]]
        runpy.run_module(req["module"], run_name="__main__", alter_sys=True)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else (print(e.code, file=sys.stderr), 1)[1])
    except KeyboardInterrupt:
        traceback.print_exc()
        code = -signal.SIGINT
    except BaseException:  # noqa: BLE001 - as the interpreter does: the traceback, exit 1
        traceback.print_exc()
        code = 1
    try:
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        if code < 0:
            signal.signal(-code, signal.SIG_DFL)
            os.kill(os.getpid(), -code)
        os._exit(code & 0xFF)


def preload() -> None:
    """What every stage imports: the libraries and the stage modules (nothing runs, no thread starts)."""
    import importlib

    from rlhf.experiment import stages

    for name in ("torch", "transformers", "peft", "trl", "datasets", "accelerate", "bitsandbytes", "rlhf.cli",
                 *{s.path for s in stages.REGISTRY.values()}):
        importlib.import_module(name)


def serve(path: str) -> None:
    _startup_env.update(os.environ)
    preload()
    _import_env.update({k: v for k, v in os.environ.items() if k not in _startup_env})
    if os.path.exists(path):
        os.unlink(path)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ)
    clients: dict[int, socket.socket] = {}
    print("ready", flush=True)
    while True:
        for _key, _ in sel.select(timeout=0.05):
            conn, _ = listener.accept()
            try:
                _, fds, _, _ = socket.recv_fds(conn, 1, 3)
                req = json.loads(_recv_exact(conn, int.from_bytes(_recv_exact(conn, 8), "big")))
            except (OSError, ValueError, ConnectionError):
                conn.close()
                continue
            reason = _declines(req) if len(fds) == 3 else "no standard streams"
            if reason:
                _send(conn, {"declined": reason})
                if os.environ.get(LOG):
                    with open(os.environ[LOG], "a") as f:
                        f.write(reason + "\n")
                for fd in fds:
                    os.close(fd)
                conn.close()
                continue
            pid = os.fork()
            if pid == 0:
                sel.close()
                _child(conn, fds, req, [listener, *clients.values()])
            for fd in fds:
                os.close(fd)
            try:
                _send(conn, {"pid": pid})
            except OSError:
                os.kill(pid, signal.SIGKILL)
            clients[pid] = conn
        while clients:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            conn = clients.pop(pid, None)
            if conn is not None:
                try:
                    _send(conn, {"status": status})
                except OSError:
                    pass
                conn.close()


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m rlhf.tools.forkserver SOCKET")
    from rlhf.tools import forkserver  # the module its children see (this file runs as __main__)

    forkserver.serve(sys.argv[1])
