"""Run records: results/<experiment>/<stage>/<run-id>/ with the resolved config, the environment, per-step metrics
(metrics.jsonl) and a final summary.json. Every file that is replaced is written atomically (temp file + rename), so
a killed run never leaves a half-written summary; a stage's `latest` pointer moves only after its summary exists."""

from __future__ import annotations

import contextlib
import datetime
import json
import math
import os
import platform
import re
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.parse
from importlib import metadata
from pathlib import Path

import yaml

from rlhf.experiment import config as config_mod
from rlhf.infra import faults
from rlhf.experiment.config import Experiment
from rlhf.experiment.sections import ModelConfig

SECRET_ENV = ("WANDB_API_KEY", "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HUGGINGFACE_TOKEN")
SECRET_WORDS = ("TOKEN", "KEY", "SECRET", "PASSWORD", "CREDENTIAL")
# environment variables worth recording (none of them secret); everything else stays out of the record
ENV_VARS = ("CUDA_VISIBLE_DEVICES", "CUBLAS_WORKSPACE_CONFIG", "PYTORCH_CUDA_ALLOC_CONF", "OMP_NUM_THREADS",
            "HF_HUB_OFFLINE", "HF_HUB_DISABLE_TELEMETRY", "WANDB_MODE", "WANDB_DISABLE_CODE", "WANDB_DISABLE_GIT",
            "RLHF_DISABLE_TRACKING", "TOKENIZERS_PARALLELISM")
_UMASK = os.umask(0o022)
os.umask(_UMASK)  # read, and put back as it was
FILE_MODE = 0o666 & ~_UMASK
"""The mode a new file gets in this process (0o644 under the usual umask 022): every file of a run record ends with
it, safetensors' owner-only files included (Run.finish), so results a container wrote as root read on the host."""
REDACTED = "<redacted>"
MIN_SECRET = 8  # a secret value shorter than this is not searched for in free text


# a URL in any text: scheme://..., up to whitespace or a quote
URL = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^\s'\"<>]+")


def _secret_name(name: str) -> bool:
    return any(w in name.upper() for w in SECRET_WORDS)


def redact_url(url: str) -> str:
    """`url` with its credentials replaced by <redacted>: the password of `scheme://user:password@host` and the value
    of any query parameter named like a secret (`?password=...`, `?token=...`), parsed by urllib.parse. A URL with
    neither is returned unchanged."""
    parts = urllib.parse.urlsplit(url)
    userinfo, at, host = parts.netloc.rpartition("@")
    query = urllib.parse.parse_qsl(parts.query, keep_blank_values=True)
    has_password, secret_query = bool(at and ":" in userinfo), any(_secret_name(k) for k, _ in query)
    if not (has_password or secret_query):
        return url
    if has_password:
        parts = parts._replace(netloc=f"{userinfo.partition(':')[0]}:{REDACTED}@{host}")
    if secret_query:
        safe = [(k, REDACTED if _secret_name(k) else v) for k, v in query]
        parts = parts._replace(query=urllib.parse.urlencode(safe, safe="<>"))
    return urllib.parse.urlunsplit(parts)


def url_secrets(url: str) -> list[str]:
    """The credentials a URL carries (its password and secret-named query values), as written and decoded, to find
    them outside the URL too; those shorter than MIN_SECRET are left to redact_url (a short word would be replaced
    everywhere)."""
    parts = urllib.parse.urlsplit(url)
    userinfo, at, _ = parts.netloc.rpartition("@")
    found = [userinfo.partition(":")[2]] if at and ":" in userinfo else []
    found += [v for k, v in urllib.parse.parse_qsl(parts.query) if _secret_name(k)]
    return [s for v in found for s in {v, urllib.parse.unquote(v)} if len(s) >= MIN_SECRET]


def secret_values() -> list[str]:
    """Values of the environment's secrets (the known names, any variable named like a token, key or password, and
    the credentials of any URL in a variable, e.g. RLHF_SWEEP_STORAGE's database password)."""
    names = set(SECRET_ENV) | {k for k in os.environ if _secret_name(k)}
    values = {os.environ[k] for k in names if len(os.environ.get(k, "")) >= MIN_SECRET}
    values |= {s for v in os.environ.values() for url in URL.findall(v) for s in url_secrets(url)}
    return sorted(values, key=len, reverse=True)


