"""Checks of the deployment files' wiring, without a Docker engine.

Each ``*_problems`` function takes parsed files and returns what is wrong, one sentence each
(an empty list: nothing). The tests run them on the real files and on broken copies, so every
check is seen to fail. Compose's ``${VAR:-default}`` is resolved to its default: what a checkout
without a .env gets.
"""

from __future__ import annotations

import fnmatch
import ipaddress
import json
import os
import re
import subprocess
import sys
import tomllib
import types
import typing
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import yaml
from pydantic import BaseModel
from redis.connection import parse_url

# How the Redis client itself reads a URL; redis-py leaves it untyped.
redis_url_options: Callable[[str], dict[str, Any]] = parse_url
ROOT = Path(__file__).resolve().parents[2]
# The standard OpenTelemetry variables the deployment documents (endpoint, protocol, headers,
# sampler, resource); any other OTEL_* name the app's code reads is added by `otel_names`.
OTEL_DOCUMENTED = {
    "OTEL_EXPORTER_OTLP_ENDPOINT",
    "OTEL_EXPORTER_OTLP_PROTOCOL",
    "OTEL_EXPORTER_OTLP_HEADERS",
    "OTEL_TRACES_SAMPLER",
    "OTEL_TRACES_SAMPLER_ARG",
    "OTEL_RESOURCE_ATTRIBUTES",
}
HEALTHCHECKED = ("redis", "vllm", "vllm-small", "vllm-cpu", "app")
PUBLISHED = {"app": 8000, "jaeger": 16686, "prometheus": 9090}
OTLP_PORTS = {"grpc": 4317, "http/protobuf": 4318, "http/json": 4318}


class Reset:
    """Compose's ``!reset`` tag (drop the value of the files before), kept visible for checks."""

    def __init__(self, value: Any) -> None:
        self.value = value


class _ComposeLoader(yaml.SafeLoader):
    pass


def _tagged(loader: yaml.SafeLoader, node: yaml.Node) -> Reset:
    if isinstance(node, yaml.SequenceNode):
        return Reset(loader.construct_sequence(node))
    if isinstance(node, yaml.MappingNode):
        return Reset(loader.construct_mapping(node))
    return Reset(loader.construct_scalar(node))  # type: ignore[arg-type]


_ComposeLoader.add_constructor("!reset", _tagged)
_ComposeLoader.add_constructor("!override", _tagged)

_VARIABLE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?])([^}]*))?\}")


def load_yaml(path: Path) -> Any:
    # A SafeLoader that also knows the compose tags: no arbitrary objects are built.
    return yaml.load(path.read_text(), Loader=_ComposeLoader)


def with_defaults(value: Any) -> Any:
    """`value` with every ``${VAR:-default}`` replaced by its default (``${VAR}`` by "")."""
    if isinstance(value, str):
        return _VARIABLE.sub(lambda m: m.group(3) if m.group(2) in (":-", "-") else "", value)
    if isinstance(value, list):
        return [with_defaults(v) for v in value]
    if isinstance(value, dict):
        return {k: with_defaults(v) for k, v in value.items()}
    return value


def interpolated_names(text: str) -> set[str]:
    return {m.group(1) for m in _VARIABLE.finditer(text)}


def env_names(model: type[BaseModel], prefix: str = "RAG_") -> Iterator[str]:
    """The environment variable of every field of `model`, nested groups joined by ``__``."""
    for name, field in model.model_fields.items():
        nested = [t for t in _members(field.annotation) if _is_model(t)]
        if nested:
            for group in nested:
                yield from env_names(group, f"{prefix}{name.upper()}__")
        else:
            yield f"{prefix}{name.upper()}"


def _members(annotation: Any) -> list[Any]:
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return list(typing.get_args(annotation))
    return [annotation]


def _is_model(annotation: Any) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def otel_names(source_root: Path = ROOT / "app") -> set[str]:
    read: set[str] = set()
    for path in source_root.rglob("*.py"):
        read.update(re.findall(r"\bOTEL_[A-Z0-9_]*[A-Z0-9]\b", path.read_text()))
    return OTEL_DOCUMENTED | read


