"""deploy/kubernetes and the Dockerfile, checked without a cluster, a registry or the network.

Every manifest validates against the Kubernetes OpenAPI schemas that `kubernetes-validate` ships
(strict: unknown fields are errors), for the oldest Kubernetes the manifests target and the
newest the package knows. The ServiceMonitor (a Prometheus Operator CRD) and the Kustomization
(kustomize's own file) are not in those schemas: they are validated against the structural
schemas below, written from the CRD's and kustomize's required fields. Beyond the schemas, the
manifests are checked against Shoal itself: SHOAL_* variables are parsed by `shoal serve`'s own
parser, probe paths are requested from the real app, HPA metrics are read from its /metrics.
The image cannot be built here; its Dockerfile is checked against the repository, the
.dockerignore and the install steps of scripts/setup.sh / pyproject.toml.
"""

from __future__ import annotations

import argparse
import copy
import fnmatch
import json
import os
import re
import tomllib
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml
from fastapi.testclient import TestClient
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from prometheus_client.parser import text_string_to_metric_families
from server_fakes import ToneEngine

from shoal.server import cli
from shoal.server.app import create_app
from shoal.server.settings import ServerSettings
from shoal.server.store import Store
from shoal.tuning import ENV_PREFIX

ROOT = Path(__file__).resolve().parent.parent
MANIFESTS = ROOT / "deploy" / "kubernetes"
DOCKERFILE = ROOT / "Dockerfile"
KUBERNETES_VERSIONS = ("1.30", kubernetes_validate.latest_version())  # PDB/HPA v2 fields need 1.30
# Kinds outside the Kubernetes schemas, validated structurally instead (the schemas below).
NOT_IN_KUBERNETES_SCHEMAS = {
    ("monitoring.coreos.com/v1", "ServiceMonitor"): "a Prometheus Operator CRD: SERVICE_MONITOR_SCHEMA",
}
# Environment variables of the serving container that are not `shoal serve` options.
OTHER_ENVIRONMENT = {
    "HF_HUB_OFFLINE": "huggingface_hub: never download; the checkpoint is on a volume",
    "AWS_ACCESS_KEY_ID": "boto3: the blob bucket's credentials",
    "AWS_SECRET_ACCESS_KEY": "boto3: the blob bucket's credentials",
    "AWS_REGION": "boto3: the bucket's region",
    "AWS_ENDPOINT_URL_S3": "boto3: an S3-compatible server other than AWS",
}
# SHOAL_* names that are not SHOAL_ + the option's dest in upper case.
ENVIRONMENT_DESTS = {"QUEUE_LIMITS": "queue_limit"}
DURATION = r"^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$"
LABEL_SELECTOR = {
    "type": "object",
    "properties": {
        "matchLabels": {"type": "object", "additionalProperties": {"type": "string"}},
        "matchExpressions": {"type": "array", "items": {"type": "object", "required": ["key", "operator"]}},
    },
    "additionalProperties": False,
}
# monitoring.coreos.com/v1 ServiceMonitor: the CRD's required fields and the types of those used.
SERVICE_MONITOR_SCHEMA = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "kind": {"const": "ServiceMonitor"},
        "metadata": {"type": "object", "required": ["name"]},
        "spec": {
            "type": "object",
            "required": ["selector"],
            "properties": {
                "selector": LABEL_SELECTOR,
                "jobLabel": {"type": "string"},
                "namespaceSelector": {"type": "object"},
                "endpoints": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "properties": {
                            "port": {"type": "string"},
                            "targetPort": {"type": ["string", "integer"]},
                            "path": {"type": "string", "pattern": "^/"},
                            "scheme": {"enum": ["http", "https", "HTTP", "HTTPS"]},
                            "interval": {"type": "string", "pattern": DURATION},
                            "scrapeTimeout": {"type": "string", "pattern": DURATION},
                            "honorLabels": {"type": "boolean"},
                        },
                        "additionalProperties": False,
                        "anyOf": [{"required": ["port"]}, {"required": ["targetPort"]}],
                    },
                },
            },
        },
    },
}
KUSTOMIZATION_SCHEMA = {
    "type": "object",
    "required": ["apiVersion", "kind", "resources"],
    "properties": {
        "apiVersion": {"const": "kustomize.config.k8s.io/v1beta1"},
        "kind": {"const": "Kustomization"},
        "namespace": {"type": "string"},
        "resources": {"type": "array", "items": {"type": "string"}, "uniqueItems": True},
        "images": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["name"],
                "properties": {k: {"type": "string"} for k in ("name", "newName", "newTag", "digest")},
                "additionalProperties": False,
            },
        },
    },
    "additionalProperties": False,
}