def scrub(obj, secrets: list[str] | None = None):
    """`obj` with every credential replaced by <redacted>, in any string, key or value: the password (and
    secret-named query values) of every URL in it (redact_url), and every occurrence of a secret value (default: the
    environment's, secret_values()). The one redaction of everything the harness prints, logs, writes or raises."""
    secrets = secret_values() if secrets is None else secrets
    if isinstance(obj, str):
        obj = URL.sub(lambda m: redact_url(m.group()), obj) if "://" in obj else obj
        for s in secrets:
            obj = obj.replace(s, REDACTED)
        return obj
    if isinstance(obj, dict):
        return {scrub(k, secrets): scrub(v, secrets) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [scrub(v, secrets) for v in obj]
    return obj


PACKAGES = ("torch", "transformers", "trl", "peft", "bitsandbytes", "datasets", "accelerate", "wandb", "optuna")


class StageInputError(RuntimeError):
    """A stage's input (an upstream stage's output) is missing or incompatible."""


def atomic_write(path: Path, text: str) -> None:
    """`text` to `path` through a temp file renamed over it: `path` is whole or as it was, never half-written (a
    write that fails removes its temp file; one out of space or permission raises faults.WriteFault)."""
    with faults.writing(path, "file", needed=len(text.encode())):
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
        try:
            os.chmod(tmp, FILE_MODE)  # mkstemp's is 0o600
            with os.fdopen(fd, "w") as f:
                f.write(text)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise


@contextlib.contextmanager
def atomic_dir(path: Path):
    """A directory written whole or not at all: the block writes into a temp sibling (.<name>.tmp, yielded), renamed
    to `path` (replacing one there) when the block ends without an error, so `path` only ever holds what the whole
    block did (what it wrote, and any check it ran on that); on an error (or Ctrl-C) the temp dir is removed, which
    also gives its space back. One left by a write that was killed is removed first. A fault of the machine becomes
    a WriteFault with faults.writing around the block, or around the writes in it with partial=the temp dir: either
    way the temp dir is gone before the free space the error states is measured."""
    tmp = path.parent / f".{path.name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        yield tmp
        if path.exists():
            shutil.rmtree(path)
        tmp.rename(path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _json_safe(obj):
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    if isinstance(obj, dict):
        return {k: _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_json_safe(v) for v in obj]
    return obj


def write_json(path: Path, obj) -> None:
    atomic_write(path, json.dumps(scrub(_json_safe(obj)), indent=2, sort_keys=False) + "\n")


def git_state() -> tuple[str | None, bool]:
    """(the commit this code is checked out at, whether it has uncommitted changes); (None, False) outside git."""
    root = Path(__file__).resolve().parents[2]
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True,
                                timeout=5).stdout.strip() or None
        dirty = bool(commit) and bool(subprocess.run(["git", "status", "--porcelain"], cwd=root, capture_output=True,
                                                     text=True, timeout=5).stdout.strip())
    except (OSError, subprocess.SubprocessError):
        return None, False
    return commit, dirty


def environment() -> dict:
    import torch

    env = {"python": platform.python_version(), "platform": platform.platform(), "hostname": platform.node(),
           "torch_cuda": torch.version.cuda, "device": "cpu"}
    if torch.cuda.is_available():
        env["device"] = torch.cuda.get_device_name(0)
    env["git_commit"], env["git_dirty"] = git_state()
    env["env"] = {k: os.environ[k] for k in ENV_VARS if k in os.environ}
    env["packages"] = {}
    for p in PACKAGES:
        try:
            env["packages"][p] = metadata.version(p)
        except metadata.PackageNotFoundError:
            env["packages"][p] = None
    return env


def stage_root(exp: Experiment, stage: str) -> Path:
    return Path(exp.results_dir) / exp.name / stage


def process_start(pid: int) -> str | None:
    """When process `pid` started, as the kernel counts it (Linux: its start time in clock ticks since boot, with the
    boot's id), to tell it from a later process given the same pid (after a reboot, or pids wrapping round); None
    where there is no /proc."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return f"{boot}:{stat.rsplit(')', 1)[1].split()[19]}"  # field 22, counted after the command's closing paren


def owner() -> dict:
    """This process, as a run's owner.json names it: pid, host and start (process_start)."""
    return {"pid": os.getpid(), "host": socket.gethostname(), "start": process_start(os.getpid())}


def config_changes(before: dict, after: dict) -> list[str]:
    """The keys of `before` whose values differ in `after` (configs as dicts), each as `key: old -> new`; a key only
    `after` has is a field added since `before` was written, not a change."""
    a, b = config_mod.flatten(before), config_mod.flatten(after)
    return [f"{k}: {a.get(k)!r} -> {b.get(k)!r}" for k in sorted(a) if a[k] != b.get(k)]


class Run:
    """One stage run's record directory. `resume=(run_dir, metrics_lines)` reopens a killed run's directory: its
    metrics.jsonl is cut back to the lines written before the checkpoint and appended to from there."""

    def __init__(self, exp: Experiment, stage: str, inputs: dict | None = None, lineage: dict | None = None,
                 resume: tuple[Path, int] | None = None):
        from rlhf.infra import dist

        self.exp, self.stage = exp, stage
        self.start = time.time()
        self.secrets = secret_values()
        self.lineage = lineage or {}
        self.inputs = inputs or {}
        self.lines = 0
        self.changed: list[str] = []
        # data parallel: one run directory, named by rank 0 and written by rank 0 only (the others log nothing)
        self.writer = dist.is_main()
        if resume:
            self.dir, keep = resume
        else:
            root = stage_root(exp, stage)
            self.dir = root / dist.broadcast_object(new_run_dir(root).name if dist.is_main() else None)
        if not self.writer:
            return
        if resume:
            # the record's config is the one the run finishes under (its summary's figures follow it); what changed
            # since it started is outside its fingerprint (it would not resume else), said and kept in the summary
            text, before = scrub(config_mod.dump(exp), self.secrets), self.dir / "config.yaml"
            self.changed = (config_changes(yaml.safe_load(before.read_text()) or {}, yaml.safe_load(text))
                            if before.is_file() else [])
            if self.changed:
                atomic_write(before, text)
            lines = (self.dir / "metrics.jsonl").read_text().splitlines(keepends=True)[:keep]
            atomic_write(self.dir / "metrics.jsonl", "".join(lines))
            self.lines = len(lines)
            if lines:  # the run's clock goes on from its last kept line: `time` and wall_time_s count both sittings
                self.start -= json.loads(lines[-1]).get("time", 0.0)
        else:
            atomic_write(self.dir / "config.yaml", scrub(config_mod.dump(exp), self.secrets))
            write_json(self.dir / "env.json", environment())
        write_json(self.dir / "owner.json", owner())
        if lineage:
            write_json(self.dir / "lineage.json", lineage)
        (self.dir / "metrics.jsonl").touch()

    def log(self, step: int, metrics: dict) -> None:
        if not self.writer:
            return
        line = json.dumps(_json_safe({"step": step, "time": round(time.time() - self.start, 3), **metrics}))
        # opened for each line: a run that stops on an error (a NaN, a fault) leaves no file open behind it
        with faults.writing(self.dir / "metrics.jsonl", "metrics"):  # a line cut short is cut off on resume
            with open(self.dir / "metrics.jsonl", "a") as f:
                f.write(scrub(line, self.secrets) + "\n")
        self.lines += 1

    def finish(self, summary: dict) -> dict:
        summary = {"experiment": self.exp.name, "stage": self.stage, "run_dir": str(self.dir),
                   "wall_time_s": round(time.time() - self.start, 2), "inputs": self.inputs,
                   **({"lineage": self.lineage} if self.lineage else {}), **summary}
        if os.environ.get("RLHF_SWEEP"):  # set by rlhf.sweeps for a trial's stages: {"study", "trial", "params"}
            summary["sweep"] = json.loads(os.environ["RLHF_SWEEP"])
        if not self.writer:
            return summary
        readable(self.dir)
        write_json(self.dir / "summary.json", summary)
        atomic_write(stage_root(self.exp, self.stage) / "latest", self.dir.name + "\n")
        return summary


def readable(root: Path) -> None:
    """Files under `root` that a library wrote for its owner alone (safetensors writes 0o600) get FILE_MODE."""
    for p in root.rglob("*"):
        try:
            if p.is_file() and not p.is_symlink() and not p.stat().st_mode & 0o077:
                p.chmod(FILE_MODE)
        except OSError:  # gone since listed, or another user's: a finished run is never failed for a mode
            pass


def new_run_dir(root: Path) -> Path:
    """A new, empty run directory under `root`, named by the time it was made to the microsecond
    (YYYYmmdd-HHMMSS-ffffff): names sort in the order runs started, also within a second (`make compare` lists runs
    in that order); made with exist_ok=False, so two processes never share one."""
    root.mkdir(parents=True, exist_ok=True)
    while True:
        path = root / datetime.datetime.now().strftime("%Y%m%d-%H%M%S-%f")
        try:
            path.mkdir()
            return path
        except FileExistsError:
            continue


def latest_run(root: Path) -> Path | None:
    """The run directory a stage's `latest` pointer under `root` names (the run downstream stages consume), or None
    where there is no pointer."""
    pointer = root / "latest"
    return root / pointer.read_text().strip() if pointer.exists() else None


def latest(exp: Experiment, stage: str, needed_by: str) -> tuple[Path, dict]:
    """The newest completed run of `stage` for this experiment, or a clear StageInputError."""
    root = stage_root(exp, stage)
    run_dir = latest_run(root)
    if run_dir is None:
        raise StageInputError(f"{needed_by} needs a finished {stage} run of experiment '{exp.name}', and there is none "
                              f"under {root}/. Run `make {stage} EXP={exp.source or '...'}` first.")
    summary_path = run_dir / "summary.json"
    if not summary_path.exists():
        raise StageInputError(f"{needed_by}: the {stage} run {run_dir} has no summary.json (killed?). "
                              f"Rerun `make {stage}`.")
    return run_dir, json.loads(summary_path.read_text())


def base_key(name: str | None) -> str | None:
    """model.name as one spelling: a local folder's absolute path (`./mymodel`, `mymodel` and its absolute path are
    one key, from whichever working directory); a hub id as given."""
    return str(Path(name).resolve()) if name and Path(name).is_dir() else name


def same_base(recorded: str | None, name: str) -> bool:
    """Whether a run's recorded base (model.name as it was given) is `name`: the same hub id, or the same local folder
    however it is written (base_key)."""
    return recorded == name or (bool(recorded) and base_key(recorded) == base_key(name))


def check_same_base(exp: Experiment, upstream: dict, stage: str, needed_by: str, tokenizer_hash: str,
                    run_dir: Path | None = None) -> None:
    """Refuse an upstream output (its summary `upstream`, in `run_dir`) made with another base model or tokenizer."""
    got = upstream.get("model", {})
    if not same_base(got.get("base_model"), exp.model.name):
        raise StageInputError(f"{needed_by}: the {stage} output at {upstream.get('run_dir')} was trained on base "
                              f"'{got.get('base_model')}', but this experiment's model.name is '{exp.model.name}'. "
                              f"Rerun `make {stage}` for this experiment.")
    if got.get("tokenizer_hash") != tokenizer_hash:
        raise StageInputError(f"{needed_by}: the {stage} output at {upstream.get('run_dir')} was trained with another "
                              f"tokenizer (hash {got.get('tokenizer_hash')}, now {tokenizer_hash}). "
                              f"Rerun `make {stage}` for this experiment.")
    recorded = Path(run_dir or upstream.get("run_dir") or "") / "config.yaml"
    if not recorded.is_file():
        return
    # its model section as written (the rest of that config may name files gone since: not loaded)
    theirs = (yaml.safe_load(recorded.read_text()) or {}).get("model") or {}
    for k in BASE_FIELDS if exp.model.name == "tiny" else ("revision",):
        was = theirs.get(k, getattr(ModelConfig, k))
        if was != getattr(exp.model, k):  # the record would say one base, the stage train on another
            raise StageInputError(f"{needed_by}: the {stage} output at {upstream.get('run_dir')} was trained with "
                                  f"model.{k}={was!r}, but this experiment's is {getattr(exp.model, k)!r}. Run "
                                  f"`make {stage}` with this experiment's model settings first.")


BASE_FIELDS = ("revision", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "tie_embeddings", "vocab_size",
               "intermediate_size", "max_position_embeddings")
"""The model fields that make the tiny base (a hub base: its revision): a stage takes an upstream run's only if they
agree (check_same_base)."""