def direct_reads(
    roots: tuple[str, ...] = ("app", "pipeline", "retrieval"), base: Path = ROOT
) -> set[str]:
    """RAG_* variables the code reads itself, outside the settings (``os.environ.get("RAG_X")``,
    ``os.environ["RAG_X"]``, ``os.getenv("RAG_X")``; an assignment is not a read)."""
    pattern = re.compile(
        r"""(?:environ\.get\(|getenv\(|environ\[)\s*["'](RAG_[A-Z0-9_]+)["']\s*(?!\]\s*=[^=])"""
    )
    read: set[str] = set()
    for top in roots:
        for path in (base / top).rglob("*.py"):
            read.update(pattern.findall(path.read_text()))
    return read


def listed_names(env_example: str) -> set[str]:
    """Names an .env file sets or shows commented out (``# NAME=`` or ``# [compose] NAME=``)."""
    pattern = re.compile(r"^(?:#\s*(?:\[compose\]\s*)?)?([A-Z][A-Z0-9_]*)=", re.MULTILINE)
    return set(pattern.findall(env_example))


def environment(service: dict[str, Any]) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) if "=" in item else (item, "") for item in env)
    return {k: "" if v is None else str(v) for k, v in with_defaults(env).items()}


def published(service: dict[str, Any]) -> set[tuple[int, int]]:
    """(host port, container port) pairs the service publishes."""
    ports = service.get("ports") or []
    pairs = set()
    for port in with_defaults(ports.value if isinstance(ports, Reset) else ports):
        if isinstance(port, dict):
            pairs.add((int(port.get("published", 0)), int(port["target"])))
        elif str(port).count(":") >= 1:
            *_, host, container = str(port).split(":")
            pairs.add((int(host), int(container.split("/")[0])))
    return pairs


def _healthcheck_problems(services: dict[str, Any]) -> Iterator[str]:
    for name in HEALTHCHECKED:
        check = services.get(name, {}).get("healthcheck") or {}
        test = check.get("test") or []
        if check.get("disable") or not test or test == ["NONE"]:
            yield f"{name} has no healthcheck"
    for name, path in (("app", "/readyz"), ("vllm", "/health"), ("vllm-cpu", "/health")):
        test = services.get(name, {}).get("healthcheck", {}).get("test") or []
        if not any(path in str(part) for part in test):
            yield f"{name}'s healthcheck does not ask {path}"


