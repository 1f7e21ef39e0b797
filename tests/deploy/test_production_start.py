"""The image's start command (the Dockerfile's CMD, a real uvicorn process) in production: it
refuses to start with anything left open, naming each problem at once; with what compose gives
it, it starts, reaches a Redis that asks for a password, and serves /metrics to the token only."""

from __future__ import annotations

import base64
import os
import secrets
import subprocess
from pathlib import Path

import httpx

from tests.deploy.test_graceful_shutdown import image_command
from tests.support.servers import RedisServer, free_port, wait_for

# What the service answers any caller of /metrics without the token: a missing API key's 401.
REFUSED = {
    "error": {
        "message": "Invalid or missing metrics token.",
        "type": "authentication_error",
        "param": None,
        "code": "invalid_api_key",
    }
}


def production_env(tmp_path: Path, **settings: str) -> dict[str, str]:
    """A production process environment: none of this one's RAG_*, OTEL_* or proxy settings,
    no model server, no retrieval (nothing here needs them), plus `settings`."""
    env = {
        name: value
        for name, value in os.environ.items()
        if not name.startswith(("RAG_", "OTEL_")) and name != "FORWARDED_ALLOW_IPS"
    }
    env |= {
        "RAG_ENVIRONMENT": "production",
        "RAG_LLM__BASE_URL": f"http://127.0.0.1:{free_port()}",
        "RAG_RETRIEVAL__ENABLED": "false",
        "RAG_RETRIEVAL__INDEX_DIR": str(tmp_path / "indexes"),
        "RAG_JOBS__WORKERS": "0",
        "OTEL_TRACES_EXPORTER": "none",
        "HF_HUB_OFFLINE": "1",
    }
    return env | settings


def test_production_refuses_to_start_with_anything_left_open(tmp_path: Path) -> None:
    env = production_env(
        tmp_path,
        RAG_REDIS__URL="redis://redis:6379/0",
        RAG_DEV_API_KEY="rag-dev.s3cret-value",
        FORWARDED_ALLOW_IPS="*",
    )
    # cwd: a developer's .env stays out of it.
    done = subprocess.run(
        image_command(free_port()),
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode != 0
    for problem in (
        "a development key is configured (RAG_DEV_API_KEY)",
        "webhook signing secrets would be stored in plaintext",
        "Redis is reached without a password (RAG_REDIS__URL has none)",
        "/metrics is served without a token (set RAG_TELEMETRY__METRICS_TOKEN",
        "uvicorn trusts X-Forwarded-* from any address (FORWARDED_ALLOW_IPS=*",
    ):
        assert problem in done.stderr, done.stderr[-2000:]
    assert "s3cret-value" not in done.stderr + done.stdout


def _healthy(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def test_production_starts_with_a_password_for_redis_and_a_token_for_metrics(
    tmp_path: Path, password_redis: RedisServer
) -> None:
    token = secrets.token_hex(32)
    env = production_env(
        tmp_path,
        RAG_REDIS__URL=password_redis.url,
        RAG_TELEMETRY__METRICS_TOKEN=token,
        RAG_JOBS__WEBHOOK_SECRET_KEY=base64.b64encode(secrets.token_bytes(32)).decode(),
        FORWARDED_ALLOW_IPS="172.28.0.0/16",
    )
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    log = (tmp_path / "server.log").open("wb")
    server = subprocess.Popen(image_command(port), env=env, cwd=tmp_path, stdout=log, stderr=log)
    try:
        wait_for(lambda: _healthy(port), 180, "the production service", step=0.5)
        ready = httpx.get(f"{base}/readyz", timeout=10)
        anonymous = httpx.get(f"{base}/metrics", timeout=10)
        wrong = httpx.get(f"{base}/metrics", headers={"Authorization": f"Bearer {token[:-1]}x"})
        scraped = httpx.get(f"{base}/metrics", headers={"Authorization": f"Bearer {token}"})
    finally:
        server.terminate()
        server.wait(30)
        log.close()
    # Redis asked for its password and got it from RAG_REDIS__URL (the model server is absent).
    assert ready.json()["checks"]["redis"] == "ok", ready.text
    for refused in (anonymous, wrong):
        assert refused.status_code == 401
        assert refused.json() == REFUSED
        assert "rag_http" not in refused.text
    assert scraped.status_code == 200
    assert "rag_http_request_duration_seconds" in scraped.text
    logged = (tmp_path / "server.log").read_text()
    assert password_redis.password not in logged and token not in logged