def load_documents(path: Path) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


@pytest.fixture(scope="module")
def kustomization() -> dict:
    return yaml.safe_load((MANIFESTS / "kustomization.yaml").read_text())


@pytest.fixture(scope="module")
def resources(kustomization) -> list[dict]:
    return [doc for name in kustomization["resources"] for doc in load_documents(MANIFESTS / name)]


def one(resources: list[dict], kind: str) -> dict:
    found = [doc for doc in resources if doc["kind"] == kind]
    assert len(found) == 1, f"expected one {kind}, found {len(found)}"
    return found[0]


def by_name(resources: list[dict], kind: str) -> dict[str, dict]:
    return {doc["metadata"]["name"]: doc for doc in resources if doc["kind"] == kind}


@pytest.fixture(scope="module")
def container(resources) -> dict:
    containers = one(resources, "Deployment")["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    return containers[0]


@pytest.fixture(scope="module")
def app_client(tmp_path_factory):
    """The real app with keys on, over a test double of the engine (server_fakes.ToneEngine)."""
    engine = ToneEngine()
    store = Store.in_directory(tmp_path_factory.mktemp("deploy-data"))
    with TestClient(create_app(engine, store, ServerSettings())) as client:
        yield client, engine


# The manifests as files -------------------------------------------------------------------------


def test_kustomization_lists_exactly_the_manifests(kustomization) -> None:
    jsonschema.validate(kustomization, KUSTOMIZATION_SCHEMA)
    listed = kustomization["resources"]
    on_disk = sorted(path.name for path in MANIFESTS.iterdir() if path.name != "kustomization.yaml")
    assert sorted(listed) == on_disk, "every file in deploy/kubernetes listed, and nothing else"
    assert all(name.endswith(".yaml") for name in on_disk)


def test_manifests_validate_against_the_kubernetes_schemas(resources) -> None:
    validated = skipped = 0
    for doc in resources:
        if (doc["apiVersion"], doc["kind"]) in NOT_IN_KUBERNETES_SCHEMAS:
            skipped += 1
            continue
        for version in KUBERNETES_VERSIONS:
            kubernetes_validate.validate(doc, version, strict=True)
        validated += 1
    assert validated >= 10 and skipped == 1


def test_the_validator_rejects_what_kubernetes_would(resources) -> None:
    """The schemas are real and strict: a misspelled field and a wrong type both fail."""
    deployment = copy.deepcopy(one(resources, "Deployment"))
    deployment["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGett"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBERNETES_VERSIONS[0], strict=True)
    hpa = copy.deepcopy(one(resources, "HorizontalPodAutoscaler"))
    hpa["spec"]["maxReplicas"] = "eight"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(hpa, KUBERNETES_VERSIONS[0], strict=True)
    with pytest.raises(kubernetes_validate.SchemaNotFoundError):  # CRDs really are not in there
        kubernetes_validate.validate(one(resources, "ServiceMonitor"), KUBERNETES_VERSIONS[0], strict=True)


def test_service_monitor_matches_its_crd_and_scrapes_the_service(resources) -> None:
    monitor = one(resources, "ServiceMonitor")
    jsonschema.validate(monitor, SERVICE_MONITOR_SCHEMA)
    service = one(resources, "Service")
    labels = service["metadata"]["labels"]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= labels.items()
    port_names = {port["name"] for port in service["spec"]["ports"]}
    for endpoint in monitor["spec"]["endpoints"]:
        assert endpoint["port"] in port_names
        assert endpoint["path"] == "/metrics"


# The Deployment against `shoal serve` ----------------------------------------------------------


def container_environment(resources, container) -> dict[str, str | None]:
    """The container's variables: its ConfigMaps' data, then `env` (a Secret's value, else None)."""
    config_maps, secrets = by_name(resources, "ConfigMap"), by_name(resources, "Secret")
    variables: dict[str, str | None] = {}
    for source in container.get("envFrom", []):
        variables.update(config_maps[source["configMapRef"]["name"]]["data"])
    for item in container.get("env", []):
        if "value" in item:
            variables[item["name"]] = item["value"]
        else:
            ref = item["valueFrom"]["secretKeyRef"]
            variables[item["name"]] = secrets[ref["name"]]["stringData"][ref["key"]]
    return variables


def parse_serve_options(
    monkeypatch, variables: dict[str, str], checkpoint: bool
) -> tuple[argparse.Namespace, set[str]]:
    """`shoal serve`'s options as its parser reads them from exactly these SHOAL_* variables
    (`checkpoint`: pass --checkpoint, which the image leaves to the deployment)."""
    for name in list(os.environ):
        if name.startswith(ENV_PREFIX):
            monkeypatch.delenv(name)
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    dests = {action.dest for action in parser._actions if action.dest != "help"}
    return parser.parse_args(["--checkpoint", "/models/x"] if checkpoint else []), dests


def check_serve_variables(monkeypatch, variables: dict[str, str | None]) -> None:
    shoal_variables = {k: v for k, v in variables.items() if k.startswith(ENV_PREFIX)}
    unknown = set(variables) - set(shoal_variables) - set(OTHER_ENVIRONMENT)
    assert not unknown, f"not `shoal serve` options: {sorted(unknown)}"
    args, dests = parse_serve_options(
        monkeypatch, shoal_variables, checkpoint="SHOAL_CHECKPOINT" not in variables
    )
    for name, value in shoal_variables.items():
        option = name.removeprefix(ENV_PREFIX)
        dest = ENVIRONMENT_DESTS.get(option, option.lower())
        assert dest in dests, f"{name}: `shoal serve` has no option --{dest.replace('_', '-')}"
        parsed = getattr(args, dest)
        if isinstance(parsed, bool):
            expected = value.strip().lower() in ("1", "true", "yes", "on")
        elif isinstance(parsed, (int, float, str, Path)):
            expected = type(parsed)(value)
        else:
            continue
        assert parsed == expected, f"{name}={value!r} reached `shoal serve` as {parsed!r}"


def test_container_environment_names_only_serve_options(resources, container, monkeypatch) -> None:
    variables = container_environment(resources, container)
    assert set(variables) >= {"SHOAL_CHECKPOINT", "SHOAL_DATA_DIR", "SHOAL_DATABASE_URL", "SHOAL_PORT"}
    assert variables["SHOAL_BLOB_URL"].startswith("s3://")  # pods share the database and a bucket
    assert all(isinstance(value, str) for value in variables.values())  # YAML's `on` is not "on"
    check_serve_variables(monkeypatch, variables)


def test_an_unknown_variable_is_caught(resources, container, monkeypatch) -> None:
    variables = {**container_environment(resources, container), "SHOAL_MAX_STREAMS": "4"}
    with pytest.raises(AssertionError, match="no option --max-streams"):
        check_serve_variables(monkeypatch, variables)


def test_volumes_checkpoint_data_and_gpu(resources, container) -> None:
    variables = container_environment(resources, container)
    pod = one(resources, "Deployment")["spec"]["template"]["spec"]
    claims = by_name(resources, "PersistentVolumeClaim")
    volumes = {volume["name"]: volume for volume in pod["volumes"]}
    mounts = {mount["mountPath"]: mount for mount in container["volumeMounts"]}
    for volume in volumes.values():
        if "persistentVolumeClaim" in volume:
            assert volume["persistentVolumeClaim"]["claimName"] in claims
    checkpoint_mount = next(m for p, m in mounts.items() if variables["SHOAL_CHECKPOINT"].startswith(p + "/"))
    checkpoint_volume = volumes[checkpoint_mount["name"]]["persistentVolumeClaim"]
    assert checkpoint_mount["readOnly"] is True and checkpoint_volume["readOnly"] is True
    assert claims[checkpoint_volume["claimName"]]["spec"]["accessModes"] == ["ReadOnlyMany"]
    # The pod keeps nothing: its data directory holds only the blob cache, on an emptyDir.
    data_mount = mounts[variables["SHOAL_DATA_DIR"]]
    assert not data_mount.get("readOnly") and "emptyDir" in volumes[data_mount["name"]]
    assert variables["HF_HUB_OFFLINE"] == "1"
    for kind in ("requests", "limits"):
        assert container["resources"][kind]["nvidia.com/gpu"] == 1
    assert pod["securityContext"]["runAsNonRoot"] is True


def test_priority_classes(resources) -> None:
    classes = by_name(resources, "PriorityClass")
    serving, batch = classes["shoal-serving"], classes["shoal-batch"]
    assert one(resources, "Deployment")["spec"]["template"]["spec"]["priorityClassName"] == "shoal-serving"
    assert serving["value"] > 0 > batch["value"], "bulk work is the lowest, below the default 0"
    assert batch["preemptionPolicy"] == "Never" and not batch["globalDefault"]


def test_service_pdb_and_hpa_select_the_serving_pods(resources, container) -> None:
    deployment = one(resources, "Deployment")
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    service = one(resources, "Service")
    assert service["spec"]["selector"].items() <= pod_labels.items()
    assert (
        one(resources, "PodDisruptionBudget")["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    )
    target = one(resources, "HorizontalPodAutoscaler")["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("Deployment", deployment["metadata"]["name"])
    ports = container["ports"]
    variables = container_environment(resources, container)
    assert [port["containerPort"] for port in ports] == [int(variables["SHOAL_PORT"])]
    container_ports = {port["name"] for port in ports} | {port["containerPort"] for port in ports}
    for port in service["spec"]["ports"]:
        assert port["targetPort"] in container_ports, "the Service targets the container's port"


def test_probes_are_real_routes_that_mean_engine_ready(resources, container, app_client) -> None:
    client, engine = app_client
    # The app's GET routes, from its OpenAPI document (included routers are not flat in app.routes).
    routes = {path for path, methods in client.app.openapi()["paths"].items() if "get" in methods}
    port_names = {port["name"] for port in container["ports"]} | {
        p["containerPort"] for p in container["ports"]
    }
    probes = {kind: container[kind] for kind in ("startupProbe", "readinessProbe", "livenessProbe")}
    for kind, probe in probes.items():
        path, port = probe["httpGet"]["path"], probe["httpGet"]["port"]
        assert path in routes and port in port_names, kind
        assert client.get(path, headers={}).status_code == 200, f"{kind}: 200 with a ready engine, no key"
    readiness = probes["readinessProbe"]["httpGet"]["path"]
    engine.unavailable = True  # as while the engine process restarts
    try:
        assert client.get(readiness).status_code == 503
    finally:
        engine.unavailable = False
    # /v1/health waits up to HEALTH_STATS_TIMEOUT_SECONDS for the engine; a probe must wait longer.
    from shoal.server.app import HEALTH_STATS_TIMEOUT_SECONDS

    assert all(probe["timeoutSeconds"] > HEALTH_STATS_TIMEOUT_SECONDS for probe in probes.values())


def test_hpa_scales_on_real_shoal_gauges(resources, app_client) -> None:
    client, _ = app_client
    text = client.get("/metrics").text
    gauges = {family.name for family in text_string_to_metric_families(text) if family.type == "gauge"}
    hpa = one(resources, "HorizontalPodAutoscaler")
    names = [metric["pods"]["metric"]["name"] for metric in hpa["spec"]["metrics"]]
    assert all(metric["type"] == "Pods" for metric in hpa["spec"]["metrics"])
    assert "shoal_queue_depth" in names
    assert set(names) <= gauges, f"not gauges Shoal exports: {sorted(set(names) - gauges)}"
    # The Prometheus Adapter rules in hpa.yaml's comments: one per metric, on a real series.
    comment = (MANIFESTS / "hpa.yaml").read_text()
    series = re.findall(r"seriesQuery: '(\w+)\{", comment)
    exposed = re.findall(r"name: \{as: (\w+)\}", comment)
    assert sorted(series) == sorted(exposed) == sorted(names)


# The image -------------------------------------------------------------------------------------


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    logical, pending = [], ""
    for line in DOCKERFILE.read_text().splitlines():
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        pending += stripped.removesuffix("\\").strip() + " "
        if not stripped.endswith("\\"):
            logical.append(pending.strip())
            pending = ""
    return [(text.split(None, 1)[0].upper(), text.split(None, 1)[1]) for text in logical]


def docker_arguments(instructions) -> dict[str, str]:
    arguments = {}
    for name, text in instructions:
        if name == "ARG" and "=" in text:
            key, value = text.split("=", 1)
            arguments[key] = value
    return arguments


def dockerignored(path: str, rules: list[str]) -> bool:
    """Docker's rule: the last pattern matching the path or one of its parent directories wins."""
    parts = path.split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    ignored = False
    for rule in rules:
        negate = rule.startswith("!")
        pattern = rule.removeprefix("!").removeprefix("**/")
        anywhere = rule.removeprefix("!").startswith("**/")
        for prefix in prefixes:
            candidates = [prefix] + ([prefix.rsplit("/", 1)[-1]] if anywhere else [])
            if any(fnmatch.fnmatchcase(candidate, pattern) for candidate in candidates):
                ignored = not negate
                break
    return ignored


def test_dockerfile_copies_exist_and_reach_the_build_context() -> None:
    rules = [
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    copies = [text for name, text in dockerfile_instructions() if name in ("COPY", "ADD")]
    assert copies
    sources = []
    for text in copies:
        words = [word for word in text.split() if not word.startswith("--")]
        sources += words[:-1]
    for source in sources:
        path = ROOT / source
        assert path.exists(), f"COPY {source}: not in the repository"
        files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
        for file in files:
            relative = file.relative_to(ROOT).as_posix()
            if "__pycache__" in relative or relative.endswith(".pyc"):
                assert dockerignored(relative, rules)
            else:
                assert not dockerignored(relative, rules), f"{relative} is left out by .dockerignore"
    assert "pyproject.toml" in sources and "shoal" in sources
    assert dockerignored(".venv/bin/python", rules) and dockerignored(".git/HEAD", rules)
    assert dockerignored("demo/data/shoal.db", rules)


def test_dockerfile_installs_as_the_readme_does() -> None:
    instructions = dockerfile_instructions()
    arguments = docker_arguments(instructions)
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    runs = " ".join(text for name, text in instructions if name == "RUN")
    base = next(text for name, text in instructions if name == "FROM").replace("${CUDA_IMAGE}", "")
    assert base.strip() == "" and arguments["CUDA_IMAGE"].startswith("nvidia/cuda:13.0")
    # Python 3.12 in a venv, as scripts/setup.sh makes one, within requires-python.
    assert "python3.12 -m venv" in runs
    assert "3.12" in SpecifierSet(pyproject["requires-python"])
    assert "pip install --upgrade pip" in runs
    # The GPU machines' torch (CUDA 13.0 wheel) and triton; triton as setup.sh pins it.
    setup = (ROOT / "scripts" / "setup.sh").read_text()
    assert f'"triton=={arguments["TRITON_VERSION"]}"' in setup
    torch = next(Requirement(r) for r in pyproject["dependencies"] if r.startswith("torch"))
    assert arguments["TORCH_VERSION"] in torch.specifier and arguments["TORCH_VERSION"].startswith("2.11")
    assert arguments["TORCH_INDEX"].endswith("/cu130")
    assert '"torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX}"' in runs
    assert '"triton==${TRITON_VERSION}"' in runs
    # `pip install .` of the checkout, with extras that pyproject.toml defines.
    installs = re.findall(r'pip install "?\.(\[[\w,]+\])?"?(?:\s|$)', runs)
    assert len(installs) == 1
    extras = set(filter(None, installs[0].strip("[]").split(",")))
    assert extras <= set(pyproject["optional-dependencies"]) and "postgres" in extras


def test_image_runs_shoal_serve_as_a_non_root_user(resources, container, monkeypatch) -> None:
    instructions = dockerfile_instructions()
    users = [text for name, text in instructions if name == "USER"]
    uid = users[-1].split(":")[0]
    assert uid.isdigit() and int(uid) != 0
    pod = one(resources, "Deployment")["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsUser"] == int(uid)
    entrypoint = json.loads(next(text for name, text in instructions if name == "ENTRYPOINT"))
    command = json.loads(next(text for name, text in instructions if name == "CMD"))
    assert (
        entrypoint[-1] == "shoal"
        and "shoal" in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    )
    assert command == ["serve"] and container["args"] == ["serve"] and "command" not in container
    # The image's own SHOAL_* defaults are serve options too, and its port is the container's.
    image_environment = {}
    for name, text in instructions:
        if name == "ENV":
            image_environment.update(re.findall(r"(\w+)=(\S+)", text))
    shoal_defaults = {k: v for k, v in image_environment.items() if k.startswith(ENV_PREFIX)}
    check_serve_variables(monkeypatch, shoal_defaults)
    exposed = [int(text) for name, text in instructions if name == "EXPOSE"]
    assert exposed == [int(shoal_defaults["SHOAL_PORT"])] == [p["containerPort"] for p in container["ports"]]
