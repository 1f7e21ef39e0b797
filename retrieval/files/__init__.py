"""Document files in: what a file is (`kinds`), its text with its structure (`convert`), and
conversion in worker processes killed at a time limit (`pool`)."""

from retrieval.files.convert import Converted, convert
from retrieval.files.kinds import EXTENSIONS, FileRejected, Kind, ZipLimits, sniff
from retrieval.files.pool import ConverterPool, PoolBusy

__all__ = [
    "EXTENSIONS",
    "Converted",
    "ConverterPool",
    "FileRejected",
    "Kind",
    "PoolBusy",
    "ZipLimits",
    "convert",
    "sniff",
]
