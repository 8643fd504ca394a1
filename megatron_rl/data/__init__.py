"""Data: verl-format prompt datasets, a resumable loader of DataProto batches, tokenizers, synthetic tasks."""

from megatron_rl.data.dataset import RLDataset
from megatron_rl.data.loader import ResumableDataLoader, collate_to_dataproto, make_dataloader
from megatron_rl.data.rows import MalformedRowError
from megatron_rl.data.tokenizer import build_tiny_tokenizer, load_tokenizer

__all__ = [
    "MalformedRowError",
    "RLDataset",
    "ResumableDataLoader",
    "build_tiny_tokenizer",
    "collate_to_dataproto",
    "load_tokenizer",
    "make_dataloader",
]
