"""Consistency checks of the deployment files: what no linter knows.

Each check takes the parsed files (:class:`Deploy`) and returns its findings, an empty list when all is
well, so that test_manifests.py can run it on the real files and on copies broken on purpose.
"""

from __future__ import annotations

import posixpath
import re
import tomllib
from urllib.parse import urlsplit

from tests.deploy.manifests import DEPLOY, ROOT, Deploy, Doc, exec_form, final_stage

#: The variables of deploy/.env: the Secret `caller-memory` is made from the same file (deploy/README.md).
SECRET_VARIABLES = {
    "CALLER_MEMORY_PSEUDONYM_KEY",
    "CALLER_MEMORY_OPERATOR_TOKEN",
    "CALLER_MEMORY_SECRET_KEY",
    "REDIS_PASSWORD",
}
REQUIRED_ENV = {"CALLER_MEMORY_PSEUDONYM_KEY", "CALLER_MEMORY_OPERATOR_TOKEN", "CALLER_MEMORY_STORE"}
SERVICE_PORT = 8080


def workloads(d: Deploy) -> dict[tuple[str, str], Doc]:
    return {key: doc for key, doc in d.k8s.items() if key[0] in ("Deployment", "StatefulSet")}


def pod_labels(d: Deploy) -> dict[tuple[str, str], dict[str, str]]:
    return {key: doc["spec"]["template"]["metadata"]["labels"] for key, doc in workloads(d).items()}


def selects_one(d: Deploy, selector: dict[str, str], where: str) -> list[str]:
    hits = [key for key, pod in pod_labels(d).items() if selector and selector.items() <= pod.items()]
    return (
        []
        if len(hits) == 1
        else [f"{where}: selector {selector} selects the pods of {hits}, not of one workload"]
    )


def check_workload_selectors(d: Deploy) -> list[str]:
    """Each workload's selector matches its own pods (and only those); a StatefulSet has its headless Service."""
    problems = []
    for key, doc in workloads(d).items():
        selector = doc["spec"]["selector"]["matchLabels"]
        problems += selects_one(d, selector, f"{key} selector")
        if not selector.items() <= pod_labels(d)[key].items():
            problems.append(f"{key}: its selector does not match its own pod template")
        for spread in doc["spec"]["template"]["spec"].get("topologySpreadConstraints", []):
            problems += selects_one(
                d, spread["labelSelector"]["matchLabels"], f"{key} topologySpreadConstraints"
            )
        if key[0] == "StatefulSet":
            governing = d.k8s.get(("Service", doc["spec"]["serviceName"]))
            if governing is None or governing["spec"].get("clusterIP") != "None":
                problems.append(f"{key}: serviceName does not name a headless Service")
    return problems


def check_selectors(d: Deploy) -> list[str]:
    """Services, the PodDisruptionBudget and the NetworkPolicy find exactly one workload's pods; the HPA its target."""
    problems = []
    for (kind, name), doc in d.k8s.items():
        spec = doc.get("spec", {})
        if kind == "Service":
            problems += selects_one(d, spec["selector"], f"Service {name}")
        elif kind == "PodDisruptionBudget":
            problems += selects_one(d, spec["selector"]["matchLabels"], f"PodDisruptionBudget {name}")
        elif kind == "NetworkPolicy":
            problems += selects_one(d, spec["podSelector"]["matchLabels"], f"NetworkPolicy {name}")
            for peer in (peer for rule in spec["ingress"] for peer in rule["from"]):
                problems += selects_one(
                    d, peer["podSelector"]["matchLabels"], f"NetworkPolicy {name} ingress"
                )
        elif kind == "HorizontalPodAutoscaler":
            target = spec["scaleTargetRef"]
            workload = workloads(d).get((target["kind"], target["name"]))
            if workload is None or workload["apiVersion"] != target["apiVersion"]:
                problems.append(f"HorizontalPodAutoscaler {name}: scaleTargetRef {target} names no workload")
    return problems


def container_ports(container: Doc) -> dict[str, int]:
    return {port["name"]: port["containerPort"] for port in container["ports"]}


def port_number(container: Doc, port: str | int) -> int | None:
    ports = container_ports(container)
    return ports.get(port) if isinstance(port, str) else (port if port in ports.values() else None)


