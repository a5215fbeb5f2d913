"""The data layer: JSONL reading, tokenizers, synthetic arithmetic data, SFT samples, global batches.

Pure Python + torch + transformers/tokenizers (no megatron). Each module's docstring states its conventions.
"""
from aligner.data.jsonl import DataError, LoadStats, TokenizedDataset, read_jsonl
from aligner.data.loader import GlobalBatchSampler, collate, pad_length, split_for_rank
from aligner.data.sft import Sample, detect_format, load_sft_dataset, tokenize_chat, tokenize_input_output
from aligner.data.tokenizer import build_tiny_tokenizer, load_tokenizer

__all__ = ["DataError", "LoadStats", "TokenizedDataset", "read_jsonl", "GlobalBatchSampler", "collate", "pad_length", "split_for_rank", "Sample",
           "detect_format", "load_sft_dataset", "tokenize_chat", "tokenize_input_output",
           "build_tiny_tokenizer", "load_tokenizer"]
