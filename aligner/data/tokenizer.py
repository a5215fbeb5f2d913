"""Tokenizers: load a local Hugging Face tokenizer, or train the tiny byte-level BPE used by examples and tests.

Conventions: tokenizers only ever load from a local directory (never the Hub). A loaded tokenizer always
has `eos_token_id`, and `pad_token_id` (the eos token when the tokenizer defines no pad token).
The tiny tokenizer has ids `<pad>`=0, `<eos>`=1, `<bos>`=2, `<unk>`=3, then the role markers
`<|user|>`, `<|assistant|>`, `<|system|>`, then the 256 byte symbols and the learned merges; its chat
template renders every message as `<|role|>content<eos>` (no bos), and the generation prompt is `<|assistant|>`.
"""
from __future__ import annotations

from pathlib import Path
from typing import Iterable

from aligner.data.jsonl import DataError
from aligner.errors import UsageError

# transformers and tokenizers are imported inside the functions: aligner.data imports this module, and the
# CLI process imports aligner.data (through aligner.generation.cli) before it launches ranks.

SPECIAL_TOKENS = ("<pad>", "<eos>", "<bos>", "<unk>")
ROLE_TOKENS = ("<|user|>", "<|assistant|>", "<|system|>")
TINY_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>' + message['content'] + '<eos>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)
_TOKENIZER_FILES = ("tokenizer_config.json", "tokenizer.json", "tokenizer.model", "vocab.json")


def load_tokenizer(path: str | Path):
    """Load the Hugging Face tokenizer saved in the local directory `path`; raises DataError naming `path`."""
    from transformers import AutoTokenizer  # heavy: deferred for the CLI (see the note above)

    if not Path(path).is_dir():
        what = "is not a directory" if Path(path).exists() else "does not exist"
        raise DataError(f"tokenizer directory {path} {what}")
    if not any((Path(path) / name).is_file() for name in _TOKENIZER_FILES):
        raise DataError(f"tokenizer directory {path} holds none of {', '.join(_TOKENIZER_FILES)}; "
                        f"expected a directory written by save_pretrained")
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except Exception as e:  # transformers raises OSError, ValueError, KeyError, ... depending on what is wrong
        raise DataError(f"cannot load a Hugging Face tokenizer from {path}: {e}") from e
    if tokenizer.eos_token_id is None:
        raise DataError(f"tokenizer at {path} defines no eos token; one is needed to end samples")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def model_vocab_size(model_cfg, tokenizer, tokenizer_path) -> int:
    """`model.vocab_size`, or the tokenizer's size when unset; never fewer ids than the tokenizer has."""
    vocab_size = model_cfg.vocab_size or len(tokenizer)
    if vocab_size < len(tokenizer):
        raise UsageError(f"model.vocab_size={vocab_size} is smaller than the tokenizer's {len(tokenizer)} tokens",
                         f"tokenizer.path={tokenizer_path}", "leave model.vocab_size unset (the tokenizer's size) "
                         "or raise it")
    return vocab_size


def build_tiny_tokenizer(texts: Iterable[str], out_dir: str | Path, vocab_size: int = 512) -> Path:
    """Train a byte-level BPE on `texts` (deterministic: same texts, same vocab and merges), save it as a
    Hugging Face tokenizer with the tiny chat template in `out_dir`, and return `out_dir`."""
    # heavy: deferred for the CLI (see the note above)
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = list(SPECIAL_TOKENS + ROLE_TOKENS)
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if vocab_size < len(specials) + len(alphabet):
        raise ValueError(f"vocab_size={vocab_size} is too small: the special tokens and the byte alphabet "
                         f"alone take {len(specials) + len(alphabet)}")
    backend = Tokenizer(models.BPE(unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=specials,
                                  initial_alphabet=alphabet, show_progress=False)
    backend.train_from_iterator(texts, trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>", unk_token="<unk>",
        additional_special_tokens=list(ROLE_TOKENS), chat_template=TINY_CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(str(out_dir))
    return out_dir
