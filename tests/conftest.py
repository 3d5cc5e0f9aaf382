import os
from pathlib import Path

import pytest

# `make test` runs pytest under make: tests that call `make -n` must not inherit the outer make's level and flags
# (make[1]: Entering directory ... lines would be mixed into their output)
for _var in ("MAKELEVEL", "MAKEFLAGS", "MFLAGS", "MAKEOVERRIDES"):
    os.environ.pop(_var, None)
# One torch thread per process: the suite runs on 2 xdist workers (make test), each with its own stage processes, on
# two cores; a second thread per process only oversubscribes them. Stage processes inherit it.
THREADS = os.environ.setdefault("RLHF_TEST_THREADS", "1")
os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = THREADS
# Offline, untracked, as gpucheck's runs are (its stage processes then match the forkserver's import-time environment)
from rlhf.tools.gpucheck import OFFLINE_ENV  # noqa: E402 - after the threads: nothing here imports torch

for _var, _value in OFFLINE_ENV.items():
    os.environ.setdefault(_var, _value)

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "experiments" / "tiny.yaml"
HH_FILE = ROOT.parent / "shared" / "data" / "hh-rlhf" / "harmless-base-test.jsonl.gz"
DECLINED = "RLHF_TEST_FORKSERVER_DECLINED"  # a folder: each fork server's log of the commands it declined


def pytest_configure(config):
    import signal

    import torch

    torch.set_num_threads(int(THREADS))
    if not hasattr(config, "workerinput"):  # the controller (or the only process): its workers inherit the folder
        import tempfile

        os.environ[DECLINED] = tempfile.mkdtemp(prefix="rlhf-forkserver-")
    # A suite started in the background by a script (`make test &` in a shell without job control) inherits SIGINT
    # ignored, and so would every process a test starts: the tests that press Ctrl-C need theirs to start as a
    # terminal's command does (Python's handler)
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def pytest_terminal_summary(terminalreporter):
    """The instruction sets that choose kernels here, in every run's last lines, `make test`'s -q included
    (docs/cpu.md); and the commands the fork servers did not serve, by reason (each imported everything again)."""
    import collections
    import shutil

    import torch
    from bitsandbytes.functional import has_avx512bf16

    if os.environ.get(DECLINED):
        reasons = collections.Counter(line for f in Path(os.environ[DECLINED]).glob("*")
                                      for line in f.read_text().splitlines())
        shutil.rmtree(os.environ[DECLINED], ignore_errors=True)
        if reasons:
            n = sum(reasons.values())
            terminalreporter.write_line(f"fork server: {n} command{'s' * (n > 1)} not served: " + "; ".join(
                f"{reason} ({count})" for reason, count in reasons.most_common()))

    terminalreporter.write_line(f"cpu: torch kernels for {torch.backends.cpu.get_cpu_capability()}, bitsandbytes sees "
                                f"AVX512-BF16: {bool(has_avx512bf16())} (the harness keeps its 4-bit layers on the "
                                f"plain path either way)")


def tiny(results_dir, *overrides):
    from rlhf.experiment import config

    return config.load(TINY, [f"results_dir={results_dir}", *overrides])


# make test runs the modules on 2 xdist workers, each module whole on one worker (--dist loadfile: a module's
# fixtures, trained pipelines included, are built once), the longest first so that the other worker runs the rest
# beside them (the durations: docs/testing.md). xdist gives each worker one module at the start, so the two longest
# start at once (test_reward_pipeline, 7th until the nineteenth session, took 7 to 14 min on the AVX2-only EPYC and,
# by that order, started about 20 minutes into a 35-minute run).
LONGEST = ("test_pipeline", "test_reward_pipeline", "test_distributed", "test_memory", "test_sweep", "test_gpucheck",
           "test_repro", "test_faults", "test_chat_pipeline")


def _order(item) -> int:
    module = item.module.__name__.rsplit(".", 1)[-1]
    return LONGEST.index(module) if module in LONGEST else len(LONGEST)


def pytest_collection_modifyitems(config, items):
    import torch

    items.sort(key=_order)  # stable: collection order within each rank, the same on every worker
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def _serve(path: Path, env: dict):
    """A fork server (rlhf/tools/forkserver.py) listening on `path`, started with `env`; its process."""
    import subprocess
    import sys

    from rlhf.tools import forkserver

    log = {forkserver.LOG: str(Path(os.environ[DECLINED]) / f"{path.parent.name}-{os.getpid()}")} \
        if os.environ.get(DECLINED) else {}
    proc = subprocess.Popen([sys.executable, "-m", "rlhf.tools.forkserver", str(path)], cwd=ROOT,
                            stdout=subprocess.PIPE, text=True, env={**env, **log})
    if proc.stdout.readline().strip() != "ready":
        proc.kill()
        raise RuntimeError("the fork server did not start (python -m rlhf.tools.forkserver)")
    return proc


