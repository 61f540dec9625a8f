"""make-model: random-weight checkpoints in the exact Hugging Face layout, for tests and
benchmarks (make.py; what each family holds: families.py; shards: shards.py; the
routing-skew construction: skew.py; tokenizer files: tokenizer.py). Imports nothing of
ext/ outside makemodel/: it shares no code with the reader it tests.

The names below but ARCHITECTURES load their module (and numpy, tokenizers) when first
asked for, so that `moed make-model --help` can offer the architectures without them."""
import importlib

from ext.makemodel.families import ARCHITECTURES

_PARTS = {"DEFAULT_SHARD_SIZE": "make", "make_model": "make",
          "CHATML_TEMPLATE": "tokenizer", "QWEN3_TEMPLATE": "tokenizer", "GLM45_TEMPLATE": "tokenizer",
          "DEEPSEEK_V31_TEMPLATE": "tokenizer", "GPT_OSS_TEMPLATE": "tokenizer", "MIXTRAL_TEMPLATE": "tokenizer",
          "QWEN15_TEMPLATE": "tokenizer", "OLMOE_TEMPLATE": "tokenizer", "CHAT_TEMPLATES": "tokenizer",
          "HARMONY_TOKENS": "tokenizer", "SPECIAL_TOKENS": "tokenizer",
          "build_tokenizer": "tokenizer"}

__all__ = ["ARCHITECTURES", "CHATML_TEMPLATE", "CHAT_TEMPLATES", "DEEPSEEK_V31_TEMPLATE", "DEFAULT_SHARD_SIZE",
           "GLM45_TEMPLATE", "GPT_OSS_TEMPLATE", "HARMONY_TOKENS", "MIXTRAL_TEMPLATE", "OLMOE_TEMPLATE",
           "QWEN15_TEMPLATE", "QWEN3_TEMPLATE", "SPECIAL_TOKENS", "build_tokenizer", "make_model"]


def __getattr__(name: str):
    part = _PARTS.get(name)
    if part is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{part}"), name)


def __dir__() -> list[str]:
    return sorted({*globals(), *_PARTS})
