"""compose.yaml, compose.scale.yaml, the Dockerfile, .env.example and Prometheus's config wired
as the service needs them; each check is also run on a broken copy, and must fail there.

No Docker engine runs here: `make compose-check` runs Compose's own parser and the compose JSON
schema over the same files, and these tests check what a schema cannot (which service the
traces go to, what waits for what, that every setting is documented).
"""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel, Field

from app.settings import Settings
from tests.deploy.wiring import (
    ROOT,
    Reset,
    compose_problems,
    direct_reads,
    dockerfile_problems,
    dockerignore_problems,
    env_example_problems,
    env_names,
    environment,
    interpolated_names,
    load_pyproject,
    load_yaml,
    otel_names,
    package_data_problems,
    prometheus_problems,
    scale_problems,
)

COMPOSE = ROOT / "compose.yaml"
SCALE = ROOT / "compose.scale.yaml"
ENV_EXAMPLE = ROOT / ".env.example"
Mutation = Callable[[dict[str, Any]], None]


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


def test_the_app_accepts_its_compose_environment_as_production_settings(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name in list(os.environ):
        if name.startswith(("RAG_", "OTEL_")):
            monkeypatch.delenv(name)
    for name, value in environment(load_yaml(COMPOSE)["services"]["app"]).items():
        monkeypatch.setenv(name, value)
    settings = Settings(_env_file=None)
    assert settings.environment == "production"
    assert settings.server.host == "0.0.0.0"
    assert settings.redis.url == "redis://redis:6379/0"
    assert settings.llm.base_url == "http://vllm:8000"
    routes = settings.routing.resolved(settings.llm)
    assert routes["small"].base_url == "http://vllm-small:8000"
    assert routes["large"].base_url == "http://vllm:8000"
    assert routes["large"].model == settings.llm.models[0]


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
    ('CMD ["uvicorn",', 'CMD uvicorn ["uvicorn",', "not in exec form"),
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
