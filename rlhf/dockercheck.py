"""Static checks of the CUDA image's Dockerfile, run by `make test` (tests/test_docker.py) and `make docker-check`.

The Dockerfile is read with a real parser (dockerfile-parse); shell commands are split with shlex. Rules:

  base-digest  every base image is pinned by tag and digest: FROM image:tag@sha256:<64 hex>
  pip-lock     every pip install, in a RUN or in a script the image runs, takes its versions from requirements.lock
               (-c/-r requirements.lock, or NAME==$VAR with VAR read from the lock); no literal versions, no
               unconstrained names, no URLs, no Python packages from apt
  non-root     the image runs as a user other than root (the last USER of the final stage)
  secrets      no credentials: no ENV/ARG named like a token, key, secret or password holding a value (ARGs of that
               name at all: build arguments stay in the image history), no .netrc, no login at build time
  telemetry    ENV HF_HUB_DISABLE_TELEMETRY=1
  wandb-mode   no fixed WANDB_MODE: rlhf/tracking.py logs offline unless WANDB_API_KEY is passed at run time
  volumes      the Hugging Face cache (ENV HF_HOME) and <WORKDIR>/results are VOLUMEs
  entrypoint   ENTRYPOINT ["make"], so `docker run IMAGE ppo EXP=...` runs a stage

usage: python -m rlhf.dockercheck [DOCKERFILE]   (exit 1 and one line per violation when any rule fails)
"""

from __future__ import annotations

import json
import re
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

from dockerfile_parse import DockerfileParser
from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parent.parent
LOCK = "requirements.lock"
INSTALL_SCRIPT = "scripts/install.sh"

RULES = ("base-digest", "pip-lock", "non-root", "secrets", "telemetry", "wandb-mode", "volumes", "entrypoint")

SECRET_NAME = re.compile(r"TOKEN|SECRET|PASSW(OR)?D|API_?KEY|ACCESS_?KEY|PRIVATE_?KEY|CREDENTIAL|(^|_)KEY$", re.I)
SECRET_LITERAL = re.compile(r"\bhf_[A-Za-z0-9]{20,}\b|\bghp_[A-Za-z0-9]{20,}\b")
LOGIN = re.compile(r"\b(wandb\s+login|huggingface-cli\s+login|hf\s+auth\s+login)\b")
DIGEST = re.compile(r"(?P<repo>[^@\s]+?)(?::(?P<tag>\w[\w.-]*))?@sha256:(?P<digest>[0-9a-f]{64})")
PIP = re.compile(r"(^|/)\$?\{?pip(3(\.\d+)?)?\}?$")
SEPARATORS = {"&&", "||", ";", "|", "&", "(", ")", ";;", "|&"}
SHELL_WORDS = {"if", "then", "else", "elif", "do", "while", "until", "!", "{", "}", "exec", "command", "time"}
# pip options that take a value (the next word)
PIP_VALUE_OPTIONS = {
    "-c", "--constraint", "-r", "--requirement", "-e", "--editable", "-i", "--index-url", "--extra-index-url",
    "-f", "--find-links", "-t", "--target", "--prefix", "--root", "--src", "--upgrade-strategy", "--python",
    "--platform", "--python-version", "--implementation", "--abi", "--only-binary", "--no-binary", "--report",
    "--progress-bar", "--log", "--cache-dir", "--timeout", "--retries", "--trusted-host", "-C", "--config-settings",
    "--global-option", "--exists-action", "--proxy", "--cert", "--client-cert",
}
TRUE = {"1", "true", "yes", "on"}


@dataclass(frozen=True)
class Violation:
    rule: str
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


def final_stage(instrs: list[Instruction]) -> list[Instruction]:
    starts = [k for k, i in enumerate(instrs) if i.name == "FROM"]
    return instrs[starts[-1]:] if starts else instrs


def lock_pins(root: Path = ROOT) -> dict[str, str]:
    """{canonical name: version} of every `name==version` line of requirements.lock."""
    pins = {}
    for raw in (root / LOCK).read_text().splitlines():
        line = raw.split("#", 1)[0].strip()
        if line:
            req = Requirement(line)
            (spec,) = req.specifier
            pins[canonicalize_name(req.name)] = spec.version
    return pins


