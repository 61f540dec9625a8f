"""Tests for ext.tokenizer: encode/decode, streaming decode, chat templates, stop ids."""

import json
from pathlib import Path

import pytest

from ext.makemodel import CHATML_TEMPLATE, build_tokenizer
from ext.tokenizer import (
    ChatTemplateError,
    Tokenizer,
    TokenizerFilesError,
    stop_token_ids,
)

TEXTS = [
    "Hello, world! The router picks the top k experts.",
    "Grüße aus München — café, naïve, piña.",
    "日本語の文章と한국어 and emoji 🙂🚀 mixed in.",
    "  leading spaces\nand\ttabs  ",
]


def _write_model_dir(path: Path, tokenizer_config: dict | None = None, **json_files) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "tokenizer.json").write_text(build_tokenizer(512).to_str(), encoding="utf-8")
    if tokenizer_config is not None:
        (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config), encoding="utf-8")
    for name, obj in json_files.items():
        (path / f"{name}.json").write_text(json.dumps(obj), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def chatml_dir(tmp_path_factory) -> Path:
    return _write_model_dir(tmp_path_factory.mktemp("chatml"), {
        "chat_template": CHATML_TEMPLATE, "eos_token": "<|im_end|>",
        "bos_token": None, "add_bos_token": False})


@pytest.fixture(scope="module")
def tok(chatml_dir) -> Tokenizer:
    return Tokenizer.from_model_dir(chatml_dir)


@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_round_trip(tok, text):
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert all(isinstance(i, int) and 0 <= i < tok.vocab_size for i in ids)


def test_merges_make_tokens_longer_than_bytes(tok):
    text = "the experts of the router"
    assert len(tok.encode(text)) < len(text.encode("utf-8")) // 2


def test_special_tokens_and_vocab(tok):
    assert tok.vocab_size == 512
    assert tok.token_to_id("<|im_end|>") == 2
    assert tok.token_to_id("not-a-token") is None
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == 2
    assert tok.bos_token is None and tok.bos_token_id is None
    ids = tok.encode("hi<|im_end|>")
    assert ids[-1] == 2 and len(ids) >= 2
    assert tok.decode(ids) == "hi"
    assert tok.decode(ids, skip_special_tokens=False) == "hi<|im_end|>"


@pytest.mark.parametrize("text", TEXTS + ["a<|im_start|>b<|im_end|>c"])
def test_stream_decoder_matches_full_decode(tok, text):
    ids = tok.encode(text)
    stream = tok.stream_decoder()
    pieces = [stream.step(i) for i in ids]
    assert "".join(pieces) + stream.finish() == tok.decode(ids)
    assert not any("\ufffd" in piece for piece in pieces)


def test_stream_decoder_holds_back_split_character(tok):
    ids = tok.encode("a🙂")  # the emoji is not in the BPE corpus: 4 byte-level tokens
    assert len(ids) == 5
    stream = tok.stream_decoder()
    assert [stream.step(i) for i in ids] == ["a", "", "", "", "🙂"]
    assert stream.finish() == ""


def test_stream_decoder_finish_flushes_cut_off_character(tok):
    ids = tok.encode("x€🙂")[:-2]  # the emoji's last two bytes never arrive
    stream = tok.stream_decoder()
    pieces = [stream.step(i) for i in ids]
    assert "".join(pieces) == "x€"
    assert stream.finish() == tok.decode(ids)[len("x€"):] != ""


def test_chatml_template_exact(tok):
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Hi there"}]
    assert tok.apply_chat_template(messages) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi there<|im_end|>\n"
        "<|im_start|>assistant\n")
    assert tok.apply_chat_template(messages[1:], add_generation_prompt=False) == (
        "<|im_start|>user\nHi there<|im_end|>\n")


def test_rendered_chat_encodes_special_tokens(tok):
    text = tok.apply_chat_template([{"role": "user", "content": "ok"}])
    ids = tok.encode(text, add_special_tokens=False)
    assert ids[0] == tok.token_to_id("<|im_start|>")
    assert ids.count(tok.token_to_id("<|im_end|>")) == 1


TEMPLATE = (
    "{{ bos_token }}\n"
    "{% for m in messages %}\n"
    "    {% if m['role'] == 'tool' %}{{ raise_exception('no tools here') }}{% endif %}\n"
    "[{{ m['role'] }}] {{ m | tojson }}\n"
    "{% endfor %}\n"
    "{% if add_generation_prompt %}[assistant]{% endif %}"
)


@pytest.fixture(scope="module")
def custom_dir(tmp_path_factory) -> Path:
    return _write_model_dir(tmp_path_factory.mktemp("custom"), {
        "chat_template": [{"name": "tool_use", "template": "TOOLS"},
                          {"name": "default", "template": TEMPLATE}],
        "bos_token": {"__type": "AddedToken", "content": "<|endoftext|>", "lstrip": False},
        "eos_token": {"__type": "AddedToken", "content": "<|im_end|>"},
        "add_bos_token": True})


def test_template_list_dict_tokens_trim_blocks_and_tojson(custom_dir):
    tok = Tokenizer.from_model_dir(custom_dir)
    assert tok.bos_token == "<|endoftext|>" and tok.eos_token == "<|im_end|>"
    text = tok.apply_chat_template([{"role": "user", "content": "<b>é</b> & \"q\""}])
    # trim_blocks eats the newline after {% ... %} tags, not after {{ ... }};
    # lstrip_blocks eats the indentation before the {% if %}.
    assert text == ('<|endoftext|>\n[user] {"role": "user", "content": "<b>é</b> & \\"q\\""}\n'
                    "[assistant]")