def _stop(proc) -> None:
    proc.terminate()
    proc.wait(timeout=30)
    proc.stdout.close()


@pytest.fixture(scope="session", autouse=True)
def forkserver(tmp_path_factory):
    """Stage processes (`make sft`, `python -m rlhf ...`) fork from a server that imported torch, transformers, peft
    and TRL once (rlhf/tools/forkserver.py), instead of importing them again (~8 s each, ~100 of them): one server per
    worker. RLHF_FORKSERVER=0 turns it off. Tests of real process boundaries use `real_process_env()`."""
    if os.environ.get("RLHF_FORKSERVER") == "0":
        os.environ.pop("RLHF_FORKSERVER")
        yield None
        return
    path = tmp_path_factory.mktemp("forkserver") / "sock"
    proc = _serve(path, dict(os.environ))
    os.environ["RLHF_FORKSERVER"] = str(path)
    yield path
    os.environ.pop("RLHF_FORKSERVER", None)
    _stop(proc)


@pytest.fixture(autouse=True)
def _environment_as_it_was():
    """Each test's environment back as it found it (after monkeypatch's own undo), whatever the code it ran in-process
    set: launch._run's TORCH_ELASTIC_SHUTDOWN_TIMEOUT, left behind by one test, once made the fork server decline
    every later command of that worker (an import-time variable it did not start with), silently, for the rest of
    the suite (each stage process then imported everything again)."""
    before = dict(os.environ)
    yield
    if os.environ != before:
        os.environ.clear()
        os.environ.update(before)


def real_process_env(**extra) -> dict:
    """The environment for a command that must be a process of its own (its rank killed, a mount namespace of its
    own): without the fork server. (A torchrun launch is served: each rank a child of its own,
    tests/test_distributed.py; a stage process signalled through its run's owner.json is served too,
    tests/test_repro.py's signal_when.)"""
    return {**{k: v for k, v in os.environ.items() if k != "RLHF_FORKSERVER"}, **extra}


# bitsandbytes deciding as on a CPU with AVX512-BF16 (tests/avx512bf16/sitecustomize.py), in a process started with
# this environment, or in-process through the fixture below
AVX512BF16_ENV = {"PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "tests" / "avx512bf16"),
                                                              os.environ.get("PYTHONPATH")]))}


@pytest.fixture(scope="session")
def avx512bf16_env(tmp_path_factory):
    """The environment for stage commands with bitsandbytes deciding as on a CPU with AVX512-BF16: AVX512BF16_ENV,
    served by a fork server of its own that started with it (the suite's declines a PYTHONPATH it did not start
    with), or without one where the fork server is off."""
    env = real_process_env(**AVX512BF16_ENV)
    if "RLHF_FORKSERVER" not in os.environ:
        yield env
        return
    path = tmp_path_factory.mktemp("forkserver-avx512bf16") / "sock"
    proc = _serve(path, env)
    yield {**env, "RLHF_FORKSERVER": str(path)}
    _stop(proc)


@pytest.fixture
def bnb_as_on_avx512bf16(monkeypatch):
    """Every bitsandbytes 4-bit layer built in this test has the AVX512-BF16 CPU flag on, and a repacking raises;
    yields the list of refused repackings."""
    from .avx512bf16.sitecustomize import force

    yield force(monkeypatch.setattr)


def tiny_llama(tok, **fields):
    """A 2-layer, 32-wide random Llama over `tok`'s vocabulary (seeded), for generation and masking tests."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64,
                      pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id,
                      **fields)
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).eval()


def printed_run_dir(out: str) -> str:
    """The run directory of the last summary table a stage printed (cli.console_summary's `run` row)."""
    import re

    found = re.findall(r"^  run +(\S+) \(summary\.json", out, re.M)
    assert found, f"no summary table in:\n{out[-3000:]}"
    return found[-1]


def make(target: str, *args: str, timeout: int = 1200):
    """Run `make TARGET ARGS...` in the repository as a user types it; fail the test with make's output tail."""
    import subprocess

    proc = subprocess.run(["make", target, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"make {target} {' '.join(args)} exited {proc.returncode}:\n{proc.stderr[-3000:]}"
    return proc
