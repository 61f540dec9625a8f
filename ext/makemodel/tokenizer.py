"""The tokenizer files of a generated checkpoint: a byte-level BPE trained on a fixed text,
three special tokens (and a family's own: FAMILY_SPECIAL_TOKENS) and a chat template
(ChatML, or the family's own: CHAT_TEMPLATES)."""
from __future__ import annotations

from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Qwen3's chat template (tokenizer_config.json of the Qwen3 MoE checkpoints): ChatML, the
# tools in a system block and calls as <tool_call> JSON ("hermes", daemon/api/tools.py),
# tool results as <tool_response> in a user turn, <think> reasoning kept only after the
# last user query, and enable_thinking=False closing an empty <think> block.
QWEN3_TEMPLATE = ((Path(__file__).parent / "templates" / "qwen3_moe.jinja").read_text(encoding="utf-8")
                  .removesuffix("\n"))

# GLM-4.5's chat format (its checkpoints' chat_template.jinja): [gMASK]<sop>, <|system|>,
# <|user|>, <|assistant|> and <|observation|> turns, the tools in a system block, calls as
# <tool_call>NAME with <arg_key>/<arg_value> lines ("glm", daemon/api/tools.py), tool
# results in <tool_response> after <|observation|>, and <think> blocks.
GLM45_TEMPLATE = ((Path(__file__).parent / "templates" / "glm4_moe.jinja").read_text(encoding="utf-8")
                  .removesuffix("\n"))

# GPT-OSS's chat format, harmony (OpenAI's harmony response format): messages
# `<|start|>ROLE<|channel|>CHANNEL<|message|>TEXT<|end|>`, analysis / commentary / final
# channels, calls `to=functions.NAME` ending in <|call|>, the answer ending in <|return|>
# ("harmony", daemon/api/harmony.py). moed's own template of that layout (see its head).
GPT_OSS_TEMPLATE = ((Path(__file__).parent / "templates" / "gpt_oss.jinja").read_text(encoding="utf-8")
                    .removesuffix("\n"))

# The chat template make-model writes per architecture (ChatML where the family's own is
# not written yet).
CHAT_TEMPLATES = {"qwen3_moe": QWEN3_TEMPLATE, "glm4_moe": GLM45_TEMPLATE, "gpt_oss": GPT_OSS_TEMPLATE}

# Harmony's special tokens, single tokens of GPT-OSS's o200k_harmony vocabulary (ids
# 200002-200012 there); a generated gpt_oss tokenizer has them as special added tokens
# after the BPE's, so that the template's markup encodes as the real model's does.
HARMONY_TOKENS = ("<|return|>", "<|constrain|>", "<|channel|>", "<|start|>", "<|end|>",
                  "<|message|>", "<|call|>")
FAMILY_SPECIAL_TOKENS = {"gpt_oss": HARMONY_TOKENS}

# Fixed training text for the byte-level BPE merges. Changing it changes every
# generated tokenizer, so it is a constant rather than, say, this file's source.
_BPE_CORPUS = """\
A mixture of experts replaces the single feed-forward block of a transformer layer with
many smaller experts and a router that picks a few of them for every token. The router
computes a score for each expert, keeps the top k, and mixes the chosen experts' outputs
with weights taken from a softmax over the scores. Because each token touches only a few
experts, the model can hold far more parameters than it spends on any one token.

The daemon keeps the dense part of the model resident in memory: the embeddings, the
attention weights, the norms, the routers and the shared experts. The routed experts stay
on the disk in the model's own safetensors shards and are read into an expert cache when
a token needs them. Hot experts are pinned; the next layer's experts are predicted and
read while the processor computes the current layer.

Hello, world! How are you today? I am fine, thank you. What is the weather like? It is
sunny and warm, with a light breeze from the sea. Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100
1024 2048 4096. Code: def forward(self, x): return self.down(silu(self.gate(x)) * self.up(x))
for i in range(n): total += values[i] if values[i] > 0 else 0; print(f"{total:.3f}")
Un café au lait, s'il vous plaît. Die Straße ist naß. El niño comió piña. Ça va très bien.
Grüße aus München — zwölf Boxkämpfer jagen Viktor quer über den großen Sylter Deich.
日本語の文章も少し入れておきます。東京は大きな都市です。中文也可以。한국어 문장입니다.
Prices: 5 € or £4 or ¥600; temperatures of −5 °C to 30 °C; π ≈ 3.14159; x² + y² = r².
<|im_start|>user
What is a mixture of experts?<|im_end|>
<|im_start|>assistant
It is a layer in which a router sends each token to a few of many expert networks.<|im_end|>
"""


def build_tokenizer(vocab_size: int = 512, extra_special: tuple[str, ...] = ()) -> Tokenizer:
    """Train the byte-level BPE tokenizer used by generated checkpoints.

    Args:
        vocab_size: target vocabulary size including the 3 special tokens
            (`<|endoftext|>` = 0, `<|im_start|>` = 1, `<|im_end|>` = 2), the 256
            byte tokens and `extra_special`; the remaining entries are merges learned
            from a fixed built-in text. The result may be smaller if the text runs out
            of merges.
        extra_special: further special tokens (a family's, FAMILY_SPECIAL_TOKENS), added
            after the merges with the last ids: each encodes as one token and the
            vocabulary keeps its size (so do the model's tensors).

    Returns:
        A `tokenizers.Tokenizer` with a ByteLevel pre-tokenizer (add_prefix_space=False)
        and ByteLevel decoder; deterministic for a given `vocab_size`.

    Raises:
        ValueError: vocab_size < 259 (the special and byte tokens would not fit).
    """
    minimum = len(SPECIAL_TOKENS) + 256 + len(extra_special)
    if vocab_size < minimum:
        raise ValueError(f"vocab_size must be >= {minimum}, got {vocab_size}")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(extra_special),
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator([_BPE_CORPUS], trainer=trainer)
    tokenizer.add_special_tokens([AddedToken(token, special=True, normalized=False)
                                  for token in extra_special])
    return tokenizer


def tokenizer_config(ids: dict, model_max_length: int, chat_template: str = CHATML_TEMPLATE,
                     eos_token: str = "<|im_end|>") -> dict:
    """tokenizer_config.json contents: special tokens (`ids`: each one's id), the chat
    template (ChatML unless given: `CHAT_TEMPLATES` has the families' own) and the token
    that ends a turn (gpt_oss: <|return|>, as its checkpoints name it)."""
    return {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": {
            str(token_id): {"content": token, "lstrip": False, "normalized": False,
                            "rstrip": False, "single_word": False, "special": True}
            for token, token_id in sorted(ids.items(), key=lambda kv: kv[1])},
        "bos_token": None,
        "chat_template": chat_template,
        "clean_up_tokenization_spaces": False,
        "eos_token": eos_token,
        "model_max_length": model_max_length,
        "pad_token": "<|endoftext|>",
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": None,
    }