def key_values(value: str) -> list[tuple[str, str | None]]:
    """ENV/ARG pairs: `A=1 B="x y"`, `NAME` (an ARG without default) or the legacy `ENV NAME value`."""
    words = shlex.split(value)
    if len(words) >= 2 and "=" not in words[0]:
        return [(words[0], " ".join(words[1:]))]
    return [tuple(w.split("=", 1)) if "=" in w else (w, None) for w in words]


def shell_commands(text: str) -> list[list[str]]:
    """The simple commands of a shell text: words split at &&, ||, ;, | and parentheses, shell keywords dropped."""
    lexer = shlex.shlex(text, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    try:
        words = list(lexer)
    except ValueError:  # unbalanced quotes: a plain split still finds the commands
        words = text.split()
    commands, current = [], []
    for word in words:
        if word in SEPARATORS:
            commands.append(current)
            current = []
        elif current or word not in SHELL_WORDS:
            current.append(word)
    commands.append(current)
    return [c for c in commands if c]


def script_commands(path: Path) -> list[tuple[int, list[str]]]:
    """(line, words) of each simple command of a shell script or of a Makefile's recipes."""
    out, pending, start = [], "", 0
    makefile = path.name == "Makefile"
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if makefile and not line.startswith("\t") and not pending:
            continue
        if not pending:
            start = number
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        text = pending + line
        pending = ""
        if text.strip().startswith("#"):
            continue
        out += [(start, words) for words in shell_commands(text.strip().lstrip("@-"))]
    return out


def pip_install_args(words: list[str]) -> list[str] | None:
    """The arguments after `pip install` (pip, pip3, /path/pip, python -m pip, uv pip), None if not a pip install."""
    for k, word in enumerate(words[:-1]):
        if PIP.search(word) and words[k + 1] == "install":
            return words[k + 2:]
        if word in ("-m",) and words[k + 1] == "pip" and k + 2 < len(words) and words[k + 2] == "install":
            return words[k + 3:]
    return None


def installs_packages(words: list[str]) -> bool:
    """A command that installs Python packages: pip, another installer, the install script or `make install`."""
    head = Path(words[0]).name
    return (pip_install_args(words) is not None
            or head in {"conda", "mamba", "micromamba", "easy_install", "pipx", "poetry", "uv", "pdm"}
            or any(w.endswith("setup.py") for w in words)
            or head == Path(INSTALL_SCRIPT).name
            or (head == "make" and "install" in words[1:]))


def install_commands(dockerfile: Path) -> list[tuple[int, list[str]]]:
    """(line, words) of every RUN command in the Dockerfile that installs Python packages."""
    return [(i.line, words) for i in instructions(dockerfile) if i.name == "RUN"
            for words in shell_commands(_run_text(i.value)) if installs_packages(words)]


def _run_text(value: str) -> str:
    if value.lstrip().startswith("["):
        try:
            return shlex.join(json.loads(value))
        except ValueError:
            pass
    return value


def _pip_problem(args: list[str], pins: dict[str, str], text: str) -> str | None:
    """Why this pip install does not take its versions from requirements.lock (None when it does)."""
    constraints, requirement_files, targets = [], [], []
    words = iter(args)
    for word in words:
        if word in PIP_VALUE_OPTIONS:
            value = next(words, "")
            if word in ("-c", "--constraint"):
                constraints.append(value)
            elif word in ("-r", "--requirement"):
                requirement_files.append(value)
            elif word in ("-e", "--editable"):
                targets.append(value)
            elif word in ("-i", "--index-url", "--extra-index-url", "-f", "--find-links"):
                return f"installs from another index ({word} {value})"
        elif word.startswith("--") and "=" in word:
            option, value = word.split("=", 1)
            if option == "--constraint":
                constraints.append(value)
            elif option == "--requirement":
                requirement_files.append(value)
        elif not word.startswith("-"):
            targets.append(word)
    locked = any(Path(f).name == LOCK for f in constraints + requirement_files)
    if requirement_files and not locked:
        return f"-r {requirement_files[0]} without -c {LOCK}"
    for target in targets:
        if target == "." or target.startswith(("./", "/", "..")):
            if not locked:
                return f"installs {target} without -c {LOCK}: its dependencies would float"
            continue
        variable = re.fullmatch(r"([A-Za-z0-9_.-]+)==\$\{?(\w+)\}?", target)
        if variable:
            name, var = variable.groups()
            if not re.search(rf"\b{var}=\$\([^)]*{re.escape(LOCK)}", text):
                return f"{target}: ${var} is not read from {LOCK}"
            if canonicalize_name(name) not in pins:
                return f"{name} is not pinned in {LOCK}"
            continue
        try:
            req = Requirement(target)
        except InvalidRequirement:
            return f"{target}: not a requirement taken from {LOCK}"
        if req.url:
            return f"{target}: installs from a URL, not from {LOCK}"
        if req.specifier:
            return f"{target}: a version written here, not taken from {LOCK}"
        if not locked:
            return f"{target} is not constrained: install it with -c {LOCK}"
        if canonicalize_name(req.name) not in pins:
            return f"{req.name} is not pinned in {LOCK}"
    return None


def _apt_python_packages(words: list[str]) -> list[str]:
    if Path(words[0]).name not in ("apt-get", "apt") or "install" not in words:
        return []
    return [w for w in words if re.fullmatch(r"python3?-[a-z0-9][\w.-]*", w)]


def check(dockerfile: Path = ROOT / "Dockerfile", context: Path = ROOT) -> list[Violation]:
    """Every violation of RULES in `dockerfile`, built from `context` (where its scripts and the lock are)."""
    instrs = instructions(dockerfile)
    name = dockerfile.name
    pins = lock_pins(context)
    found: list[Violation] = []

    def flag(rule, line, message, file=name):
        found.append(Violation(rule, file, line, message))

    # base-digest
    global_args = {}
    for i in instrs:
        if i.name == "FROM":
            break
        if i.name == "ARG":
            global_args.update((k, v or "") for k, v in key_values(i.value))
    stages = set()
    for i in instrs:
        if i.name != "FROM":
            continue
        words = [w for w in i.value.split() if not w.startswith("--")]
        image = re.sub(r"\$\{?(\w+)\}?", lambda m: global_args.get(m.group(1), m.group(0)), words[0])
        earlier = set(stages)
        if len(words) >= 3 and words[1].lower() == "as":
            stages.add(words[2].lower())
        if image == "scratch" or image.lower() in earlier:  # an earlier stage, pinned where it was built
            continue
        pinned = DIGEST.fullmatch(image)
        if not pinned:
            flag("base-digest", i.line, f"base image {image} is not pinned by digest (FROM image:tag@sha256:...)")
        elif not pinned.group("tag"):
            flag("base-digest", i.line, f"base image {image} has a digest but no tag: name the tag it belongs to")

    # pip-lock: the Dockerfile's RUNs, then the scripts and Makefile recipes they run
    dockerfile_text = dockerfile.read_text()
    sources: list[tuple[str, int, list[str], str]] = []
    scanned: set[Path] = set()
    for i in instrs:
        if i.name != "RUN":
            continue
        for words in shell_commands(_run_text(i.value)):
            sources.append((name, i.line, words, dockerfile_text))
            called = [context / w for w in words if w.endswith(".sh")]
            if Path(words[0]).name == "make":
                called.append(context / "Makefile")
            for path in called:
                if path.is_file() and path not in scanned:
                    scanned.add(path)
                    text = path.read_text()
                    sources += [(str(path.relative_to(context)), line, w, text) for line, w in script_commands(path)]
                    # the Makefile's recipes run scripts too
                    for _, w in script_commands(path):
                        for word in w:
                            inner = context / word
                            if word.endswith(".sh") and inner.is_file() and inner not in scanned:
                                scanned.add(inner)
                                sources += [(str(inner.relative_to(context)), line, ww, inner.read_text())
                                            for line, ww in script_commands(inner)]
    for file, line, words, text in sources:
        args = pip_install_args(words)
        problem = _pip_problem(args, pins, text) if args is not None else None
        apt = _apt_python_packages(words)
        if apt:
            problem = f"apt installs Python packages ({', '.join(apt)}): they come from {LOCK}"
        if problem:
            flag("pip-lock", line, f"{shlex.join(words)}: {problem}", file)

    final = final_stage(instrs)
    # non-root
    users = [i for i in final if i.name == "USER"]
    if not users:
        flag("non-root", final[0].line if final else 1, "no USER: the image runs as root")
    elif users[-1].value.split(":")[0].strip() in ("root", "0"):
        flag("non-root", users[-1].line, f"USER {users[-1].value}: the image runs as root")

    # secrets
    for i in instrs:
        problem = None
        if i.name in ("ENV", "ARG"):
            for key, value in key_values(i.value):
                if SECRET_NAME.search(key) and (value or i.name == "ARG"):
                    problem = (f"{i.name} {key} holds a value" if value else f"ARG {key}: build arguments stay in "
                               "the image history") + "; pass credentials at run time (docker run -e NAME)"
                    break
        if problem is None and ".netrc" in i.value:
            problem = ".netrc in the image: pass credentials at run time (docker run -e NAME)"
        if problem is None and i.name == "RUN":
            assigned = [w for words in shell_commands(_run_text(i.value)) for w in words
                        if re.fullmatch(r"\w+=[^$].*", w) and SECRET_NAME.search(w.split("=")[0])]
            if assigned:
                problem = f"{assigned[0].split('=')[0]} set to a value at build time"
            elif LOGIN.search(i.value):
                problem = "logs in at build time: the credentials would stay in a layer"
        if problem is None and SECRET_LITERAL.search(i.value):
            problem = "a literal access token"
        if problem:
            flag("secrets", i.line, problem)

    envs = {}
    env_lines = {}
    for i in final:
        if i.name == "ENV":
            for key, value in key_values(i.value):
                envs[key] = value or ""
                env_lines[key] = i.line
    stage_line = final[0].line if final else 1  # where a missing instruction is reported
    # telemetry
    if envs.get("HF_HUB_DISABLE_TELEMETRY", "").lower() not in TRUE:
        flag("telemetry", env_lines.get("HF_HUB_DISABLE_TELEMETRY", stage_line),
             "ENV HF_HUB_DISABLE_TELEMETRY=1 is not set")
    # wandb-mode
    if "WANDB_MODE" in envs:
        flag("wandb-mode", env_lines["WANDB_MODE"], f"ENV WANDB_MODE={envs['WANDB_MODE']} is fixed: rlhf/tracking.py "
             "logs offline by itself and online only when WANDB_MODE is unset and WANDB_API_KEY is passed")

    # volumes
    volumes, volume_line = set(), stage_line
    workdir = "/"
    for i in final:
        if i.name == "WORKDIR":
            workdir = i.value if i.value.startswith("/") else f"{workdir.rstrip('/')}/{i.value}"
        if i.name == "VOLUME":
            volume_line = i.line
            value = i.value.strip()
            volumes.update(json.loads(value) if value.startswith("[") else value.split())
    volumes = {v.rstrip("/") for v in volumes}
    hf_home = envs.get("HF_HOME")
    if not hf_home:
        flag("volumes", volume_line, "no ENV HF_HOME: the Hugging Face cache has no fixed place to mount")
    elif hf_home.rstrip("/") not in volumes:
        flag("volumes", volume_line, f"the Hugging Face cache HF_HOME={hf_home} is not a VOLUME")
    results = f"{workdir.rstrip('/')}/results"
    if results not in volumes:
        flag("volumes", volume_line, f"{results} is not a VOLUME")

    # entrypoint
    entrypoints = [i for i in final if i.name == "ENTRYPOINT"]
    if not entrypoints:
        flag("entrypoint", stage_line, 'no ENTRYPOINT ["make"]')
    else:
        try:
            form = json.loads(entrypoints[-1].value)
        except ValueError:
            form = None
        if form != ["make"]:
            flag("entrypoint", entrypoints[-1].line, f'ENTRYPOINT {entrypoints[-1].value}: want ["make"] (exec form)')

    return sorted(found, key=lambda v: (v.file != name, v.file, v.line, v.rule))


def build_arg(dockerfile: Path, name: str) -> str | None:
    """The default of a build argument (ARG NAME=default), None when there is none."""
    for i in instructions(dockerfile):
        if i.name == "ARG":
            for key, value in key_values(i.value):
                if key == name:
                    return value
    return None


def image_env(dockerfile: Path) -> dict[str, str]:
    """The ENV of the final stage, as DockerfileParser resolves it."""
    return dict(DockerfileParser(path=str(dockerfile), cache_content=True).envs)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    dockerfile = Path(args[0] if args else ROOT / "Dockerfile").resolve()
    violations = check(dockerfile, ROOT)
    for v in violations:
        print(v)
    if violations:
        return 1
    print(f"{dockerfile.name}: {len(RULES)} rules pass ({', '.join(RULES)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
