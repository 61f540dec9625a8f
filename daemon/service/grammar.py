"""Constrained decoding for `response_format`: JSON objects and JSON schemas, by
llguidance (the grammar library of Guidance, in Rust, CPU-only, no Python dependencies).

`Grammars` is built once per tokenizer (llguidance's view of the vocabulary takes a
moment for a large one) and turns an OpenAI `response_format` into a factory of
per-choice `JsonConstraint`s; the engine asks each one for the mask of allowed tokens
before it samples and tells it the token it sampled (daemon.service.engine.Constraint).
The mask depends only on the tokens accepted so far, so a constrained request's tokens
are the same alone or batched, like any other.

{"type": "json_object"} is any JSON object ({"type": "object"} as a schema);
{"type": "json_schema", "json_schema": {"name", "schema", "strict"}} follows the
schema. llguidance's JSON grammar allows no whitespace between tokens beyond what the
schema needs ("whitespace_flexible": false), as OpenAI's structured outputs do.
"""
from __future__ import annotations

import json

import llguidance
import numpy as np

from ext.tokenizer import Tokenizer

JSON_OPTIONS = {"whitespace_flexible": False}


class GrammarError(ValueError):
    """A response_format that cannot be compiled; the message says why."""


class JsonConstraint:
    """One choice's matcher (see daemon.service.engine.Constraint)."""

    def __init__(self, tokenizer: llguidance.LLTokenizer, grammar: str, vocab_size: int):
        self._matcher = llguidance.LLMatcher(tokenizer, grammar)
        self._vocab_size = vocab_size
        if self._matcher.is_error():
            raise GrammarError(self._matcher.get_error())

    def mask(self) -> np.ndarray:
        """[V] bool: the tokens the grammar allows next."""
        words = np.frombuffer(self._matcher.compute_bitmask(), np.uint8)
        bits = np.unpackbits(words, bitorder="little").astype(bool)
        out = np.zeros(self._vocab_size, bool)
        n = min(self._vocab_size, bits.size)
        out[:n] = bits[:n]
        if self._matcher.is_error():
            raise ValueError(f"grammar: {self._matcher.get_error()}")
        return out

    def accept(self, token: int) -> None:
        if not self._matcher.consume_token(token):
            raise ValueError(f"grammar: token {token} refused: {self._matcher.get_error()}")

    def done(self) -> bool:
        """The output is complete: nothing but the end may follow."""
        return self._matcher.is_stopped()


class Grammars:
    """Compiles response formats against one tokenizer.

    tokenizer: the model's. vocab_size: the model's (masks have this length; ids the
    tokenizer does not know are never allowed). eos_ids: the ids that end an answer
    (the grammar allows them once the JSON is complete).
    """

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_ids: frozenset[int]):
        eos = sorted(eos_ids) or None
        self._tokenizer = llguidance.LLTokenizer(tokenizer.to_json(), n_vocab=vocab_size,
                                                 eos_token=eos)
        self.vocab_size = vocab_size

    def compile(self, response_format: dict):
        """A factory of JsonConstraint for `response_format` (OpenAI's shape), or None
        for {"type": "text"}. Raises GrammarError naming what is wrong."""
        kind = response_format.get("type")
        if kind == "text":
            return None
        if kind == "json_object":
            schema: dict = {"type": "object"}
        elif kind == "json_schema":
            spec = response_format.get("json_schema")
            if not isinstance(spec, dict):
                raise GrammarError("'response_format.json_schema' must be an object with a "
                                   "'schema'")
            schema = spec.get("schema", {})
            if not isinstance(schema, (dict, bool)):
                raise GrammarError("'response_format.json_schema.schema' must be a JSON schema "
                                   "(an object)")
        else:
            raise GrammarError(f"'response_format.type' must be 'text', 'json_object' or "
                               f"'json_schema', got {kind!r}")
        try:
            grammar = llguidance.LLMatcher.grammar_from_json_schema(
                json.dumps(schema), defaults=JSON_OPTIONS)
        except (ValueError, TypeError) as e:
            raise GrammarError(f"the JSON schema cannot be used: {e}") from None
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
            grammar, self._tokenizer)
        if is_error:
            raise GrammarError(f"the JSON schema cannot be used: {messages[0]}")
        tokenizer, vocab = self._tokenizer, self.vocab_size
        return lambda: JsonConstraint(tokenizer, grammar, vocab)
