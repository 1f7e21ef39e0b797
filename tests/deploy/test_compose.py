"""compose.yaml, compose.scale.yaml, the Dockerfile, .env.example and Prometheus's config wired
as the service needs them; each check is also run on a broken copy, and must fail there.

No Docker engine runs here: `make compose-check` runs Compose's own parser and the compose JSON
schema over the same files, and these tests check what a schema cannot (which service the
traces go to, what waits for what, that every setting is documented). What the deployment
exposes is checked on Compose's own merged configuration (`docker compose config`, run here):
only the API beyond the loopback, Redis behind its password, /metrics behind a token that
Prometheus sends, X-Forwarded-* believed from the compose network only, and no start at all
without the secrets.
"""

from __future__ import annotations

import base64
import copy
import json
import os
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel, Field

from app.settings import Settings
from tests.deploy.wiring import (
    ROOT,
    ComposeRefused,
    Reset,
    compose_config,
    compose_problems,
    direct_reads,
    dockerfile_problems,
    dockerignore_problems,
    env_example_problems,
    env_names,
    environment,
    exposure_problems,
    interpolated_names,
    load_pyproject,
    load_yaml,
    metrics_auth_problems,
    otel_names,
    package_data_problems,
    prometheus_problems,
    proxy_trust_problems,
    redis_auth_problems,
    scale_problems,
)
from tests.support.servers import RedisServer

COMPOSE = ROOT / "compose.yaml"
SCALE = ROOT / "compose.scale.yaml"
ENV_EXAMPLE = ROOT / ".env.example"
Mutation = Callable[[dict[str, Any]], None]
# Secrets as a person would make them (`openssl rand -hex 32`), for the merged configurations.
SECRETS = {
    "REDIS_PASSWORD": "3f9a" * 8,
    "METRICS_TOKEN": "b7c1" * 8,
    "WEBHOOK_SECRET_KEY": base64.b64encode(b"0123456789abcdef" * 2).decode(),
}
BOTH_FILES = {"compose.yaml": [COMPOSE], "with compose.scale.yaml": [COMPOSE, SCALE]}


def variables_the_stack_reads(settings: type[BaseModel] = Settings) -> set[str]:
    """Every RAG_* setting (from the model itself), the RAG_* names code reads directly, the
    OTEL_* names, and compose's ${...}."""
    compose_text = COMPOSE.read_text() + SCALE.read_text()
    names = set(env_names(settings)) | direct_reads() | otel_names()
    return names | interpolated_names(compose_text)


def app_env(compose: dict[str, Any]) -> dict[str, Any]:
    env: dict[str, Any] = compose["services"]["app"]["environment"]
    return env


def test_compose_wiring_is_complete() -> None:
    assert compose_problems(load_yaml(COMPOSE)) == []


def test_every_variable_the_stack_reads_is_in_env_example() -> None:
    needed = variables_the_stack_reads()
    # The derivation itself must find the settings, or an empty set would pass.
    assert {"RAG_REDIS__URL", "RAG_TELEMETRY__CAPTURE_CONTENT", "RAG_DEV_API_KEY"} <= needed
    assert {"OTEL_EXPORTER_OTLP_ENDPOINT", "VLLM_MODEL", "API_PORT"} <= needed
    assert env_example_problems(ENV_EXAMPLE.read_text(), needed) == []


def test_env_names_follow_the_settings_model_and_a_missing_one_is_named() -> None:
    class Knobs(BaseModel):
        turn_me: int = 1

    class GrownSettings(Settings):
        knobs: Knobs = Field(default_factory=Knobs)
        spare: Knobs | None = None

    grown = set(env_names(GrownSettings)) - set(env_names(Settings))
    assert grown == {"RAG_KNOBS__TURN_ME", "RAG_SPARE__TURN_ME"}
    listed = "COMPOSE_PROFILES=gpu\n# RAG_KNOBS__TURN_ME=1\n# [compose] RAG_SPARE__TURN_ME=2\n"
    assert env_example_problems(listed, grown | {"COMPOSE_PROFILES"}) == []
    assert env_example_problems(listed.replace("# RAG_KNOBS", "# RAG_KNOB"), grown) == [
        ".env.example does not list RAG_KNOBS__TURN_ME"
    ]


