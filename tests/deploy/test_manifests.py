"""The deployment files, checked without a container engine or a cluster.

Three linters, each also shown to reject a broken copy (so a pass means something): hadolint on
deploy/Dockerfile, kubernetes-validate in strict mode on every manifest in deploy/k8s for pinned Kubernetes
versions, and the Compose specification's JSON schema on deploy/compose.yaml. Then what no linter knows:
selectors that find their pods, probes on paths the service serves, one port everywhere, only environment
variables the service reads, secrets only from secret stores, a non-root read-only image, the shipped
deploy/redis.conf in both Redis set-ups (tests/deploy/checks.py). Every such check runs on the real files and
on a copy broken on purpose, which it must reject. The HEALTHCHECK command is run against a real server.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from aiohttp import web
from caller_memory.service.app import create_app
from caller_memory.service.config import Settings

from tests.deploy.checks import (
    SERVICE_PORT,
    check_command,
    check_compose_redis,
    check_environment,
    check_images,
    check_kubernetes_redis,
    check_non_root,
    check_ports,
    check_probes,
    check_replicas,
    check_resources,
    check_secrets,
    check_selectors,
    check_store,
    check_workload_selectors,
)
from tests.deploy.manifests import (
    DEPLOY,
    K8S,
    K8S_VERSIONS,
    ROOT,
    Deploy,
    compose_errors,
    dockerfile_instructions,
    dockerignore_rules,
    exec_form,
    final_stage,
    hadolint,
    k8s_error,
    load,
    load_yaml_documents,
    module,
    sent_to_builder,
)

# -- hadolint -------------------------------------------------------------------------------------------------


def test_the_dockerfile_passes_hadolint(tmp_path: Path) -> None:
    assert hadolint(DEPLOY / "Dockerfile", tmp_path) == []


def test_hadolint_rejects_a_broken_copy_of_the_dockerfile(tmp_path: Path) -> None:
    broken = (DEPLOY / "Dockerfile").read_text()
    for found, replacement in (
        ("python:3.11.15-slim-bookworm AS build", "python:latest AS build"),
        ("USER 10001:10001", "USER root"),
        ("RUN python -m venv", "RUN cd /src && pip install requests && python -m venv"),
    ):
        assert found in broken
        broken = broken.replace(found, replacement)
    (tmp_path / "Dockerfile").write_text(broken)
    codes = {finding["code"] for finding in hadolint(tmp_path / "Dockerfile", tmp_path)}
    # latest tag, root user, cd instead of WORKDIR, unpinned pip package
    assert {"DL3007", "DL3002", "DL3003", "DL3013"} <= codes


# -- kubernetes-validate ---------------------------------------------------------------------------------------


MANIFESTS = sorted(K8S.rglob("*.yaml"))


def test_deploy_k8s_holds_the_expected_objects_and_nothing_unchecked() -> None:
    # `kubectl apply -f deploy/k8s/` also applies .yml and .json files, which the validation below would miss.
    assert sorted(p.name for p in K8S.rglob("*") if p.is_file() and p.suffix != ".yaml") == []
    assert set(load().k8s) == {
        ("Deployment", "caller-memory"),
        ("Service", "caller-memory"),
        ("PodDisruptionBudget", "caller-memory"),
        ("HorizontalPodAutoscaler", "caller-memory"),
        ("ConfigMap", "caller-memory-redis-config"),
        ("StatefulSet", "caller-memory-redis"),
        ("Service", "caller-memory-redis"),
        ("Service", "caller-memory-redis-headless"),
        ("NetworkPolicy", "caller-memory-redis"),
    }


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("manifest", MANIFESTS, ids=[p.name for p in MANIFESTS])
def test_a_kubernetes_manifest_is_valid_in_strict_mode(manifest: Path, version: str) -> None:
    documents = load_yaml_documents(manifest)
    assert documents, f"{manifest} holds no object"
    assert [k8s_error(doc, version) for doc in documents] == [None] * len(documents)


@pytest.mark.parametrize(
    ("breakage", "expected"),
    [
        ("readinessProbe:", "Additional properties are not allowed ('readinesProbe' was unexpected)"),
        ("replicas: 2", "'2' is not of type 'integer'"),
        ("apiVersion: apps/v1", "no schema, so not validated"),
    ],
    ids=["misspelt field", "wrong type", "removed API version"],
)
def test_kubernetes_validate_rejects_a_broken_copy(tmp_path: Path, breakage: str, expected: str) -> None:
    replacement = {
        "readinessProbe:": "readinesProbe:",
        "replicas: 2": 'replicas: "2"',
        "apiVersion: apps/v1": "apiVersion: apps/v1beta1",
    }[breakage]
    text = (K8S / "api-deployment.yaml").read_text()
    assert breakage in text
    (tmp_path / "deployment.yaml").write_text(text.replace(breakage, replacement))
    [doc] = load_yaml_documents(tmp_path / "deployment.yaml")
    for version in K8S_VERSIONS:
        error = k8s_error(doc, version)
        assert error is not None and expected in error, error


def test_strict_mode_is_what_catches_a_misspelt_field() -> None:
    kubernetes_validate = module("kubernetes_validate", "kubernetes-validate")
    doc = load().obj("Deployment", "caller-memory")
    container = doc["spec"]["template"]["spec"]["containers"][0]
    container["readinesProbe"] = container.pop("readinessProbe")
    kubernetes_validate.validate(doc, K8S_VERSIONS[0], strict=False)  # the lax mode lets it through
    assert k8s_error(doc, K8S_VERSIONS[0]) is not None


# -- the Compose specification ---------------------------------------------------------------------------------


def test_the_compose_file_follows_the_compose_specification() -> None:
    assert compose_errors(load().compose) == []


def test_the_compose_schema_rejects_a_broken_copy(tmp_path: Path) -> None:
    text = (DEPLOY / "compose.yaml").read_text()
    broken = text.replace("  depends_on:", "  depend_on:").replace("start_period: 60s", "start_period: [60]")
    assert broken != text and "depend_on" in broken and "[60]" in broken
    (tmp_path / "compose.yaml").write_text(broken)
    errors = "\n".join(compose_errors(yaml.safe_load((tmp_path / "compose.yaml").read_text())))
    assert "'depend_on' was unexpected" in errors
    assert "services.redis.healthcheck.start_period" in errors


# -- .dockerignore ---------------------------------------------------------------------------------------------


NEVER_SENT = [
    ".venv/bin/python",
    ".git/config",
    ".dev-secrets",
    "deploy/.env",
    "caller-memory.db",
    "caller-memory.db-wal",
    "service/leftover.db",
    "sdk/.env",
    "service/__pycache__/app.cpython-311.pyc",
    "tests/test_cli.py",
    "test-artifacts/report.txt",
    "bench/results/perf.json",
    ".pytest_cache/v/cache/lastfailed",
    "caller_memory.egg-info/PKG-INFO",
]


def context_problems(dockerignore: str) -> list[str]:
    rules = dockerignore_rules(dockerignore)
    needed = ["pyproject.toml", "hatch_build.py", "README.md", "LICENSE"] + [
        p.relative_to(ROOT).as_posix()
        for folder in ("service", "sdk")
        for p in (ROOT / folder).rglob("*")
        if p.is_file() and "__pycache__" not in p.parts
    ]
    problems = [
        f"{path} is left out of the build context" for path in needed if not sent_to_builder(path, rules)
    ]
    problems += [f"{path} is sent to the builder" for path in NEVER_SENT if sent_to_builder(path, rules)]
    for keyword, arguments in dockerfile_instructions((DEPLOY / "Dockerfile").read_text()):
        if keyword == "COPY" and not arguments.startswith("--from"):
            for source in arguments.split()[:-1]:
                if not any(path == source.rstrip("/") or path.startswith(source) for path in needed):
                    problems.append(f"COPY {source}: not in the build context")
    return problems


def test_the_build_context_holds_what_the_image_needs_and_no_secret_or_local_state() -> None:
    assert context_problems((ROOT / ".dockerignore").read_text()) == []


def test_the_build_context_check_catches_a_leaky_dockerignore() -> None:
    text = (ROOT / ".dockerignore").read_text()
    assert "\n*\n" in text and "\n**/.env\n" in text
    deny_list = context_problems(text.replace("\n*\n", "\n.git\n.venv\n"))
    assert "tests/test_cli.py is sent to the builder" in deny_list
    assert "sdk/.env is sent to the builder" in context_problems(text.replace("\n**/.env\n", "\n"))
    assert "service/app.py is left out of the build context" in context_problems(text + "service/\n")


# -- the HEALTHCHECK, run for real -----------------------------------------------------------------------------


async def run_healthcheck(port: int) -> int:
    """The image's HEALTHCHECK command against ``port``, with Python's standard library only (-S: no site)."""
    [health] = [a for k, a in final_stage(load().dockerfile) if k == "HEALTHCHECK"]
    command = exec_form(health)
    assert command[:2] == ["python", "-c"], command
    code = command[2].replace(f"127.0.0.1:{SERVICE_PORT}/", f"127.0.0.1:{port}/")
    assert code != command[2]
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-I", "-S", "-c", code, stderr=asyncio.subprocess.PIPE
    )
    await asyncio.wait_for(process.communicate(), timeout=10)
    assert process.returncode is not None
    return process.returncode


async def test_the_healthcheck_command_passes_on_a_live_service_and_fails_without_one(tmp_path: Path) -> None:
    settings = Settings(
        pseudonym_key=b"k" * 32, store_url=f"sqlite:///{tmp_path}/memory.db", sweep_interval=0
    )
    runner = web.AppRunner(create_app(settings))
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        assert await run_healthcheck(port) == 0
    finally:
        await runner.cleanup()
    assert await run_healthcheck(port) == 1


# -- consistency checks (checks.py), each also on a broken copy -----------------------------------------------


def put(document: Any, path: str, value: Any) -> None:
    """Set the field at a dotted path (numbers index lists) in a parsed manifest."""
    *parents, last = [int(part) if part.isdigit() else part for part in path.split(".")]
    for part in parents:
        document = document[part]
    document[last] = value


def set_instruction(d: Deploy, keyword: str, arguments: str) -> None:
    """Replace the last ``keyword`` instruction of the Dockerfile."""
    index = max(i for i, (k, _) in enumerate(d.dockerfile) if k == keyword)
    d.dockerfile[index] = (keyword, arguments)


Breakage = Callable[[Deploy], Any]

CHECKS: dict[Callable[[Deploy], list[str]], dict[str, Breakage]] = {
    check_workload_selectors: {
        "template loses a label": lambda d: d.obj("Deployment", "caller-memory")["spec"]["template"][
            "metadata"
        ]["labels"].pop("app.kubernetes.io/name"),
        "selector also finds Redis": lambda d: d.obj("Deployment", "caller-memory")["spec"]["selector"][
            "matchLabels"
        ].pop("app.kubernetes.io/component"),
        "spread over another app": lambda d: put(
            d.obj("Deployment", "caller-memory"),
            "spec.template.spec.topologySpreadConstraints.0.labelSelector.matchLabels",
            {"app": "caller-memory"},
        ),
        "StatefulSet on the ClusterIP Service": lambda d: put(
            d.obj("StatefulSet", "caller-memory-redis"), "spec.serviceName", "caller-memory-redis"
        ),
    },
    check_selectors: {
        "Service selects nothing": lambda d: d.obj("Service", "caller-memory")["spec"]["selector"].update(
            {"app.kubernetes.io/component": "apy"}
        ),
        "PDB selects every pod": lambda d: d.obj("PodDisruptionBudget", "caller-memory")["spec"]["selector"][
            "matchLabels"
        ].pop("app.kubernetes.io/component"),
        "HPA scales another name": lambda d: put(
            d.obj("HorizontalPodAutoscaler", "caller-memory"), "spec.scaleTargetRef.name", "api"
        ),
        "NetworkPolicy lets in no pod": lambda d: put(
            d.obj("NetworkPolicy", "caller-memory-redis"),
            "spec.ingress.0.from.0.podSelector.matchLabels",
            {"app": "caller-memory"},
        ),
    },
    check_probes: {
        "readiness on a path not served": lambda d: put(
            d.api_container(), "readinessProbe.httpGet.path", "/ready"
        ),
        "liveness on the store": lambda d: put(d.api_container(), "livenessProbe.httpGet.path", "/readyz"),
        "probe on an unknown port": lambda d: put(d.api_container(), "livenessProbe.httpGet.port", "web"),
        "HEALTHCHECK path not served": lambda d: set_instruction(
            d, "HEALTHCHECK", 'CMD ["python", "-c", "http://127.0.0.1:8080/health"]'
        ),
    },
    check_ports: {
        "containerPort": lambda d: put(d.api_container(), "ports.0.containerPort", 8000),
        "EXPOSE": lambda d: set_instruction(d, "EXPOSE", "80"),
        "Compose target": lambda d: put(d.compose, "services.api-2.ports.0", "127.0.0.1:8082:80"),
        "Service targetPort": lambda d: put(
            d.obj("Service", "caller-memory"), "spec.ports.0.targetPort", "metrics"
        ),
    },
    check_environment: {
        "a variable the service ignores": lambda d: d.api_container()["env"].append(
            {"name": "CALLER_MEMORY_PORT", "value": "8080"}
        ),
        "an unused helper variable": lambda d: d.api_container()["env"].append(
            {"name": "REDIS_HOST", "value": "redis"}
        ),
        "Compose misspells one": lambda d: put(
            d.compose, "services.api-1.environment", {"CALLER_MEMORY_STORE_URL": "redis://redis"}
        ),
    },
    check_secrets: {
        "literal key in the Deployment": lambda d: put(
            d.api_container(), "env.0", {"name": "CALLER_MEMORY_PSEUDONYM_KEY", "value": "x" * 40}
        ),
        "literal token in Compose": lambda d: put(
            d.compose, "services.api-2.environment.CALLER_MEMORY_OPERATOR_TOKEN", "op_" + "x" * 30
        ),
        "a Secret manifest": lambda d: d.k8s.update({("Secret", "caller-memory"): {}}),
        "a secret baked into the image": lambda d: d.dockerfile.append(
            ("ENV", "CALLER_MEMORY_OPERATOR_TOKEN=op_x")
        ),
    },
    check_store: {
        "Kubernetes host": lambda d: put(
            d.api_container(), "env.3.value", "redis://:$(REDIS_PASSWORD)@redis-master:6379/0"
        ),
        "the headless Service": lambda d: put(
            d.api_container(), "env.3.value", "redis://caller-memory-redis-headless:6379/0"
        ),
        "Compose SQLite": lambda d: put(
            d.compose, "services.api-1.environment.CALLER_MEMORY_STORE", "sqlite:///caller-memory.db"
        ),
    },
    check_non_root: {
        "USER root": lambda d: set_instruction(d, "USER", "root"),
        "another UID in the pod": lambda d: put(
            d.obj("Deployment", "caller-memory"), "spec.template.spec.securityContext.runAsUser", 1000
        ),
        "writable Redis root": lambda d: put(
            d.redis_container(), "securityContext.readOnlyRootFilesystem", False
        ),
        "Compose keeps capabilities": lambda d: d.compose["services"]["api-1"].pop("cap_drop"),
    },
    check_resources: {
        "no limits": lambda d: d.api_container()["resources"].pop("limits"),
        "maxmemory above the limit": lambda d: put(d.redis_container(), "args.5", "4gb"),
        "Compose maxmemory default": lambda d: put(
            d.compose, "services.redis.command.5", "${REDIS_MAXMEMORY:-1gb}"
        ),
    },
    check_compose_redis: {
        "Compose runs another file": lambda d: put(
            d.compose, "services.redis.volumes.0.source", "./redis-dev.conf"
        ),
        "Compose writable config": lambda d: put(d.compose, "services.redis.volumes.0.read_only", False),
        "API starts before Redis is healthy": lambda d: put(
            d.compose, "services.api-2.depends_on.redis.condition", "service_started"
        ),
        "data in the container": lambda d: d.compose["services"]["redis"]["volumes"].pop(),
        "Redis images differ": lambda d: put(d.redis_container(), "image", "redis:7.2.11"),
    },
    check_kubernetes_redis: {
        "ConfigMap drifts": lambda d: d.obj("ConfigMap", "caller-memory-redis-config")["data"].update(
            {"redis.conf": d.redis_conf + "appendfsync everysec\n"}
        ),
        "config from elsewhere": lambda d: put(
            d.redis_container(), "args.1", "/usr/local/etc/redis/redis.conf"
        ),
        "data off the volume": lambda d: put(d.redis_container(), "args.7", "/tmp"),
    },
    check_replicas: {
        "one replica": lambda d: put(d.obj("Deployment", "caller-memory"), "spec.replicas", 1),
        "PDB blocks drains": lambda d: put(
            d.obj("PodDisruptionBudget", "caller-memory"), "spec.maxUnavailable", 0
        ),
        "Compose replicas on one port": lambda d: put(
            d.compose, "services.api-2.ports.0", "127.0.0.1:8081:8080"
        ),
    },
    check_images: {
        "floating Redis tag": lambda d: put(d.redis_container(), "image", "redis:7"),
        "stages on two Pythons": lambda d: set_instruction(d, "FROM", "python:3.12.8-slim-bookworm"),
    },
    check_command: {
        "listens on loopback only": lambda d: set_instruction(
            d, "CMD", '["caller-memory", "serve", "--host", "127.0.0.1", "--port", "8080"]'
        ),
        "COPY a missing file": lambda d: d.dockerfile.insert(2, ("COPY", "requirements.lock ./")),
    },
}


@pytest.mark.parametrize("check", CHECKS, ids=[check.__name__ for check in CHECKS])
def test_the_deployment_files_agree(check: Callable[[Deploy], list[str]]) -> None:
    assert check(load()) == []


@pytest.mark.parametrize(
    ("check", "breakage"),
    [(check, breakage) for check, breakages in CHECKS.items() for breakage in breakages.values()],
    ids=[f"{check.__name__}-{name}" for check, breakages in CHECKS.items() for name in breakages],
)
def test_a_consistency_check_rejects_a_broken_copy(
    check: Callable[[Deploy], list[str]], breakage: Breakage
) -> None:
    broken = load()
    breakage(broken)
    assert check(broken) != []