def check_probes(d: Deploy) -> list[str]:
    """Readiness on /readyz (the store answers), liveness on /healthz (never the store), both served."""
    problems = []
    container = d.api_container()
    for probe, path in (("readinessProbe", "/readyz"), ("livenessProbe", "/healthz")):
        get = container.get(probe, {}).get("httpGet", {})
        if get.get("path") != path:
            problems.append(f"{probe} is on {get.get('path')}, not {path}")
        if "get" not in d.api_paths.get(get.get("path"), ()):
            problems.append(f"{probe}: the service's OpenAPI document has no GET {get.get('path')}")
        if port_number(container, get.get("port")) != SERVICE_PORT:
            problems.append(f"{probe}: port {get.get('port')} is not the service's port")
    [health] = [a for k, a in final_stage(d.dockerfile) if k == "HEALTHCHECK"]
    served = re.search(r"http://127\.0\.0\.1:\d+(/\w*)", health)
    if served is None or "get" not in d.api_paths.get(served.group(1), ()):
        problems.append(f"HEALTHCHECK: the service serves no GET {served and served.group(1)}")
    return problems


def api_services(d: Deploy) -> dict[str, Doc]:
    """The Compose services built from deploy/Dockerfile."""
    return {
        name: service
        for name, service in d.compose["services"].items()
        if service.get("build", {}).get("dockerfile") == "deploy/Dockerfile"
    }


def check_ports(d: Deploy) -> list[str]:
    """The service's port is the same in EXPOSE, CMD, HEALTHCHECK, the pods, the Services and Compose."""
    final = final_stage(d.dockerfile)
    command = exec_form(next(a for k, a in final if k == "CMD"))
    [health] = [a for k, a in final if k == "HEALTHCHECK"]
    seen = {
        "EXPOSE": [int(a) for k, a in final if k == "EXPOSE"],
        "CMD --port": [int(command[command.index("--port") + 1])] if "--port" in command else [],
        "HEALTHCHECK": [int(p) for p in re.findall(r"127\.0\.0\.1:(\d+)", health)],
        "containerPort": list(container_ports(d.api_container()).values()),
        "Compose ports": [
            int(str(p).rsplit(":", 1)[-1]) for s in api_services(d).values() for p in s["ports"]
        ],
    }
    problems = [f"{where}: {ports}, not [{SERVICE_PORT}]" for where, ports in seen.items() if not ports]
    problems += [
        f"{where}: {ports} != {SERVICE_PORT}" for where, ports in seen.items() if set(ports) - {SERVICE_PORT}
    ]
    for service, container in (
        ("caller-memory", d.api_container()),
        ("caller-memory-redis", d.redis_container()),
    ):
        for port in d.obj("Service", service)["spec"]["ports"]:
            if port_number(container, port["targetPort"]) is None:
                problems.append(f"Service {service}: targetPort {port['targetPort']} is no container port")
    return problems


def env_names_and_references(container: Doc) -> tuple[list[str], set[str]]:
    env = container.get("env", [])
    texts = [str(e.get("value", "")) for e in env] + [str(a) for a in container.get("args", [])]
    return [e["name"] for e in env], set(re.findall(r"\$\((\w+)\)", " ".join(texts)))


def check_environment(d: Deploy) -> list[str]:
    """Every variable given to the service is one it reads (service/config.py), or is used to build one."""
    problems = []
    names, references = env_names_and_references(d.api_container())
    settings: dict[str, list[str]] = {"Deployment caller-memory": names}
    settings |= {f"Compose {name}": list(s.get("environment", {})) for name, s in api_services(d).items()}
    for where, variables in settings.items():
        for name in variables:
            if name not in d.service_env and not (where.startswith("Deployment") and name in references):
                problems.append(f"{where}: {name} is set, but the service does not read it")
        if missing := REQUIRED_ENV - set(variables):
            problems.append(f"{where}: {sorted(missing)} not set")
    return problems


def interpolated(value: str) -> list[str]:
    """The Compose variables ``value`` takes from deploy/.env, each required (`${NAME:?message}`)."""
    return re.findall(r"\$\{(\w+):\?[^}]*\}", value)


