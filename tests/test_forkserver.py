"""The suite's pre-imported launcher (rlhf/tools/forkserver.py) serves a command only where a fresh interpreter would
import the same libraries the same way: another interpreter, another module tree or a variable read at import time
that differs is declined (the client then runs the command itself); PYTHONUNBUFFERED is the child's to apply, and
what the server's own imports set (torch's inductor cache folder) is no difference when a client has it the same.
A served command that dies by a signal ends its client by the same signal."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from rlhf.tools import forkserver

from .conftest import ROOT, TINY


def request(env, module="rlhf", prefix=sys.prefix, version=sys.version):
    return {"module": module, "argv": ["sft"], "cwd": "/", "env": env, "prefix": prefix, "version": version}


def test_a_command_is_served_only_with_the_servers_interpreter_and_import_time_environment(monkeypatch):
    ours = {"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": "/a", "HOME": "/root"}
    monkeypatch.setattr(forkserver, "_startup_env", dict(ours))
    monkeypatch.setattr(forkserver, "_import_env", {"TORCHINDUCTOR_CACHE_DIR": "/tmp/inductor"})
    assert forkserver._declines(request(ours)) is None
    assert forkserver._declines(request({**ours, "HOME": "/elsewhere", "RLHF_X": "1"})) is None  # not import-time
    assert forkserver._declines(request({**ours, "PYTHONUNBUFFERED": "1"})) is None  # the child's streams honour it
    # a torchrun rank: the launcher's variables are read when the rank joins its group, not at import
    rank = {"TORCHELASTIC_RUN_ID": "none", "TORCHELASTIC_ERROR_FILE": "/tmp/e.json", "RANK": "1", "WORLD_SIZE": "2",
            "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1", "MASTER_PORT": "29500"}
    assert forkserver._declines(request({**ours, **rank})) is None
    # a client that imported torch (gpucheck, before its stage processes) has the folder torch's import set
    assert forkserver._declines(request({**ours, "TORCHINDUCTOR_CACHE_DIR": "/tmp/inductor"})) is None
    assert "TORCHINDUCTOR_CACHE_DIR" in forkserver._declines(request({**ours, "TORCHINDUCTOR_CACHE_DIR": "/mine"}))
    for k, v in (("HF_DATASETS_OFFLINE", "1"), ("OMP_NUM_THREADS", "2"), ("PYTHONPATH", "/b"),
                 ("TORCH_LOGS", "+dynamo"), ("PYTHONHASHSEED", "0")):
        assert k in forkserver._declines(request({**ours, k: v})), k
    assert "HF_HUB_OFFLINE" in forkserver._declines(request({k: v for k, v in ours.items() if k != "HF_HUB_OFFLINE"}))
    assert forkserver._declines(request(ours, prefix="/other/venv")) == "another interpreter"
    assert forkserver._declines(request(ours, module="pytest")) == "module pytest"


def test_a_served_command_killed_by_sigkill_ends_its_client_by_it(tmp_path):
    """The stage process (its run's owner.json: the server's child) killed as the OOM killer would: the client dies
    by SIGKILL too (SIGKILL has no handler to reset: that once ended the client with a traceback, exit 1), once the
    server has reaped the process."""
    if not os.environ.get(forkserver.ENV):
        pytest.skip("the suite's fork server is off (RLHF_FORKSERVER=0)")
    cmd = [sys.executable, "-m", "rlhf", "sft", "--exp", str(TINY), f"results_dir={tmp_path}", "sft.max_steps=100000"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 120
        while not list(tmp_path.glob("tiny/sft/2*/owner.json")) and time.time() < deadline and proc.poll() is None:
            time.sleep(0.05)
        (owner,) = tmp_path.glob("tiny/sft/2*/owner.json")
        pid = json.loads(owner.read_text())["pid"]
        assert pid != proc.pid  # served: the server's child
        os.kill(pid, signal.SIGKILL)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()  # a failed assertion must not leave a 100,000-step run behind (the client's death ends it)
    assert proc.returncode == -signal.SIGKILL and "Traceback" not in err, err[-2000:]
    with pytest.raises(ProcessLookupError):  # reaped by the server, not a zombie
        os.kill(pid, 0)