def test_template_matches_transformers(custom_dir):
    transformers = pytest.importorskip("transformers")
    ours = Tokenizer.from_model_dir(custom_dir)
    theirs = transformers.AutoTokenizer.from_pretrained(custom_dir)
    messages = [{"role": "system", "content": "S <x>"}, {"role": "user", "content": "ü\n2"}]
    for gen in (True, False):
        assert ours.apply_chat_template(messages, add_generation_prompt=gen) == \
            theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)


def test_raise_exception_becomes_chat_template_error(custom_dir):
    tok = Tokenizer.from_model_dir(custom_dir)
    with pytest.raises(ChatTemplateError, match="no tools here"):
        tok.apply_chat_template([{"role": "tool", "content": "x"}])


def test_add_bos_token_prepends_bos(custom_dir, tok):
    with_bos = Tokenizer.from_model_dir(custom_dir)
    assert with_bos.encode("hi") == [0] + tok.encode("hi")
    assert with_bos.encode("hi", add_special_tokens=False) == tok.encode("hi")


def test_chat_template_jinja_file_takes_precedence(tmp_path):
    model_dir = _write_model_dir(tmp_path, {"chat_template": "from config"})
    (model_dir / "chat_template.jinja").write_text("{{ messages | length }} from file",
                                                   encoding="utf-8")
    assert Tokenizer.from_model_dir(model_dir).apply_chat_template([{}, {}]) == "2 from file"


def test_missing_template_names_tokenizer_config(tmp_path):
    tok = Tokenizer.from_model_dir(_write_model_dir(tmp_path, {"eos_token": "<|im_end|>"}))
    with pytest.raises(ChatTemplateError, match="tokenizer_config.json"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


def test_list_template_without_default(tmp_path):
    model_dir = _write_model_dir(tmp_path, {"chat_template": [{"name": "rag", "template": "x"}]})
    with pytest.raises(ChatTemplateError, match="default"):
        Tokenizer.from_model_dir(model_dir)


def test_template_syntax_error(tmp_path):
    tok = Tokenizer.from_model_dir(_write_model_dir(tmp_path, {"chat_template": "{% for %}"}))
    with pytest.raises(ChatTemplateError, match="compile"):
        tok.apply_chat_template([])


def test_missing_tokenizer_json_names_file(tmp_path):
    with pytest.raises(TokenizerFilesError, match="tokenizer.json"):
        Tokenizer.from_model_dir(tmp_path)


def test_invalid_tokenizer_json_names_file(tmp_path):
    (tmp_path / "tokenizer.json").write_text('{"version": "1.0"}', encoding="utf-8")
    with pytest.raises(TokenizerFilesError, match="tokenizer.json"):
        Tokenizer.from_model_dir(tmp_path)


def test_invalid_tokenizer_config_names_file(tmp_path):
    model_dir = _write_model_dir(tmp_path)
    (model_dir / "tokenizer_config.json").write_text("{not json", encoding="utf-8")
    with pytest.raises(TokenizerFilesError, match="tokenizer_config.json"):
        Tokenizer.from_model_dir(model_dir)


def test_no_tokenizer_config_is_fine(tmp_path):
    tok = Tokenizer.from_model_dir(_write_model_dir(tmp_path))
    assert tok.eos_token is None and tok.chat_template is None
    assert tok.decode(tok.encode("plain")) == "plain"


def test_stop_ids_generation_config_overrides_config(tmp_path):
    model_dir = _write_model_dir(tmp_path, {"eos_token": "<|im_end|>"},
                                 config={"eos_token_id": 7},
                                 generation_config={"eos_token_id": [0, 5]})
    assert stop_token_ids(model_dir) == {0, 5, 2}


def test_stop_ids_fall_back_to_config(tmp_path):
    model_dir = _write_model_dir(tmp_path, None, config={"eos_token_id": [7, 8]},
                                 generation_config={"eos_token_id": None, "bos_token_id": 1})
    assert stop_token_ids(model_dir) == {7, 8}


def test_stop_ids_int_and_tokenizer_only(tmp_path):
    a = _write_model_dir(tmp_path / "a", {"eos_token": {"content": "<|endoftext|>"}},
                         config={"eos_token_id": 9})
    assert stop_token_ids(a) == {9, 0}
    b = _write_model_dir(tmp_path / "b", {"eos_token": "<|im_end|>"})
    assert stop_token_ids(b) == {2}
    assert stop_token_ids(tmp_path / "nothing-here") == set()


def test_stop_ids_invalid_type_names_file(tmp_path):
    model_dir = _write_model_dir(tmp_path, None, generation_config={"eos_token_id": "2"})
    with pytest.raises(TokenizerFilesError, match="generation_config.json"):
        stop_token_ids(model_dir)


def test_rendering_stops_at_max_chars_and_at_the_timeout():
    from ext.chat_template import ChatTemplateLimitError, compile_template, render
    many = compile_template("{% for i in range(100000) %}{% for j in range(100000) %}xx"
                            "{% endfor %}{% endfor %}")
    with pytest.raises(ChatTemplateLimitError, match="more than 1000 characters"):
        render(many, {}, max_chars=1000)
    ticks = iter(range(10**6))                       # one second per piece rendered
    with pytest.raises(ChatTemplateLimitError, match="longer than 5 s"):
        render(many, {}, max_chars=10**9, timeout_s=5, clock=lambda: float(next(ticks)))
    assert render(compile_template("{{ 'ab' * 3 }}"), {}, max_chars=6) == "ababab"


def test_a_tokenizer_uses_the_renderer_it_was_given(chatml_dir):
    seen = []

    def renderer(source, variables):
        seen.append((source, variables["messages"]))
        return "rendered elsewhere"
    tok = Tokenizer.from_model_dir(chatml_dir, renderer=renderer)
    messages = [{"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(messages) == "rendered elsewhere"
    assert seen == [(tok.chat_template, messages)]
