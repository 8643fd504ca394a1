"""Tokenizers: load one from a local HF directory, or train a tiny one for tests and CPU demos.

Both paths end in an ``AutoTokenizer`` loaded from disk, so tests and demos exercise the same loading
code as a real run (no hub access: ``local_files_only``).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

__all__ = ["CHATML_TEMPLATE", "TINY_SPECIAL_TOKENS", "build_tiny_tokenizer", "load_tokenizer"]

logger = logging.getLogger(__name__)

# ChatML, as Qwen2 uses it: the assistant turn ends with <|im_end|>, which is therefore the eos token.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
PAD, IM_START, IM_END, UNK = "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<unk>"
TINY_SPECIAL_TOKENS = (PAD, IM_START, IM_END, UNK)
# Text the chat template adds around every message; the tokenizer must be able to encode it.
_TEMPLATE_TEXT = ("system\n", "user\n", "assistant\n")


def load_tokenizer(path: str | Path, trust_remote_code: bool = False) -> PreTrainedTokenizerBase:
    """Load a tokenizer from a local directory; give it a pad token when it has none.

    Prompts are left-padded, so a missing pad token is filled with the eos token (the usual choice for
    decoder-only models; padded positions are masked out everywhere).
    """
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(
            f"tokenizer directory {str(path)!r} does not exist (data.tokenizer or "
            f"actor_rollout_ref.model.path)"
        )
    if trust_remote_code:
        logger.warning("data.trust_remote_code=true: loading the tokenizer of %s runs the Python code that "
                       "directory ships; set it only for a directory you trust", path)
    tokenizer = AutoTokenizer.from_pretrained(
        path, trust_remote_code=trust_remote_code, local_files_only=True
    )
    if tokenizer.pad_token_id is None:
        if tokenizer.eos_token is None:
            raise ValueError(
                f"tokenizer at {str(path)!r} has neither a pad nor an eos token; add a pad token"
            )
        tokenizer.pad_token = tokenizer.eos_token
        logger.info(
            "tokenizer at %s has no pad token; using the eos token %r (id %d) for padding",
            path,
            tokenizer.eos_token,
            tokenizer.pad_token_id,
        )
    if tokenizer.chat_template is None:
        logger.warning(
            "tokenizer at %s has no chat template; datasets with chat prompts cannot be tokenized", path
        )
    return tokenizer


def build_tiny_tokenizer(
    out_dir: str | Path, texts: Iterable[str], vocab_size: int = 128
) -> PreTrainedTokenizerBase:
    """Train a small byte-level BPE tokenizer on ``texts`` and save it as an HF tokenizer directory.

    - Digits are always single tokens (split before BPE), so digit-string tasks map one digit to one token.
    - The alphabet is only the characters seen in ``texts`` (plus the chat template's own text): a small
      vocabulary lets a randomly initialised model hit useful tokens early. Unseen characters become <unk>.
    - Special tokens: <|endoftext|> (pad), <|im_start|>, <|im_end|> (eos), <unk>; ChatML chat template.
    ``vocab_size`` is a target: the result is never smaller than special tokens + alphabet, and smaller
    than ``vocab_size`` when no pair is left to merge.
    Returns the tokenizer re-loaded from ``out_dir`` through :func:`load_tokenizer`.
    """
    corpus = [*texts, *_TEMPLATE_TEXT]
    if len(corpus) == len(_TEMPLATE_TEXT):
        raise ValueError("build_tiny_tokenizer needs at least one training text")
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    model = Tokenizer(models.BPE(unk_token=UNK))
    model.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    model.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(TINY_SPECIAL_TOKENS),
        initial_alphabet=[],
        show_progress=False,
    )
    model.train_from_iterator(corpus, trainer)

    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=model,
        pad_token=PAD,
        eos_token=IM_END,
        unk_token=UNK,
        additional_special_tokens=[IM_START],
        chat_template=CHATML_TEMPLATE,
    )
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    # The chat template goes into tokenizer_config.json (not a separate .jinja file) so older
    # transformers versions, as pinned by inference engines, read it too.
    wrapped.save_pretrained(out_dir, save_jinja_files=False)
    return load_tokenizer(out_dir)