def check_secrets(d: Deploy) -> list[str]:
    """Secrets come from the Secret `caller-memory` or deploy/.env, never from a value in a manifest."""
    problems = [f"{kind} {name}: no Secret in deploy/k8s" for kind, name in d.k8s if kind == "Secret"]
    keys = set()
    for key, workload in workloads(d).items():
        for container in workload["spec"]["template"]["spec"]["containers"]:
            for env in container.get("env", []):
                ref = env.get("valueFrom", {}).get("secretKeyRef")
                if ref is not None:
                    keys.add(ref["key"])
                    if ref["name"] != "caller-memory":
                        problems.append(f"{key} {env['name']}: from Secret {ref['name']}, not caller-memory")
                elif env["name"] in SECRET_VARIABLES | {"REDISCLI_AUTH"}:
                    problems.append(f"{key} {env['name']}: a literal value, not a secretKeyRef")
    if keys != SECRET_VARIABLES:
        problems.append(f"the Secret's keys {sorted(keys)} are not deploy/.env's {sorted(SECRET_VARIABLES)}")
    required = set()
    for name, service in d.compose["services"].items():
        texts = [str(v) for v in service.get("environment", {}).values()] + list(
            map(str, service.get("command", []))
        )
        required |= {variable for text in texts for variable in interpolated(text)}
        for variable, value in service.get("environment", {}).items():
            if variable in SECRET_VARIABLES | {"REDISCLI_AUTH"} and not interpolated(str(value)):
                problems.append(
                    f"Compose {name} {variable}: a literal value, not ${{...:?}} from deploy/.env"
                )
    if required != SECRET_VARIABLES:
        problems.append(f"Compose takes {sorted(required)} from deploy/.env, not {sorted(SECRET_VARIABLES)}")
    problems += [f"deploy/README.md never names {v}" for v in sorted(SECRET_VARIABLES) if v not in d.readme]
    secret_instructions = [
        a for k, a in d.dockerfile if k in ("ENV", "ARG") and re.search("KEY|TOKEN|PASSWORD", a)
    ]
    problems += [f"Dockerfile bakes in a secret: {a}" for a in secret_instructions]
    return problems


def store_address(url: str) -> tuple[str, str | None, int | None]:
    parts = urlsplit(re.sub(r"\$\{[^}]*\}|\$\(\w+\)", "password", url))
    return parts.scheme, parts.hostname, parts.port


def check_store(d: Deploy) -> list[str]:
    """CALLER_MEMORY_STORE points at the Redis that the same files start."""
    problems = []
    env = {e["name"]: e for e in d.api_container()["env"]}
    scheme, host, port = store_address(env.get("CALLER_MEMORY_STORE", {}).get("value", ""))
    service = d.k8s.get(("Service", str(host)))
    redis_ports = [p["port"] for p in service["spec"]["ports"]] if service else []
    if (
        scheme != "redis"
        or service is None
        or service["spec"].get("clusterIP") == "None"
        or port not in redis_ports
    ):
        problems.append(f"Kubernetes: the store {scheme}://{host}:{port} is not the Redis Service")
    elif (
        service["spec"]["selector"]
        != d.obj("StatefulSet", "caller-memory-redis")["spec"]["selector"]["matchLabels"]
    ):
        problems.append(f"Kubernetes: Service {host} does not lead to the Redis StatefulSet")
    for name, api in api_services(d).items():
        scheme, host, port = store_address(api["environment"].get("CALLER_MEMORY_STORE", ""))
        if scheme != "redis" or host not in d.compose["services"] or port != 6379:
            problems.append(f"Compose {name}: the store {scheme}://{host}:{port} is not the redis service")
    return problems


def check_non_root(d: Deploy) -> list[str]:
    """The image runs as a fixed non-root UID; every pod and the Compose replicas are locked down."""
    problems = []
    users = [a for k, a in final_stage(d.dockerfile) if k == "USER"]
    uid, _, gid = (users or ["0"])[-1].partition(":")
    if not (uid.isdigit() and gid.isdigit() and int(uid) > 0):
        problems.append(f"the image's last USER is {users[-1:]}: not a numeric non-root UID:GID")
    pod = d.obj("Deployment", "caller-memory")["spec"]["template"]["spec"]["securityContext"]
    if [str(pod.get("runAsUser")), str(pod.get("runAsGroup"))] != [uid, gid]:
        problems.append(
            f"Deployment runs as {pod.get('runAsUser')}:{pod.get('runAsGroup')}, the image as {uid}:{gid}"
        )
    for key, workload in workloads(d).items():
        spec = workload["spec"]["template"]["spec"]
        if spec["securityContext"].get("runAsNonRoot") is not True or spec.get(
            "automountServiceAccountToken"
        ):
            problems.append(f"{key}: not runAsNonRoot, or mounts a service account token")
        for container in spec["containers"]:
            context = container.get("securityContext", {})
            locked = (context.get("allowPrivilegeEscalation"), context.get("readOnlyRootFilesystem"))
            if locked != (False, True) or context.get("capabilities", {}).get("drop") != ["ALL"]:
                problems.append(
                    f"{key} {container['name']}: not read-only, unprivileged, without capabilities"
                )
    for name, service in api_services(d).items():
        if service.get("read_only") is not True or service.get("cap_drop") != ["ALL"] or "user" in service:
            problems.append(f"Compose {name}: not read-only without capabilities as the image's user")
    return problems


