"""The GPU image's versions agree in the three places they are written: the Dockerfile's ARG pins (and the
image it builds FROM and the pip pins that use them), pyproject.toml's dependencies and extras, and README's
"GPU image versions" table. The image itself is not built here (no Docker daemon, no GPU)."""
from __future__ import annotations

import re
import tomllib

import pytest
from packaging.requirements import Requirement

from tests.conftest import REPO

# README table row -> the Dockerfile ARG that pins it
README_ROWS = {"TensorRT-LLM": "TENSORRT_LLM_VERSION", "NGC PyTorch": "BASE_NGC_PYTORCH", "torch": "BASE_TORCH",
               "CUDA": "BASE_CUDA", "Python": "BASE_PYTHON", "Transformer Engine": "TRANSFORMER_ENGINE_SPEC",
               "megatron-core": "MEGATRON_CORE_VERSION", "nvidia-pytriton": "PYTRITON_VERSION",
               "nvidia-modelopt": "MODELOPT_VERSION"}
UNPINNED_ROWS = {"NCCL", "apex"}  # what the base provides as it is, or what the image does not use


def dockerfile_args(text: str) -> dict[str, str]:
    args = {}
    for name, value in re.findall(r"^ARG (\w+)=(.*)$", text, re.M):
        value = value.strip().strip('"')
        assert args.setdefault(name, value) == value, f"ARG {name} has two defaults"
    return args


def expand(text: str, args: dict[str, str]) -> str:
    return re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], text)


def readme_versions(text: str) -> dict[str, str]:
    """The `| component | version | why |` rows of the table under the "GPU image versions" heading."""
    section = re.search(r"^#+ GPU image versions\n(.*?)(?=^#+ |\Z)", text, re.M | re.S)
    assert section, "README has no 'GPU image versions' section"
    rows = {}
    for line in section.group(1).splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")] if line.startswith("|") else []
        if len(cells) >= 2 and cells[0] not in ("component", "") and not set(cells[0]) <= set("-: "):
            rows[cells[0]] = cells[1].strip("`")
    return rows


@pytest.fixture(scope="module")
def sources():
    dockerfile = (REPO / "Dockerfile").read_text()
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    requirements = {}
    for group, reqs in [("dependencies", project["dependencies"]), *project["optional-dependencies"].items()]:
        for req in map(Requirement, reqs):
            requirements[(group, req.name)] = req
    return dockerfile, dockerfile_args(dockerfile), requirements, readme_versions((REPO / "README.md").read_text())


def test_dockerfile_pins_agree_with_pyproject(sources):
    dockerfile, args, reqs, _ = sources
    exact = {("trtllm", "tensorrt-llm"): "TENSORRT_LLM_VERSION", ("serve", "nvidia-pytriton"): "PYTRITON_VERSION",
             ("test", "nvidia-pytriton"): "PYTRITON_VERSION", ("modelopt", "nvidia-modelopt"): "MODELOPT_VERSION"}
    for key, arg in exact.items():
        assert str(reqs[key].specifier) == f"=={args[arg]}", (key, reqs[key], arg, args[arg])
    assert args["MEGATRON_CORE_VERSION"] in reqs[("dependencies", "megatron-core")].specifier
    te = reqs[("te", "transformer-engine")].specifier
    assert te == type(te)(args["TRANSFORMER_ENGINE_SPEC"]), (te, args["TRANSFORMER_ENGINE_SPEC"])
    assert reqs[("test", "aligner")].extras == {"modelopt"}  # CI installs the modelopt extra with the tests


def test_dockerfile_uses_its_pins(sources):
    dockerfile, args, _, _ = sources
    base = re.findall(r"^FROM (\S+)", dockerfile, re.M)
    assert [expand(b, args) for b in base] == [f"nvcr.io/nvidia/tensorrt-llm/release:{args['TENSORRT_LLM_VERSION']}"]
    pip_pins = dict(re.findall(r'"([\w-]+)==\$\{(\w+)\}"', dockerfile))
    assert pip_pins == {"megatron-core": "MEGATRON_CORE_VERSION", "nvidia-pytriton": "PYTRITON_VERSION",
                        "nvidia-modelopt": "MODELOPT_VERSION"}
    for arg in ("TENSORRT_LLM_VERSION", "BASE_TORCH", "BASE_CUDA", "BASE_PYTHON", "TRANSFORMER_ENGINE_SPEC"):
        assert f'"${arg}"' in dockerfile, f"the base check does not use {arg}"
    steps = re.findall(r"^(RUN|COPY|ADD|ENV|WORKDIR|FROM|ARG)\b.*$", dockerfile, re.M)
    assert steps[-1] == "RUN" and dockerfile.rstrip().endswith("RUN aligner doctor")
    assert not re.search(r"\bpatch\b|git apply|sed -i", dockerfile)  # no patches to third-party source


def test_readme_table_agrees_with_dockerfile(sources):
    _, args, _, readme = sources
    assert set(README_ROWS) <= set(readme), f"README's table lacks {sorted(set(README_ROWS) - set(readme))}"
    assert set(readme) <= set(README_ROWS) | UNPINNED_ROWS, f"unchecked rows {set(readme) - set(README_ROWS)}"
    for row, arg in README_ROWS.items():
        assert readme[row] == args[arg], (row, readme[row], arg, args[arg])
