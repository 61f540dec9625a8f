"""A tool-call grammar against a checkpoint's own tokenizer, as the grammar workers compile
it: the tests of each format's grammar (tests/daemon/api/test_tool_calls*.py) share this."""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import llguidance
import tokenizers

from daemon.api.tools import LarkText


def matcher(model_dir: Path, grammar: Callable[[LarkText], str]):
    """The tokenizer and a matcher of grammar(LarkText of the tokenizer's added tokens)."""
    text = (model_dir / "tokenizer.json").read_text()
    tok = tokenizers.Tokenizer.from_str(text)
    ll = llguidance.LLTokenizer(text, n_vocab=tok.get_vocab_size())
    lark = grammar(LarkText({t.content: i for i, t in tok.get_added_tokens_decoder().items()}))
    return tok, llguidance.LLMatcher(ll, llguidance.LLMatcher.grammar_from_lark(lark), log_level=0)


def takes_whole(tok, m, text: str) -> bool:
    """Whether the matcher takes every token of `text` and then stops (a whole answer)."""
    assert not m.is_error(), m.get_error()
    took = all(m.consume_token(t) for t in tok.encode(text, add_special_tokens=False).ids)
    return took and m.is_stopped()
