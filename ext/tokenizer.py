"""Tokenizer and chat-template glue for Hugging Face model directories.

Reads the files a Hub checkpoint ships — `tokenizer.json` (the `tokenizers` pipeline),
`tokenizer_config.json` (special tokens, `add_bos_token`, `chat_template`), an optional
`chat_template.jinja`, `generation_config.json` and `config.json` (EOS ids) — and
reproduces what transformers does with them:

* token ids are Python ints; text is `str`;
* chat templates render as transformers renders them, in a Jinja sandbox, with a bound
  on the characters and the time one render may take (ext/chat_template.py);
* the rendered chat already contains any BOS the template writes, so encode it with
  `add_special_tokens=False` (transformers does the same).

Every error about the files is a `TokenizerFilesError` (a `ValueError`) that names the
file; every error about a chat template is a `ChatTemplateError` (a `ValueError`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path
from types import MappingProxyType
from typing import Any

import jinja2
from tokenizers import Tokenizer as _BackendTokenizer
from tokenizers.decoders import DecodeStream

from ext.chat_template import (ChatTemplateError, ChatTemplateLimitError,  # noqa: F401
                               compile_template, render)
from ext.formats.files import MetadataFileError, read_json, read_text

# renderer(source, variables) -> text: how a chat template is rendered (ext.chat_template
# in this process by default; the daemon passes one that renders in worker processes).
Renderer = Callable[[str, dict[str, Any]], str]

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
GENERATION_CONFIG_FILE = "generation_config.json"
CONFIG_FILE = "config.json"


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, reversed: the character that stands for each byte
    in a byte-level BPE vocabulary -> the byte (the `bytes_to_unicode` table of
    tokenizers' ByteLevel pre-tokenizer)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1),
            *range(ord("\xae"), ord("\xff") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


_BYTE_DECODER = _byte_decoder()


class TokenizerFilesError(ValueError):
    """A tokenizer or config file is missing or malformed; the message names the file."""


class StreamDecoder:
    """Incremental detokenizer for one generated sequence.

    Feed token ids one at a time with `step`; the concatenation of everything `step`
    and `finish` return equals `Tokenizer.decode(all_ids)` (special tokens skipped,
    or written as their text when `special_tokens`: the markup of a chat format read
    from the text, GPT-OSS's harmony).
    Bytes of a UTF-8 character split over several byte-level tokens are held back
    until the character is complete, so no replacement character is emitted for a
    character that is still arriving. Backed by `tokenizers.decoders.DecodeStream`.
    Not thread-safe; one instance per sequence.
    """

    def __init__(self, backend: _BackendTokenizer, special_tokens: bool = False) -> None:
        self._backend = backend
        self._skip = not special_tokens
        self._stream = DecodeStream(skip_special_tokens=self._skip)
        self._ids: list[int] = []
        self._emitted_chars = 0

    def step(self, token_id: int) -> str:
        """Add one token id; return the newly completed text ("" if none yet).

        Raises:
            TypeError / OverflowError / Exception from `tokenizers`: token_id is not a
                valid id of this vocabulary.
        """
        self._ids.append(token_id)
        text = self._stream.step(self._backend, token_id)
        if text is None:
            return ""
        self._emitted_chars += len(text)
        return text

    def finish(self) -> str:
        """Return text still held back at the end of the sequence (e.g. a cut-off
        multi-byte character, decoded with replacement characters), and "" otherwise."""
        full = self._backend.decode(self._ids, skip_special_tokens=self._skip)
        rest = full[self._emitted_chars:]
        self._emitted_chars = len(full)
        return rest


def _read_json(path: Path) -> dict | None:
    """Parse a JSON object file; None if it does not exist."""
    try:
        obj = read_json(path)
    except FileNotFoundError:
        return None
    except (OSError, MetadataFileError) as exc:
        raise TokenizerFilesError(str(exc)) from None
    if not isinstance(obj, dict):
        raise TokenizerFilesError(f"{path}: expected a JSON object, got {type(obj).__name__}")
    return obj


def _token_content(value: Any, path: Path, key: str) -> str | None:
    """A special-token entry: a string, {"content": str, ...} (AddedToken) or null."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    raise TokenizerFilesError(f"{path}: {key} must be a string or an object with 'content'")


def _pick_template(value: Any, path: Path) -> str | None:
    """`chat_template` is a string, or a list of {"name", "template"}: take "default"."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {}
        for entry in value:
            if not (isinstance(entry, dict) and isinstance(entry.get("name"), str)
                    and isinstance(entry.get("template"), str)):
                raise TokenizerFilesError(f"{path}: chat_template list entries need 'name' and 'template' strings")
            named[entry["name"]] = entry["template"]
        if "default" not in named:
            raise ChatTemplateError(f"{path}: chat_template has no 'default' entry (has {sorted(named)})")
        return named["default"]
    raise TokenizerFilesError(f"{path}: chat_template must be a string or a list")


class Tokenizer:
    """A model's tokenizer: encode/decode, streaming decode, chat template.

    Build it with `Tokenizer.from_model_dir`. Immutable after construction and safe
    to share between threads for `encode`/`decode`/`apply_chat_template`
    (each `stream_decoder()` belongs to one sequence).

    Attributes:
        bos_token, eos_token: special-token strings from tokenizer_config.json, or None.
        bos_token_id, eos_token_id: their ids, or None when unnamed or unknown.
        add_bos_token: tokenizer_config.json `add_bos_token`, or None if absent.
        chat_template: the template source, or None.
        added_tokens: tokenizer.json's added tokens, special or not: {content: id}
            (read-only).
    """

    def __init__(self, backend: _BackendTokenizer, *, chat_template: str | None = None,
                 special_tokens: dict[str, str] | None = None,
                 add_bos_token: bool | None = None,
                 config_path: Path | None = None, renderer: Renderer | None = None) -> None:
        """Wrap a `tokenizers.Tokenizer`.

        Args:
            backend: the loaded tokenizer.json pipeline.
            chat_template: Jinja source or None.
            special_tokens: e.g. {"bos_token": "<s>", "eos_token": "</s>"}; passed to the
                chat template as variables.
            add_bos_token: when True, `encode(..., add_special_tokens=True)` makes sure
                the ids start with bos_token_id even if tokenizer.json's post-processor
                does not add it.
            config_path: where these settings came from, for error messages.
            renderer: renders the chat template, `renderer(source, variables) -> text`,
                raising ChatTemplateError (the daemon's renders in bounded worker
                processes); None renders in this process with ext.chat_template's
                default bounds.
        """
        self._backend = backend
        self._special = {k: v for k, v in (special_tokens or {}).items() if v is not None}
        self._config_path = config_path or Path(TOKENIZER_CONFIG_FILE)
        self.chat_template = chat_template
        self._template: jinja2.Template | None = None
        self._renderer = renderer
        self.add_bos_token = add_bos_token
        self.bos_token = self._special.get("bos_token")
        self.eos_token = self._special.get("eos_token")
        self.bos_token_id = None if self.bos_token is None else backend.token_to_id(self.bos_token)
        self.eos_token_id = None if self.eos_token is None else backend.token_to_id(self.eos_token)
        self.added_tokens = MappingProxyType(
            {t.content: i for i, t in backend.get_added_tokens_decoder().items()})

    @classmethod
    def from_model_dir(cls, model_dir: str | Path, *, renderer: Renderer | None = None) -> Tokenizer:
        """Load tokenizer.json, tokenizer_config.json (optional) and chat_template.jinja
        (optional; when present it takes precedence over tokenizer_config.json's
        `chat_template`, as in transformers).

        Raises:
            TokenizerFilesError: tokenizer.json missing or not a valid tokenizer;
                tokenizer_config.json not valid JSON or with malformed entries.
            ChatTemplateError: `chat_template` is a list without a "default" entry.
        """
        model_dir = Path(model_dir)
        path = model_dir / TOKENIZER_FILE
        try:
            read_text(path)  # exists, is a regular file of sane size, is UTF-8
        except FileNotFoundError:
            raise TokenizerFilesError(f"{path}: missing") from None
        except MetadataFileError as exc:
            raise TokenizerFilesError(str(exc)) from None
        try:
            backend = _BackendTokenizer.from_file(str(path))
        except Exception as exc:  # tokenizers raises plain Exception on parse errors
            raise TokenizerFilesError(f"{path}: not a valid tokenizer file: {exc}") from exc
        config_path = model_dir / TOKENIZER_CONFIG_FILE
        config = _read_json(config_path) or {}
        special = {key: _token_content(config.get(key), config_path, key)
                   for key in ("bos_token", "eos_token", "unk_token", "pad_token")}
        template = _pick_template(config.get("chat_template"), config_path)
        jinja_path = model_dir / CHAT_TEMPLATE_FILE
        try:
            template = read_text(jinja_path)
        except FileNotFoundError:
            pass
        except MetadataFileError as exc:
            raise TokenizerFilesError(str(exc)) from None
        add_bos = config.get("add_bos_token")
        if add_bos is not None and not isinstance(add_bos, bool):
            raise TokenizerFilesError(f"{config_path}: add_bos_token must be a boolean")
        return cls(backend, chat_template=template, special_tokens=special,
                   add_bos_token=add_bos, config_path=config_path, renderer=renderer)

    @property
    def vocab_size(self) -> int:
        """Number of token ids the tokenizer knows, added tokens included."""
        return self._backend.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        """The id of a vocabulary entry (e.g. "<|im_end|>"), or None if unknown."""
        return self._backend.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Tokenize text. Special-token strings inside text become their ids.

        With add_special_tokens, tokenizer.json's post-processor runs (e.g. adds BOS),
        and if tokenizer_config.json sets `add_bos_token: true` a missing leading BOS
        is prepended.
        """
        ids = self._backend.encode(text, add_special_tokens=add_special_tokens).ids
        if (add_special_tokens and self.add_bos_token and self.bos_token_id is not None
                and (not ids or ids[0] != self.bos_token_id)):
            ids.insert(0, self.bos_token_id)
        return ids

    def encode_long(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """`encode`, letting other threads run meanwhile: `tokenizers` holds the GIL
        through `encode` but releases it in `encode_batch` (a long prompt tokenized by
        the server must not stall the engine thread's Python between kernels)."""
        ids = self._backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        if (add_special_tokens and self.add_bos_token and self.bos_token_id is not None
                and (not ids or ids[0] != self.bos_token_id)):
            ids.insert(0, self.bos_token_id)
        return ids

    @property
    def max_token_bytes(self) -> int:
        """The most UTF-8 bytes of any vocabulary entry's string (added tokens included).

        No token stands for more bytes of normalized text than its own string holds
        (byte-level and byte-fallback strings are longer than the bytes they stand
        for), so a text of N bytes is at least N / (max_token_bytes * 4) tokens even
        after a normalizer (NFKC and the like change a character's length by at most
        that factor): a cheap lower bound that refuses an oversized prompt untokenized.
        """
        if getattr(self, "_max_token_bytes", None) is None:
            vocab = self._backend.get_vocab(with_added_tokens=True)
            self._max_token_bytes = max((len(t.encode("utf-8")) for t in vocab), default=1)
        return self._max_token_bytes

    def min_tokens(self, text: str) -> int:
        """A lower bound on len(encode(text)) computed without tokenizing (see
        `max_token_bytes`)."""
        return len(text.encode("utf-8", "surrogatepass")) // (4 * self.max_token_bytes)

    def to_json(self) -> str:
        """tokenizer.json as loaded (for libraries that build their own view of it)."""
        return self._backend.to_str()

    def token_piece(self, token_id: int) -> tuple[str, bytes]:
        """The text of one token alone and the bytes it stands for (OpenAI's logprobs
        `token` and `bytes`): a byte-level token that holds part of a UTF-8 character
        has text with U+FFFD and its true bytes."""
        piece = self._backend.id_to_token(token_id)
        text = self._backend.decode([token_id], skip_special_tokens=False)
        if piece is not None and all(c in _BYTE_DECODER for c in piece) and "\ufffd" in text:
            return text, bytes(_BYTE_DECODER[c] for c in piece)
        if piece is not None and len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            try:
                return text, bytes([int(piece[3:5], 16)])      # a byte-fallback token
            except ValueError:
                pass
        return text, text.encode("utf-8", "replace")

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """Detokenize ids; invalid UTF-8 becomes U+FFFD."""
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def stream_decoder(self, special_tokens: bool = False) -> StreamDecoder:
        """A new incremental decoder for one sequence (see `StreamDecoder`); with
        special_tokens, special tokens are written as their text."""
        return StreamDecoder(self._backend, special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            **kwargs: Any) -> str:
        """Render a conversation to the prompt text the model was trained on.

        Args:
            messages: [{"role": "system"|"user"|"assistant"|..., "content": str}, ...]
                passed to the template as `messages`.
            add_generation_prompt: template variable; ChatML templates then end with
                the header of the assistant's turn.
            **kwargs: further template variables (e.g. `tools`, `documents`).

        Returns:
            The rendered text; encode it with add_special_tokens=False.

        Raises:
            ChatTemplateError: no template (names tokenizer_config.json), the template
                does not compile, calls raise_exception, or fails while rendering;
                ChatTemplateLimitError (a ChatTemplateError) when it renders more
                characters or takes longer than its renderer allows.
        """
        if self.chat_template is None:
            raise ChatTemplateError(
                f"{self._config_path}: no chat_template (nor {CHAT_TEMPLATE_FILE}); "
                "this model has no chat format")
        variables = {**self._special, **kwargs, "messages": messages,
                     "add_generation_prompt": add_generation_prompt}
        if self._renderer is not None:
            return self._renderer(self.chat_template, variables)
        if self._template is None:
            self._template = compile_template(self.chat_template)
        return render(self._template, variables)


def _eos_ids(value: Any, path: Path) -> set[int] | None:
    """`eos_token_id` as a set: int -> {int}, list -> set, null/absent -> None."""
    if value is None:
        return None
    if isinstance(value, int) and not isinstance(value, bool):
        return {value}
    if isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return set(value)
    raise TokenizerFilesError(f"{path}: eos_token_id must be an int or a list of ints, got {value!r}")


def stop_token_ids(model_dir: str | Path) -> set[int]:
    """Token ids that end generation for the model in model_dir.

    Precedence (the rule transformers' `generate` follows, plus the tokenizer):
      1. generation_config.json `eos_token_id` (int or list) if the file exists and the
         entry is non-null — it replaces config.json's;
      2. otherwise config.json `eos_token_id` (int or list), if present;
      3. in both cases the id of tokenizer_config.json's `eos_token` is added when the
         file names one and tokenizer.json knows it (chat models often end a turn with
         a token that only the tokenizer config names).
    Missing files contribute nothing; the result may be empty.

    Raises:
        TokenizerFilesError: a file exists but is not valid JSON, or its eos_token_id
            is neither an int nor a list of ints; tokenizer.json invalid when needed.
    """
    model_dir = Path(model_dir)
    ids: set[int] | None = None
    for name in (GENERATION_CONFIG_FILE, CONFIG_FILE):
        path = model_dir / name
        config = _read_json(path)
        if config is not None:
            ids = _eos_ids(config.get("eos_token_id"), path)
            if ids is not None:
                break
    ids = set() if ids is None else ids
    config_path = model_dir / TOKENIZER_CONFIG_FILE
    tokenizer_config = _read_json(config_path)
    if tokenizer_config is not None:
        eos = _token_content(tokenizer_config.get("eos_token"), config_path, "eos_token")
        if eos is not None and (model_dir / TOKENIZER_FILE).is_file():
            eos_id = Tokenizer.from_model_dir(model_dir).token_to_id(eos)
            if eos_id is not None:
                ids.add(eos_id)
    return ids
