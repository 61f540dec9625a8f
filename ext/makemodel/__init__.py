"""make-model: random-weight checkpoints in the exact Hugging Face layout, for tests and
benchmarks (make.py; what each family holds: families.py; shards: shards.py; the
routing-skew construction: skew.py; tokenizer files: tokenizer.py). Imports nothing of
ext/ outside makemodel/: it shares no code with the reader it tests."""
from ext.makemodel.families import ARCHITECTURES
from ext.makemodel.make import DEFAULT_SHARD_SIZE, make_model
from ext.makemodel.tokenizer import CHATML_TEMPLATE, SPECIAL_TOKENS, build_tokenizer

__all__ = ["ARCHITECTURES", "CHATML_TEMPLATE", "DEFAULT_SHARD_SIZE", "SPECIAL_TOKENS",
           "build_tokenizer", "make_model"]