def _otlp_problems(services: dict[str, Any], env: dict[str, str]) -> Iterator[str]:
    endpoint = urlsplit(env.get("OTEL_EXPORTER_OTLP_ENDPOINT", ""))
    target = services.get(endpoint.hostname or "", {})
    if not str(target.get("image", "")).startswith("jaegertracing/"):
        yield f"app's OTEL_EXPORTER_OTLP_ENDPOINT {endpoint.geturl()!r} is not the jaeger service"
    protocol = env.get("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
    if endpoint.port != OTLP_PORTS.get(protocol):
        yield f"app sends OTLP {protocol} to port {endpoint.port}, not {OTLP_PORTS.get(protocol)}"


def _dependency_problems(app: dict[str, Any]) -> Iterator[str]:
    depends = app.get("depends_on") or {}
    for name in ("redis", "vllm"):
        condition = depends.get(name, {}).get("condition") if isinstance(depends, dict) else None
        if condition != "service_healthy":
            yield f"app does not wait for a healthy {name} (condition: {condition})"


def _vllm_problems(services: dict[str, Any], env: dict[str, str]) -> Iterator[str]:
    for name in ("vllm", "vllm-small", "vllm-cpu"):
        command = " ".join(with_defaults(services.get(name, {}).get("command") or []))
        for flag in ("--enable-prefix-caching", "--enable-auto-tool-choice", "hermes"):
            if flag not in command:
                yield f"{name} runs without {flag}"
    served = " ".join(with_defaults(services.get("vllm", {}).get("command") or []))
    if f"--served-model-name={env.get('RAG_LLM__MODELS')}" not in served:
        yield "app's RAG_LLM__MODELS is not the name vllm serves its model under"
    devices = services.get("vllm", {}).get("deploy", {}).get("resources", {})
    if "gpu" not in json.dumps(devices.get("reservations", {})):
        yield "vllm reserves no GPU"
    routes = json.loads(env.get("RAG_ROUTING__ROUTES") or "{}")
    for route, host in (("small", "vllm-small"), ("large", "vllm")):
        if urlsplit(routes.get(route, {}).get("base_url", "")).hostname != host:
            yield f"the {route} route does not go to the {host} service"


def compose_problems(compose: dict[str, Any]) -> list[str]:
    """What is wrong in compose.yaml's wiring."""
    services = compose.get("services", {})
    app = services.get("app", {})
    env = environment(app)
    problems = [*_healthcheck_problems(services), *_otlp_problems(services, env)]
    problems += _dependency_problems(app)
    problems += _vllm_problems(services, env)
    for name, port in PUBLISHED.items():
        ports = published(services.get(name, {}))
        if (port, port) not in ports:
            problems.append(f"{name} does not publish {port}:{port} (publishes {sorted(ports)})")
    if env.get("RAG_SERVER__HOST") != "0.0.0.0":
        problems.append("app does not listen on 0.0.0.0 in its container (RAG_SERVER__HOST)")
    if env.get("RAG_ENVIRONMENT") != "production":
        problems.append("app does not run with RAG_ENVIRONMENT=production")
    return problems


def env_example_problems(env_example: str, needed: set[str]) -> list[str]:
    missing = sorted(needed - listed_names(env_example))
    return [f".env.example does not list {name}" for name in missing]


def prometheus_problems(config: dict[str, Any]) -> list[str]:
    """The app and vLLM must each be a scrape target, at /metrics."""
    targets: set[str] = set()
    for job in config.get("scrape_configs") or []:
        if job.get("metrics_path", "/metrics") != "/metrics":
            continue
        for static in job.get("static_configs") or []:
            targets.update(static.get("targets") or [])
        for dns in job.get("dns_sd_configs") or []:
            targets.update(f"{name}:{dns.get('port')}" for name in dns.get("names") or [])
    return [
        f"prometheus does not scrape {t}" for t in ("app:8000", "vllm:8000") if t not in targets
    ]


def dockerfile_problems(dockerfile: str, pyproject: dict[str, Any]) -> list[str]:
    problems = []
    instructions = re.sub(r"\\\n", " ", dockerfile)
    users = re.findall(r"^USER\s+(\S+)", instructions, re.MULTILINE)
    if not users or users[-1].split(":")[0] in ("root", "0"):
        problems.append("the image runs as root (no USER, or USER root)")
    healthcheck = re.search(r"^HEALTHCHECK .*$", instructions, re.MULTILINE)
    if healthcheck is None or "/readyz" not in healthcheck.group(0):
        problems.append("the image has no HEALTHCHECK on /readyz")
    command = re.search(r"^CMD\s+(.*)$", instructions, re.MULTILINE)
    argv = json.loads(command.group(1)) if command and command.group(1).startswith("[") else []
    if not argv:
        problems.append("CMD is not in exec form (the server would not get SIGTERM itself)")
    for flag in ("--timeout-graceful-shutdown", "0.0.0.0"):
        if flag not in argv:
            problems.append(f"the server is started without {flag}")
    bases = re.findall(r"^FROM\s+(\S+)", dockerfile, re.MULTILINE)
    version = re.search(r"^ARG PYTHON_VERSION=(\S+)", dockerfile, re.MULTILINE)
    final = bases[-1] if bases else ""
    final = final.replace("${PYTHON_VERSION}", version.group(1) if version else "")
    if not re.fullmatch(r"python:3\.11-slim(-\w+)?", final):
        problems.append(f"the image is not built on a slim Python 3.11 base ({final!r})")
    for package in packages(pyproject):
        if not re.search(rf"^COPY {package} ", dockerfile, re.MULTILINE):
            problems.append(f"the package {package}/ is not copied into the image")
    return problems


def dockerignore_problems(dockerignore: str, pyproject: dict[str, Any]) -> list[str]:
    """An allow-list .dockerignore must let every package (and the build's inputs) through."""
    lines = {line.strip() for line in dockerignore.splitlines()}
    if "*" not in lines:
        return []
    needed = [f"!{p}/" for p in packages(pyproject)] + ["!pyproject.toml", "!README.md"]
    return [f".dockerignore keeps {n[1:]} out of the build" for n in needed if n not in lines]


def packages(pyproject: dict[str, Any]) -> list[str]:
    return [p.rstrip("*") for p in pyproject["tool"]["setuptools"]["packages"]["find"]["include"]]


def load_pyproject() -> dict[str, Any]:
    with (ROOT / "pyproject.toml").open("rb") as f:
        return tomllib.load(f)


def scale_problems(scale: dict[str, Any], nginx_conf: str) -> list[str]:
    """compose.scale.yaml: N replicas, none publishing a host port, nginx in front of them."""
    services = scale.get("services", {})
    app, lb = services.get("app", {}), services.get("lb", {})
    problems = []
    if not isinstance(app.get("ports"), Reset) or app["ports"].value:
        problems.append("the app replicas still publish a host port (use `ports: !reset []`)")
    replicas = int(with_defaults(app.get("deploy", {}).get("replicas", 1)) or 1)
    if replicas < 2:
        problems.append(f"compose.scale.yaml runs {replicas} app replica(s), not N > 1")
    if (8000, 8080) not in published(lb):
        problems.append("the load balancer does not publish the API port 8000")
    if not any("deploy/nginx.conf:" in str(v) for v in lb.get("volumes") or []):
        problems.append("the load balancer does not mount deploy/nginx.conf")
    if (lb.get("depends_on") or {}).get("app", {}).get("condition") != "service_healthy":
        problems.append("the load balancer does not wait for healthy app replicas")
    if not re.search(r"^\s*server\s+app:8000\b", nginx_conf, re.MULTILINE):
        problems.append("nginx does not send requests to app:8000")
    if not re.search(r"location\s*=\s*/metrics\s*\{[^}]*return\s+404\b", nginx_conf):
        problems.append("nginx passes /metrics on to the replicas (answer it with a 404)")
    return problems


def package_data_problems(pyproject: dict[str, Any], root: Path = ROOT) -> list[str]:
    """Files the packages read at run time must be package data, or a non-editable install
    (the image's) leaves them out."""
    declared = pyproject["tool"].get("setuptools", {}).get("package-data", {})
    problems = []
    for top in packages(pyproject):
        for path in sorted((root / top).rglob("*")):
            if not path.is_file() or path.suffix in (".py", ".pyc") or "__pycache__" in path.parts:
                continue
            owner = path.parent
            while not (owner / "__init__.py").is_file() and owner != root / top:
                owner = owner.parent
            package = ".".join(owner.relative_to(root).parts)
            inside = path.relative_to(owner).as_posix()
            patterns = [*declared.get(package, []), *declared.get("*", [])]
            if not any(fnmatch.fnmatch(inside, pattern) for pattern in patterns):
                problems.append(f"{path.relative_to(root)} is not package data (pyproject.toml)")
    return problems


# ---------------------------------------------------------------- what the deployment exposes
# These checks read Compose's own merged configuration (`docker compose config --format json`,
# variables resolved), so they see what `docker compose up` would run, overrides included.

COMPOSE_BINARY = Path(sys.executable).parent / "docker-compose"
LOOPBACK = ("127.0.0.1", "::1", "localhost")
# What may listen on every interface of the host: the API, or the load balancer in front of it.
PUBLIC = {"app": 8000, "lb": 8080}


class ComposeRefused(Exception):
    """`docker compose config` failed; the message is Compose's own."""


def compose_config(
    files: list[Path], variables: Mapping[str, str], env_file: Path | None = None
) -> dict[str, Any]:
    """The merged configuration of `files` with only `variables` (and `env_file`) set: no .env of
    the checkout and nothing of this process's environment but PATH and HOME."""
    argv = [str(COMPOSE_BINARY), "--project-directory", str(ROOT)]
    for path in files:
        argv += ["-f", str(path)]
    argv += ["--env-file", str(env_file or os.devnull)]
    argv += ["--profile", "gpu", "--profile", "cpu", "--profile", "milvus"]
    env = {"PATH": os.environ.get("PATH", ""), "HOME": os.environ.get("HOME", "/"), **variables}
    done = subprocess.run(
        [*argv, "config", "--format", "json"], capture_output=True, text=True, env=env, timeout=60
    )
    if done.returncode != 0:
        raise ComposeRefused(done.stderr)
    config: dict[str, Any] = json.loads(done.stdout)
    return config


def exposure_problems(merged: dict[str, Any]) -> list[str]:
    """Only the API (or its load balancer) may be published beyond the host's loopback."""
    problems = []
    for name, service in merged.get("services", {}).items():
        for port in service.get("ports") or []:
            if str(port.get("host_ip", "")) in LOOPBACK:
                continue
            if PUBLIC.get(name) == port.get("target"):
                continue
            problems.append(
                f"{name} publishes {port.get('target')} on every interface of the host "
                f"(bind it to 127.0.0.1)"
            )
    return problems


def redis_auth_problems(merged: dict[str, Any]) -> list[str]:
    """Redis asks for a password; the app's URL, and the healthcheck, carry that same one."""
    services = merged.get("services", {})
    redis = services.get("redis", {})
    command = [str(part) for part in redis.get("command") or []]
    required = command[command.index("--requirepass") + 1] if "--requirepass" in command else ""
    if not required:
        return ["redis runs without --requirepass: anyone on its network reads keys and jobs"]
    problems = []
    for name in ("app", "worker"):
        if name not in services:
            continue
        url = str((services[name].get("environment") or {}).get("RAG_REDIS__URL", ""))
        if _password(url) != required:
            problems.append(f"{name}'s RAG_REDIS__URL does not carry Redis' password")
    if (redis.get("environment") or {}).get("REDISCLI_AUTH") != required:
        problems.append("redis' healthcheck does not authenticate (REDISCLI_AUTH)")
    test = " ".join(str(part) for part in (redis.get("healthcheck") or {}).get("test") or [])
    if "PONG" not in test:
        problems.append("redis' healthcheck trusts redis-cli's exit code (0 on NOAUTH too)")
    return problems


def _password(url: str) -> str | None:
    try:
        password = redis_url_options(url).get("password")
    except ValueError:
        return None
    return None if password is None else str(password)


def metrics_auth_problems(
    merged: dict[str, Any], prometheus: dict[str, Any], variables: Mapping[str, str]
) -> list[str]:
    """/metrics asks for a token, and Prometheus sends that same token: the secret it reads comes
    from the variable that set the app's RAG_TELEMETRY__METRICS_TOKEN."""
    services = merged.get("services", {})
    token = str(
        (services.get("app", {}).get("environment") or {}).get("RAG_TELEMETRY__METRICS_TOKEN", "")
    )
    if not token:
        return ["the app serves /metrics without a token (RAG_TELEMETRY__METRICS_TOKEN)"]
    secrets = merged.get("secrets") or {}
    mounted = {
        str(s.get("target") or f"/run/secrets/{s['source']}"): secrets.get(s["source"], {})
        for s in services.get("prometheus", {}).get("secrets") or []
    }
    job = next((j for j in prometheus.get("scrape_configs") or [] if _scrapes_app(j)), None)
    authorization = (job or {}).get("authorization") or {}
    if authorization.get("type", "Bearer") != "Bearer" or "credentials_file" not in authorization:
        return ["prometheus scrapes the app without a bearer token file (authorization)"]
    secret = mounted.get(authorization["credentials_file"])
    if secret is None:
        return [f"prometheus has no secret mounted at {authorization['credentials_file']}"]
    if variables.get(str(secret.get("environment"))) != token:
        return ["prometheus' token is not the one the app asks for"]
    return []


def _scrapes_app(job: dict[str, Any]) -> bool:
    names = [n for dns in job.get("dns_sd_configs") or [] for n in dns.get("names") or []]
    targets = [t for s in job.get("static_configs") or [] for t in s.get("targets") or []]
    return "app" in names or any(t.startswith("app:") for t in targets)


def proxy_trust_problems(merged: dict[str, Any]) -> list[str]:
    """The app believes X-Forwarded-* only from the compose network, whose subnet is fixed."""
    env = merged.get("services", {}).get("app", {}).get("environment") or {}
    trusted = [t.strip() for t in str(env.get("FORWARDED_ALLOW_IPS") or "").split(",")]
    trusted = [t for t in trusted if t]
    if not trusted:
        return []  # uvicorn's default: the loopback only
    if "*" in trusted:
        return ["the app trusts X-Forwarded-* from any address (FORWARDED_ALLOW_IPS=*)"]
    ipam = (merged.get("networks", {}).get("default") or {}).get("ipam") or {}
    subnets = [ipaddress.ip_network(c["subnet"]) for c in ipam.get("config") or [] if "subnet" in c]
    if not subnets:
        return ["the compose network has no fixed subnet for FORWARDED_ALLOW_IPS to name"]
    problems = []
    for item in trusted:
        network = ipaddress.ip_network(item, strict=False)
        if not any(_within(network, subnet) for subnet in subnets):
            problems.append(f"FORWARDED_ALLOW_IPS trusts {item}, outside the compose network")
    return problems


def _within(network: ipaddress.IPv4Network | ipaddress.IPv6Network, subnet: Any) -> bool:
    return network.version == subnet.version and network.subnet_of(subnet)