def test_variables_read_outside_the_settings_are_found(tmp_path: Path) -> None:
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "x.py").write_text(
        'import os\nA = os.environ.get("RAG_FOO", "1")\nB = os.getenv(\'RAG_BAZ\')\n'
        'os.environ["RAG_SET_HERE"] = "1"\nC = os.environ["RAG_QUX"]\n'
    )
    assert direct_reads(("pkg",), tmp_path) == {"RAG_FOO", "RAG_BAZ", "RAG_QUX"}
    assert {"RAG_HOME", "RAG_MODELS_DIR"} <= direct_reads()


def _production_env(monkeypatch: pytest.MonkeyPatch, merged: dict[str, Any]) -> None:
    """The app container's environment as compose.yaml declares it (a developer's .env, which
    compose would add, stays out), resolved by Compose."""
    for name in list(os.environ):
        if name.startswith(("RAG_", "OTEL_")) or name == "FORWARDED_ALLOW_IPS":
            monkeypatch.delenv(name)
    declared = set(environment(load_yaml(COMPOSE)["services"]["app"]))
    declared |= set(environment(load_yaml(SCALE)["services"]["app"]))
    for name, value in merged["services"]["app"]["environment"].items():
        if name in declared:
            monkeypatch.setenv(name, str(value))


def test_the_app_accepts_its_compose_environment_as_production_settings(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _production_env(monkeypatch, compose_config([COMPOSE], SECRETS))
    settings = Settings(_env_file=None)
    assert settings.environment == "production"
    assert settings.server.host == "0.0.0.0"
    assert settings.redis.url == f"redis://:{SECRETS['REDIS_PASSWORD']}@redis:6379/0"
    assert settings.telemetry.metrics_token is not None
    assert settings.telemetry.metrics_token.get_secret_value() == SECRETS["METRICS_TOKEN"]
    assert settings.jobs.webhook_secret_key is not None
    assert settings.llm.base_url == "http://vllm:8000"
    routes = settings.routing.resolved(settings.llm)
    assert routes["small"].base_url == "http://vllm-small:8000"
    assert routes["large"].base_url == "http://vllm:8000"
    assert routes["large"].model == settings.llm.models[0]
    # The replicas behind the load balancer too: their FORWARDED_ALLOW_IPS is not "*".
    _production_env(monkeypatch, compose_config([COMPOSE, SCALE], SECRETS))
    assert os.environ["FORWARDED_ALLOW_IPS"] == "172.28.0.0/16"
    assert Settings(_env_file=None).environment == "production"


def test_env_example_placeholders_are_refused_in_production_each_named(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # `cp .env.example .env; docker compose up` gets past compose, then the app says what to set.
    _production_env(monkeypatch, compose_config([COMPOSE], {}, env_file=ENV_EXAMPLE))
    with pytest.raises(ValueError, match="refusing to start in production") as refused:
        Settings(_env_file=None)
    message = str(refused.value)
    assert "Redis password in RAG_REDIS__URL is the placeholder" in message
    assert "metrics token (RAG_TELEMETRY__METRICS_TOKEN) is the placeholder" in message
    assert "webhook secret key (RAG_JOBS__WEBHOOK_SECRET_KEY) is the placeholder" in message
    assert "change-me-" not in message, "the refusal must not echo the secrets"


@pytest.fixture(scope="module", params=list(BOTH_FILES))
def merged(request: pytest.FixtureRequest) -> dict[str, Any]:
    """What `docker compose up` would run, by Compose's own reading of the files."""
    return compose_config(BOTH_FILES[request.param], SECRETS)


@pytest.mark.parametrize("files", list(BOTH_FILES.values()), ids=list(BOTH_FILES))
def test_compose_refuses_to_start_without_each_secret(files: list[Path]) -> None:
    for missing in SECRETS:
        for given in ({k: v for k, v in SECRETS.items() if k != missing}, {**SECRETS, missing: ""}):
            with pytest.raises(ComposeRefused) as refused:
                compose_config(files, given)
            assert f"required variable {missing} is missing a value" in str(refused.value)
            for other in set(SECRETS) - {missing}:
                assert other not in str(refused.value)
    assert compose_config(files, SECRETS)["services"]["app"]


def _port(service: dict[str, Any], target: int) -> dict[str, Any]:
    return next(p for p in service["ports"] if p["target"] == target)


def test_only_the_api_is_published_beyond_the_loopback(merged: dict[str, Any]) -> None:
    services = merged["services"]
    assert exposure_problems(merged) == []
    assert _port(services["jaeger"], 16686)["host_ip"] == "127.0.0.1"
    assert _port(services["prometheus"], 9090)["host_ip"] == "127.0.0.1"
    front = services["lb"] if "lb" in services else services["app"]
    assert _port(front, 8080 if "lb" in services else 8000).get("host_ip", "") == ""
    for name, target in (("jaeger", 16686), ("prometheus", 9090), ("jaeger", 4317)):
        opened = copy.deepcopy(merged)
        _port(opened["services"][name], target).pop("host_ip")
        assert exposure_problems(opened) == [
            f"{name} publishes {target} on every interface of the host (bind it to 127.0.0.1)"
        ]
    redis = copy.deepcopy(merged)
    redis["services"]["redis"]["ports"] = [{"target": 6379, "published": "6379"}]
    assert exposure_problems(redis) == [
        "redis publishes 6379 on every interface of the host (bind it to 127.0.0.1)"
    ]


def _redis_command(merged: dict[str, Any]) -> list[str]:
    command: list[str] = merged["services"]["redis"]["command"]
    return command


def test_redis_asks_for_the_password_the_app_and_its_healthcheck_send(
    merged: dict[str, Any],
) -> None:
    assert redis_auth_problems(merged) == []
    command = _redis_command(merged)
    assert command[command.index("--requirepass") + 1] == SECRETS["REDIS_PASSWORD"]
    app_env = merged["services"]["app"]["environment"]
    assert app_env["RAG_REDIS__URL"] == f"redis://:{SECRETS['REDIS_PASSWORD']}@redis:6379/0"

    open_redis = copy.deepcopy(merged)
    i = _redis_command(open_redis).index("--requirepass")
    del _redis_command(open_redis)[i : i + 2]
    assert redis_auth_problems(open_redis) == [
        "redis runs without --requirepass: anyone on its network reads keys and jobs"
    ]
    no_password = copy.deepcopy(merged)
    no_password["services"]["app"]["environment"]["RAG_REDIS__URL"] = "redis://redis:6379/0"
    assert redis_auth_problems(no_password) == [
        "app's RAG_REDIS__URL does not carry Redis' password"
    ]
    unchecked = copy.deepcopy(merged)
    unchecked["services"]["redis"]["environment"].pop("REDISCLI_AUTH")
    unchecked["services"]["redis"]["healthcheck"]["test"] = ["CMD", "redis-cli", "ping"]
    assert redis_auth_problems(unchecked) == [
        "redis' healthcheck does not authenticate (REDISCLI_AUTH)",
        "redis' healthcheck trusts redis-cli's exit code (0 on NOAUTH too)",
    ]


def test_the_redis_healthcheck_tells_an_answering_redis_from_one_that_refuses_it(
    password_redis: RedisServer,
) -> None:
    """The healthcheck's own command against a real redis-server with a password: healthy
    with the password compose gives it, unhealthy without (redis-cli itself exits 0 on NOAUTH)."""
    password = password_redis.password
    merged = compose_config([COMPOSE], {**SECRETS, "REDIS_PASSWORD": password})
    redis = merged["services"]["redis"]
    check = redis["healthcheck"]["test"]
    assert check[0] == "CMD-SHELL"
    shell = check[1].replace("redis-cli", f"redis-cli -p {password_redis.port}")
    env = {"PATH": os.environ["PATH"]}
    healthy = subprocess.run(["sh", "-c", shell], env={**env, **redis["environment"]})
    refused = subprocess.run(["sh", "-c", shell], env=env)
    wrong = subprocess.run(["sh", "-c", shell], env={**env, "REDISCLI_AUTH": "0" * 32})
    bare = subprocess.run(
        ["redis-cli", "-p", str(password_redis.port), "ping"], capture_output=True, env=env
    )
    assert healthy.returncode == 0
    assert wrong.returncode != 0
    assert refused.returncode != 0
    assert bare.returncode == 0 and b"NOAUTH" in bare.stdout, "why the check greps for PONG"


def test_prometheus_scrapes_the_metrics_with_the_apps_token(merged: dict[str, Any]) -> None:
    prometheus = load_yaml(ROOT / "deploy" / "prometheus.yml")
    assert metrics_auth_problems(merged, prometheus, SECRETS) == []
    job = prometheus["scrape_configs"][0]
    assert job["job_name"] == "rag-app"
    assert job["authorization"]["credentials_file"] == "/run/secrets/metrics_token"

    untokened = copy.deepcopy(merged)
    untokened["services"]["app"]["environment"].pop("RAG_TELEMETRY__METRICS_TOKEN")
    assert metrics_auth_problems(untokened, prometheus, SECRETS) == [
        "the app serves /metrics without a token (RAG_TELEMETRY__METRICS_TOKEN)"
    ]
    bare = copy.deepcopy(prometheus)
    bare["scrape_configs"][0].pop("authorization")
    assert metrics_auth_problems(merged, bare, SECRETS) == [
        "prometheus scrapes the app without a bearer token file (authorization)"
    ]
    elsewhere = copy.deepcopy(prometheus)
    elsewhere["scrape_configs"][0]["authorization"]["credentials_file"] = "/etc/token"
    assert metrics_auth_problems(merged, elsewhere, SECRETS) == [
        "prometheus has no secret mounted at /etc/token"
    ]
    other = copy.deepcopy(merged)
    other["secrets"]["metrics_token"]["environment"] = "REDIS_PASSWORD"
    assert metrics_auth_problems(other, prometheus, SECRETS) == [
        "prometheus' token is not the one the app asks for"
    ]


def test_the_replicas_trust_forwarded_headers_from_the_compose_network_only() -> None:
    merged = compose_config([COMPOSE, SCALE], SECRETS)
    assert proxy_trust_problems(merged) == []
    subnet = merged["networks"]["default"]["ipam"]["config"][0]["subnet"]
    assert merged["services"]["app"]["environment"]["FORWARDED_ALLOW_IPS"] == subnet
    moved = compose_config([COMPOSE, SCALE], {**SECRETS, "NETWORK_SUBNET": "10.99.0.0/24"})
    assert moved["services"]["app"]["environment"]["FORWARDED_ALLOW_IPS"] == "10.99.0.0/24"
    assert moved["networks"]["default"]["ipam"]["config"] == [{"subnet": "10.99.0.0/24"}]
    # One container alone trusts uvicorn's default, the loopback.
    assert (
        "FORWARDED_ALLOW_IPS"
        not in compose_config([COMPOSE], SECRETS)["services"]["app"]["environment"]
    )

    anyone = copy.deepcopy(merged)
    anyone["services"]["app"]["environment"]["FORWARDED_ALLOW_IPS"] = "*"
    assert proxy_trust_problems(anyone) == [
        "the app trusts X-Forwarded-* from any address (FORWARDED_ALLOW_IPS=*)"
    ]
    wider = copy.deepcopy(merged)
    wider["services"]["app"]["environment"]["FORWARDED_ALLOW_IPS"] = "172.16.0.0/12"
    assert proxy_trust_problems(wider) == [
        "FORWARDED_ALLOW_IPS trusts 172.16.0.0/12, outside the compose network"
    ]
    unfixed = copy.deepcopy(merged)
    del unfixed["networks"]["default"]["ipam"]
    assert proxy_trust_problems(unfixed) == [
        "the compose network has no fixed subnet for FORWARDED_ALLOW_IPS to name"
    ]


def _set_env(name: str, value: str) -> Mutation:
    return lambda c: app_env(c).__setitem__(name, value)


def _small_route_to_large(compose: dict[str, Any]) -> None:
    routes = json.loads(app_env(compose)["RAG_ROUTING__ROUTES"])
    routes["small"]["base_url"] = "http://vllm:8000"
    app_env(compose)["RAG_ROUTING__ROUTES"] = json.dumps(routes)


def _drop_flag(service: str, flag: str) -> Mutation:
    def mutate(compose: dict[str, Any]) -> None:
        command = compose["services"][service]["command"]
        compose["services"][service]["command"] = [a for a in command if a != flag]

    return mutate


BROKEN_COMPOSE: list[tuple[str, Mutation, str]] = [
    (
        "traces to localhost",
        _set_env("OTEL_EXPORTER_OTLP_ENDPOINT", "http://localhost:4317"),
        "is not the jaeger service",
    ),
    (
        "grpc to the http port",
        _set_env("OTEL_EXPORTER_OTLP_ENDPOINT", "http://jaeger:4318"),
        "app sends OTLP grpc to port 4318, not 4317",
    ),
    ("redis unchecked", lambda c: c["services"]["redis"].pop("healthcheck"), "redis has no"),
    (
        "app check disabled",
        lambda c: c["services"]["app"].__setitem__("healthcheck", {"disable": True}),
        "app has no healthcheck",
    ),
    (
        "vllm check on /v1/models",
        lambda c: c["services"]["vllm"]["healthcheck"].__setitem__("test", ["CMD", "true"]),
        "vllm's healthcheck does not ask /health",
    ),
    (
        "vllm only started",
        lambda c: c["services"]["app"]["depends_on"]["vllm"].__setitem__(
            "condition", "service_started"
        ),
        "app does not wait for a healthy vllm",
    ),
    (
        "no redis dependency",
        lambda c: c["services"]["app"]["depends_on"].pop("redis"),
        "app does not wait for a healthy redis",
    ),
    (
        "api on another port",
        lambda c: c["services"]["app"].__setitem__("ports", ["8080:8000"]),
        "app does not publish 8000:8000",
    ),
    ("no jaeger ui", lambda c: c["services"]["jaeger"].pop("ports"), "jaeger does not publish"),
    ("loopback only", _set_env("RAG_SERVER__HOST", "127.0.0.1"), "0.0.0.0"),
    ("development", _set_env("RAG_ENVIRONMENT", "development"), "RAG_ENVIRONMENT=production"),
    ("wrong model name", _set_env("RAG_LLM__MODELS", "gpt-4o"), "RAG_LLM__MODELS"),
    ("small route to the large server", _small_route_to_large, "the small route"),
    (
        "no prefix caching",
        _drop_flag("vllm", "--enable-prefix-caching"),
        "vllm runs without --enable-prefix-caching",
    ),
    (
        "no tool choice on cpu",
        _drop_flag("vllm-cpu", "--enable-auto-tool-choice"),
        "vllm-cpu runs without --enable-auto-tool-choice",
    ),
    ("no gpu", lambda c: c["services"]["vllm"].pop("deploy"), "vllm reserves no GPU"),
]


@pytest.mark.parametrize(
    ("mutate", "expected"), [b[1:] for b in BROKEN_COMPOSE], ids=[b[0] for b in BROKEN_COMPOSE]
)
def test_broken_compose_wiring_is_caught(mutate: Mutation, expected: str) -> None:
    compose = copy.deepcopy(load_yaml(COMPOSE))
    mutate(compose)
    problems = compose_problems(compose)
    assert any(expected in p for p in problems), problems


def test_prometheus_scrapes_the_app_and_vllm() -> None:
    prometheus = load_yaml(COMPOSE)["services"]["prometheus"]
    assert "./deploy/prometheus.yml:/etc/prometheus/prometheus.yml:ro" in prometheus["volumes"]
    config = load_yaml(ROOT / "deploy" / "prometheus.yml")
    assert prometheus_problems(config) == []
    without_vllm = copy.deepcopy(config)
    without_vllm["scrape_configs"] = [
        j for j in config["scrape_configs"] if j["job_name"] != "vllm"
    ]
    assert prometheus_problems(without_vllm) == ["prometheus does not scrape vllm:8000"]
    elsewhere = copy.deepcopy(config)
    elsewhere["scrape_configs"][0]["metrics_path"] = "/stats"
    assert prometheus_problems(elsewhere) == ["prometheus does not scrape app:8000"]


BROKEN_DOCKERFILE = [
    ("USER 10001:10001\n", "", "runs as root"),
    ("USER 10001:10001\n", "USER root\n", "runs as root"),
    ("/readyz', timeout=4)\"]", "/healthz', timeout=4)\"]", "no HEALTHCHECK on /readyz"),
    ('"--timeout-graceful-shutdown", "20"]', '"--workers", "1"]', "--timeout-graceful-shutdown"),
    ('CMD ["rag",', 'CMD rag ["rag",', "not in exec form"),
    ("FROM python:${PYTHON_VERSION}-slim\n", "FROM python:${PYTHON_VERSION}\n", "slim"),
    ("COPY pipeline ./pipeline\n", "", "pipeline/ is not copied"),
]


@pytest.mark.parametrize(("old", "new", "expected"), BROKEN_DOCKERFILE)
def test_the_image_is_non_root_healthchecked_and_stops_gracefully(
    old: str, new: str, expected: str
) -> None:
    dockerfile = (ROOT / "Dockerfile").read_text()
    pyproject = load_pyproject()
    assert dockerfile_problems(dockerfile, pyproject) == []
    assert old in dockerfile
    problems = dockerfile_problems(dockerfile.replace(old, new), pyproject)
    assert any(expected in p for p in problems), problems


def test_the_build_context_lets_every_package_in() -> None:
    dockerignore = (ROOT / ".dockerignore").read_text()
    pyproject = load_pyproject()
    assert dockerignore_problems(dockerignore, pyproject) == []
    broken = dockerignore.replace("!retrieval/\n", "")
    assert dockerignore_problems(broken, pyproject) == [
        ".dockerignore keeps retrieval/ out of the build"
    ]


def test_files_the_packages_read_are_installed_into_the_image_too() -> None:
    pyproject = load_pyproject()
    assert package_data_problems(pyproject) == []
    declared = pyproject["tool"]["setuptools"]["package-data"]
    assert declared, "the packages read data files; pyproject.toml must declare them"
    first = next(iter(declared))
    del declared[first]
    assert package_data_problems(pyproject) != []


def test_the_scale_override_runs_replicas_behind_the_load_balancer() -> None:
    scale = load_yaml(SCALE)
    nginx = (ROOT / "deploy" / "nginx.conf").read_text()
    assert scale_problems(scale, nginx) == []
    one = copy.deepcopy(scale)
    one["services"]["app"]["deploy"]["replicas"] = "${APP_REPLICAS:-1}"
    one["services"]["app"]["ports"] = ["8000:8000"]
    assert scale_problems(one, nginx.replace("server app:8000", "server lb:8000")) == [
        "the app replicas still publish a host port (use `ports: !reset []`)",
        "compose.scale.yaml runs 1 app replica(s), not N > 1",
        "nginx does not send requests to app:8000",
    ]
    assert isinstance(scale["services"]["app"]["ports"], Reset)
    worker = scale["services"]["worker"]
    assert worker["extends"] == {"file": "compose.yaml", "service": "app"}
    assert worker["command"] == ["rag", "worker"]
    assert worker["healthcheck"] == {"disable": True}


def test_the_milvus_profile_runs_milvus_with_its_stores_on_the_compose_network_only(
    merged: dict[str, Any],
) -> None:
    services = merged["services"]
    milvus, minio = services["milvus"], services["milvus-minio"]
    for name in ("milvus", "milvus-etcd", "milvus-minio"):
        assert services[name]["profiles"] == ["milvus"], name
        assert not services[name].get("ports"), f"{name} is published"
    assert set(milvus["depends_on"]) == {"milvus-etcd", "milvus-minio"}
    assert all(d["condition"] == "service_healthy" for d in milvus["depends_on"].values())
    # Milvus signs in to MinIO with the MinIO's own credentials, and its endpoints are the
    # services' names on the compose network.
    env, store = milvus["environment"], minio["environment"]
    given = {**SECRETS, "MILVUS_MINIO_PASSWORD": "5e0d" * 8}
    env_given = compose_config([COMPOSE], given)["services"]
    assert env_given["milvus"]["environment"]["MINIO_SECRET_ACCESS_KEY"] == "5e0d" * 8
    assert env_given["milvus-minio"]["environment"]["MINIO_ROOT_PASSWORD"] == "5e0d" * 8
    assert env["MINIO_ACCESS_KEY_ID"] == store["MINIO_ROOT_USER"]
    assert env["ETCD_ENDPOINTS"] == "milvus-etcd:2379"
    assert env["MINIO_ADDRESS"] == "milvus-minio:9000"
    # The app waits for Milvus when the profile runs it, and starts without it otherwise.
    waits = services["app"]["depends_on"]["milvus"]
    assert (waits["condition"], waits["required"]) == ("service_healthy", False)
    # Nothing connects to Milvus unless a URI is given: not in compose's own wiring.
    assert "RAG_RETRIEVAL__MILVUS_URI" not in app_env(merged)
