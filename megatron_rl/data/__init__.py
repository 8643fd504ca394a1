"""Data: verl-format prompt datasets (text, images and videos), a resumable loader of DataProto batches, tokenizers,
processors, tiny test checkpoints, synthetic tasks."""

from megatron_rl.data.dataset import RLDataset
from megatron_rl.data.loader import ResumableDataLoader, collate_to_dataproto, make_dataloader
from megatron_rl.data.multimodal import load_processor
from megatron_rl.data.rows import MalformedRowError
from megatron_rl.data.tokenizer import build_tiny_tokenizer, load_tokenizer
from megatron_rl.data.vision_checkpoint import build_tiny_vl_checkpoint

__all__ = [
    "MalformedRowError",
    "RLDataset",
    "ResumableDataLoader",
    "build_tiny_tokenizer",
    "build_tiny_vl_checkpoint",
    "collate_to_dataproto",
    "load_processor",
    "load_tokenizer",
    "make_dataloader",
]