def byte_size(text: str) -> int:
    """A Kubernetes quantity (2Gi), a Docker size (1g) or a Redis size (1536mb), in bytes.

    A single-letter unit is read as binary, as Docker does; Redis reads 1m as 10**6 bytes, so this errs high.
    """
    match = re.fullmatch(r"(\d+)([A-Za-z]*)", text.strip())
    assert match is not None, f"not a size: {text}"
    number, unit = match.groups()
    factors = {"": 1, "k": 1024, "m": 1024**2, "g": 1024**3, "ki": 1024, "mi": 1024**2, "gi": 1024**3}
    factors |= {"kb": 1024, "mb": 1024**2, "gb": 1024**3}
    return int(number) * factors[unit.lower()]


def redis_maxmemory(arguments: list[str]) -> int:
    value = str(arguments[arguments.index("--maxmemory") + 1])
    return byte_size(re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", value))


def check_resources(d: Deploy) -> list[str]:
    """Every container has CPU and memory requests and limits; Redis' maxmemory fits under its limit."""
    problems = []
    for key, workload in workloads(d).items():
        for container in workload["spec"]["template"]["spec"]["containers"]:
            resources = container.get("resources", {})
            for kind in ("requests", "limits"):
                if set(resources.get(kind, {})) != {"cpu", "memory"}:
                    problems.append(f"{key} {container['name']}: {kind} for cpu and memory expected")
    redis = d.redis_container()
    limit = byte_size(redis.get("resources", {}).get("limits", {}).get("memory", "0"))
    if not redis_maxmemory(redis["args"]) <= 0.8 * limit:
        problems.append(
            "Kubernetes Redis: --maxmemory leaves under 20% of the memory limit for the log rewrite"
        )
    compose_redis = d.compose["services"]["redis"]
    limit = byte_size(compose_redis["deploy"]["resources"]["limits"]["memory"])
    if not redis_maxmemory(compose_redis["command"]) <= 0.8 * limit:
        problems.append("Compose redis: --maxmemory leaves under 20% of the memory limit for the log rewrite")
    return problems


def check_compose_redis(d: Deploy) -> list[str]:
    """Compose's Redis runs deploy/redis.conf, read-only, keeps /data on a volume, is healthy before the API."""
    problems = []
    redis = d.compose["services"]["redis"]
    command = [str(part) for part in redis["command"]]
    mounts = {m["target"]: m for m in redis["volumes"]}
    conf = mounts.get(command[1]) if command[0] == "redis-server" else None
    if conf is None or conf["type"] != "bind" or (DEPLOY / conf["source"]).resolve() != DEPLOY / "redis.conf":
        problems.append(f"Compose redis: {command[:2]} does not run deploy/redis.conf")
    elif conf.get("read_only") is not True:
        problems.append("Compose redis: redis.conf is mounted writable")
    data = mounts.get("/data", {})
    if data.get("type") != "volume" or data.get("source") not in (d.compose.get("volumes") or {}):
        problems.append("Compose redis: /data is not on a named volume")
    if "redis-cli ping" not in " ".join(redis.get("healthcheck", {}).get("test", [])):
        problems.append("Compose redis: the health check does not ping Redis")
    for name, service in api_services(d).items():
        if service.get("depends_on", {}).get("redis", {}).get("condition") != "service_healthy":
            problems.append(f"Compose {name}: does not wait for a healthy redis")
    if redis["image"] != d.redis_container()["image"]:
        problems.append(
            f"Redis images differ: {redis['image']} (Compose), {d.redis_container()['image']} (Kubernetes)"
        )
    return problems


def check_kubernetes_redis(d: Deploy) -> list[str]:
    """The StatefulSet runs the ConfigMap's redis.conf, identical to deploy/redis.conf, with its data on a volume."""
    problems = []
    if d.obj("ConfigMap", "caller-memory-redis-config")["data"]["redis.conf"] != d.redis_conf:
        problems.append("ConfigMap caller-memory-redis-config differs from deploy/redis.conf")
    statefulset = d.obj("StatefulSet", "caller-memory-redis")
    container = d.redis_container()
    volumes = {v["name"]: v for v in statefulset["spec"]["template"]["spec"]["volumes"]}
    claims = {c["metadata"]["name"] for c in statefulset["spec"]["volumeClaimTemplates"]}
    mounted = {m["mountPath"]: m for m in container["volumeMounts"]}
    args = [str(a) for a in container["args"]]
    config_mount = mounted.get(posixpath.dirname(args[1]), {})
    config_map = volumes.get(config_mount.get("name"), {}).get("configMap", {}).get("name")
    if (
        args[0] != "redis-server"
        or config_map != "caller-memory-redis-config"
        or not config_mount.get("readOnly")
    ):
        problems.append(f"StatefulSet: {args[:2]} is not the ConfigMap's redis.conf, mounted read-only")
    data_dir = args[args.index("--dir") + 1] if "--dir" in args else "?"
    if mounted.get(data_dir, {}).get("name") not in claims:
        problems.append(f"StatefulSet: the data directory {data_dir} is not on a persistent volume")
    return problems


def check_replicas(d: Deploy) -> list[str]:
    """At least two replicas everywhere, and node drains can proceed."""
    problems = []
    replicas = d.obj("Deployment", "caller-memory")["spec"]["replicas"]
    hpa = d.obj("HorizontalPodAutoscaler", "caller-memory")["spec"]
    if not 2 <= replicas == hpa["minReplicas"] < hpa["maxReplicas"]:
        problems.append(
            f"replicas {replicas}, HPA {hpa['minReplicas']}..{hpa['maxReplicas']}: 2 <= replicas == min < max"
        )
    if [m["resource"]["name"] for m in hpa["metrics"] if m["type"] == "Resource"] != ["cpu"]:
        problems.append("the HorizontalPodAutoscaler does not scale on CPU")
    pdb = d.obj("PodDisruptionBudget", "caller-memory")["spec"]
    if not (pdb.get("maxUnavailable", 0) >= 1 or 0 <= pdb.get("minAvailable", replicas) < replicas):
        problems.append("the PodDisruptionBudget blocks every node drain")
    published = [str(p).rsplit(":", 1)[0] for s in api_services(d).values() for p in s.get("ports", [])]
    if len(api_services(d)) < 2 or len(set(published)) != len(published):
        problems.append(f"Compose: {sorted(api_services(d))} on {published}: two replicas on distinct ports")
    return problems


def check_images(d: Deploy) -> list[str]:
    """Pinned base and Redis images; both stages on one Python, so the copied virtualenv finds its interpreter."""
    problems = []
    bases = {a.split()[0] for k, a in d.dockerfile if k == "FROM"}
    if len(bases) != 1 or not re.fullmatch(
        r"python:3\.11\.\d+-slim-[a-z]+(@sha256:[0-9a-f]{64})?", min(bases)
    ):
        problems.append(
            f"Dockerfile stages on {sorted(bases)}: one pinned python:3.11.N-slim-<debian> expected"
        )
    for where, image in (
        ("Compose", d.compose["services"]["redis"]["image"]),
        ("Kubernetes", d.redis_container()["image"]),
    ):
        if not re.fullmatch(r"redis:7\.\d+\.\d+(-[a-z]+)?(@sha256:[0-9a-f]{64})?", image):
            problems.append(f"{where}: Redis image {image} is not pinned to a 7.x.y release")
    return problems


def check_command(d: Deploy) -> list[str]:
    """The image starts the service on all interfaces; the command exists; COPY sources exist."""
    problems = []
    command = exec_form(next(a for k, a in final_stage(d.dockerfile) if k == "CMD"))
    if command != ["caller-memory", "serve", "--host", "0.0.0.0", "--port", str(SERVICE_PORT)]:
        problems.append(f"CMD {command}")
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    if command[0] not in scripts:
        problems.append(f"{command[0]} is not a console script of the distribution")
    for keyword, arguments in d.dockerfile:
        if keyword == "COPY" and not arguments.startswith("--from"):
            problems += [f"COPY {s}: no such file" for s in arguments.split()[:-1] if not (ROOT / s).exists()]
    return problems
