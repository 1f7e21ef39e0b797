"""What the model server's grammar cache tells a tenant who times its own structured requests,
with the schemas salted per tenant (as the service sends them) and with one cache for all.

    .venv/bin/python -m bench.grammar_salt [--rounds 15]

The real CPU vLLM (started by the run unless ``RAG_TEST_VLLM_URL`` names one), called directly
with what the service sends it: each round a schema no earlier round sent (an invoice form of
twelve fields; its property names carry the round's number), first for tenant A, then the
same schema for tenant B. Arm "one cache for all": both send the caller's schema as it is
(``RAG_LLM__PREFIX_CACHE_SALT=off``), so B's grammar is the one A's request compiled. Arm
"salted": each sends it through ``salted_schema`` with its own salt (the default). Time to
the first streamed token at the client, one token asked; the arms alternate, and each round's
schema is new to both. Medians over the rounds, and B / A within each round.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import httpx

from pipeline.context import Principal
from pipeline.model.salt import PrefixCacheSalt, salted_schema
from tests.support.servers import VLLMServer

QUESTION = "Write the invoice of order 7 as JSON."


def invoice(n: int) -> dict[str, Any]:
    line = {
        "type": "object",
        "properties": {
            f"sku_{n}": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
            "quantity": {"type": "integer", "minimum": 1, "maximum": 999},
            "unit_price": {"type": "number", "minimum": 0},
            "note": {"type": "string", "maxLength": 80},
        },
        "required": [f"sku_{n}", "quantity", "unit_price"],
        "additionalProperties": False,
    }
    return {
        "type": "object",
        "properties": {
            f"invoice_{n}": {"type": "string", "pattern": "^INV-[0-9]{6}$"},
            "issued": {"type": "string", "format": "date"},
            "currency": {"enum": ["EUR", "USD", "GBP", "CHF", "JPY"]},
            "customer": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 60},
                    "email": {"type": "string", "format": "email"},
                    "vat": {"type": "string", "pattern": "^[A-Z]{2}[0-9A-Z]{8,12}$"},
                },
                "required": ["name"],
                "additionalProperties": False,
            },
            "lines": {"type": "array", "items": line, "minItems": 1, "maxItems": 20},
            "total": {"type": "number", "minimum": 0},
            "status": {"enum": ["draft", "open", "paid", "void"]},
            "paid_on": {"type": ["string", "null"], "format": "date"},
        },
        "required": [f"invoice_{n}", "currency", "customer", "lines", "total", "status"],
        "additionalProperties": False,
    }


def request(model: str, schema: dict[str, Any], salt: str | None) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "messages": [{"role": "user", "content": QUESTION}],
        "max_tokens": 1,
        "temperature": 0,
        "stream": True,
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "inv", "schema": schema},
        },
    }
    if salt is not None:
        body["cache_salt"] = salt
    return salted_schema(body)


def first_token_ms(client: httpx.Client, url: str, body: dict[str, Any]) -> float:
    started = time.perf_counter()
    elapsed = None
    with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        for line in response.iter_lines():  # read to the end: the next request starts alone
            if elapsed is None and line.startswith("data: ") and '"content"' in line:
                elapsed = (time.perf_counter() - started) * 1000
    if elapsed is None:
        raise RuntimeError("no token came back")
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    salt = PrefixCacheSalt(b"bench")
    salts = {t: salt(Principal(t, "u", frozenset({"chat"}), "k")) for t in ("acme", "beta")}
    vllm = VLLMServer()
    vllm.start()
    try:
        with httpx.Client(timeout=120.0) as client:
            model = client.get(f"{vllm.url}/v1/models").json()["data"][0]["id"]
            first_token_ms(client, vllm.url, request(model, invoice(-1), None))  # warm up
            times: dict[str, dict[str, list[float]]] = {
                arm: {"A": [], "B": []} for arm in ("one cache for all", "salted")
            }
            for n in range(args.rounds):
                arms = list(times.items())
                for arm, found in arms if n % 2 == 0 else arms[::-1]:
                    schema = invoice(n * 2 + (arm == "salted"))
                    for tenant, who in (("acme", "A"), ("beta", "B")):
                        tenant_salt = salts[tenant] if arm == "salted" else None
                        body = request(model, schema, tenant_salt)
                        found[who].append(first_token_ms(client, vllm.url, body))
    finally:
        vllm.stop()
    print(f"\n### time to first token, {args.rounds} new schemas an arm (median ms)\n")
    print("| arm | tenant A (compiles it) | tenant B, the same schema next | B / A |")
    print("| --- | --- | --- | --- |")
    for arm, found in times.items():
        ratio = statistics.median(b / a for a, b in zip(found["A"], found["B"], strict=True))
        print(
            f"| {arm} | {statistics.median(found['A']):.1f} | "
            f"{statistics.median(found['B']):.1f} | {ratio:.2f} |"
        )
    print(json.dumps(times))


if __name__ == "__main__":
    main()
