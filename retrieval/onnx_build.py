"""Build all-MiniLM-L6-v2 for ONNX Runtime, once: export, fuse, quantize to int8.

    .venv/bin/python -m retrieval.onnx_build        # or `make embedder`; idempotent

The only part of the ONNX path that needs torch: it runs at build time (or, when the files are
missing at start-up, in a child process that `retrieval.onnx_embeddings` starts), never in the
API process. Output, under ``$RAG_HOME/embedder/all-MiniLM-L6-v2-<key>/``, where the key hashes
the source model's files and this recipe's version, so changing either builds afresh:

- ``model.onnx``: the transformer with mean pooling over the attention mask and L2
  normalisation inside the graph (inputs ``input_ids``, ``attention_mask``, ``token_type_ids``;
  output ``embedding``, (n, 384) unit vectors), its attention, layer norms and GELUs fused by
  ONNX Runtime's transformer optimizer;
- ``model-int8.onnx``: the same with its matrix multiplications' weights dynamically quantized
  to int8, per output channel and in 7 bits (``reduce_range``: this CPU has no VNNI, where 8-bit
  products can saturate);
- ``tokenizer.json``, ``build.json`` (the stamp, written last: a build cut short is redone).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

from retrieval.onnx_embeddings import (
    FP32_FILE,
    INT8_FILE,
    MAX_SEQ_LENGTH,
    STAMP_FILE,
    built_dir,
    source_dir,
)


def export(source: Path, target: Path) -> None:
    """The transformer plus pooling and normalisation as one ONNX graph (fp32, unfused)."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"
    import torch
    from transformers import AutoModel

    # "eager" attention: the plain matmul-softmax pattern that ORT's optimizer fuses.
    model = AutoModel.from_pretrained(str(source), attn_implementation="eager").eval()

    class Pooled(torch.nn.Module):
        def __init__(self, encoder: Any) -> None:
            super().__init__()
            self.encoder = encoder

        def forward(self, input_ids: Any, attention_mask: Any, token_type_ids: Any) -> Any:
            hidden = self.encoder(
                input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids
            ).last_hidden_state
            mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
            pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
            return torch.nn.functional.normalize(pooled, p=2, dim=1)

    sample = torch.ones((2, 16), dtype=torch.int64)
    axes = {0: "batch", 1: "tokens"}
    # The TorchScript exporter: the dynamo one needs onnxscript, and this graph is plain. Its
    # warnings (deprecation; a mask shape check traced as a constant; index with negative
    # indices) do not apply: tests/retrieval/test_onnx_embeddings.py compares the vectors with
    # sentence-transformers' at other batch sizes and lengths, truncation included.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _export(torch, Pooled(model), sample, axes, target)


def _export(torch: Any, model: Any, sample: Any, axes: dict[int, str], target: Path) -> None:
    torch.onnx.export(
        model,
        (sample, sample, torch.zeros_like(sample)),
        str(target),
        dynamo=False,
        input_names=["input_ids", "attention_mask", "token_type_ids"],
        output_names=["embedding"],
        dynamic_axes={
            "input_ids": axes,
            "attention_mask": axes,
            "token_type_ids": axes,
            "embedding": {0: "batch"},
        },
        opset_version=17,
        do_constant_folding=True,
    )


def optimize(raw: Path, target: Path) -> dict[str, int]:
    """ORT's BERT fusions (attention, skip layer norm, bias GELU); returns the fused op counts."""
    from onnxruntime.transformers import optimizer

    model = optimizer.optimize_model(
        str(raw), model_type="bert", num_heads=12, hidden_size=384, opt_level=1, use_gpu=False
    )
    model.save_model_to_file(str(target))
    return {k: v for k, v in model.get_fused_operator_statistics().items() if v}


def quantize(fp32: Path, target: Path) -> None:
    """Dynamic int8 weights (activations quantized per call), per channel, 7-bit."""
    import onnx
    from onnxruntime.quantization import QuantType, quantize_dynamic

    quantize_dynamic(
        str(fp32),
        str(target),
        weight_type=QuantType.QInt8,
        per_channel=True,
        reduce_range=True,
        # The fused ops' outputs have no inferred type; they are all float.
        extra_options={"DefaultTensorType": onnx.TensorProto.FLOAT},
    )


def build(force: bool = False) -> Path:
    """Build into `built_dir()` unless a complete build is there; return the directory."""
    source = source_dir()
    final = built_dir(source)
    if (final / STAMP_FILE).is_file() and not force:
        return final
    started = time.perf_counter()
    final.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(
        dir=final.parent, prefix=".building-", ignore_cleanup_errors=True
    ) as tmp:
        work = Path(tmp)
        export(source, work / "raw.onnx")
        fused = optimize(work / "raw.onnx", work / FP32_FILE)
        quantize(work / FP32_FILE, work / INT8_FILE)
        (work / "raw.onnx").unlink()
        shutil.copy(source / "tokenizer.json", work / "tokenizer.json")
        stamp = {
            "source": str(source),
            "max_seq_length": MAX_SEQ_LENGTH,
            "fused": fused,
            "seconds": round(time.perf_counter() - started, 1),
        }
        (work / STAMP_FILE).write_text(json.dumps(stamp, indent=2) + "\n")
        if (final / STAMP_FILE).is_file() and not force:
            return final  # another builder finished first: theirs is as good as ours
        if final.exists():
            shutil.rmtree(final)  # a forced rebuild, or an older build cut short
        work.chmod(0o755)  # mkdtemp makes it private; other users (a container's) read it
        work.rename(final)
    return final


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--force", action="store_true", help="rebuild even if built")
    args = parser.parse_args(argv)
    print(build(force=args.force))
    return 0


if __name__ == "__main__":
    sys.exit(main())
