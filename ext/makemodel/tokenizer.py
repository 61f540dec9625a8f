"""The tokenizer files of a generated checkpoint: a byte-level BPE trained on a fixed text,
three special tokens, the family's own tokens (FAMILY_TOKENS) and its published chat template
(CHAT_TEMPLATES; ChatML for a family whose own is not written here)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def _template(name: str) -> str:
    """A family's published chat template, kept as package data (templates/NAME.jinja)."""
    path = Path(__file__).parent / "templates" / f"{name}.jinja"
    return path.read_text(encoding="utf-8").removesuffix("\n")


# Qwen3's chat template (tokenizer_config.json of the Qwen3 MoE checkpoints): ChatML, the
# tools in a system block and calls as <tool_call> JSON ("hermes", daemon/api/tools.py),
# tool results as <tool_response> in a user turn, <think> reasoning kept only after the
# last user query, and enable_thinking=False closing an empty <think> block.
QWEN3_TEMPLATE = _template("qwen3_moe")

# GLM-4.5's chat format (its checkpoints' chat_template.jinja): [gMASK]<sop>, <|system|>,
# <|user|>, <|assistant|> and <|observation|> turns, the tools in a system block, calls as
# <tool_call>NAME with <arg_key>/<arg_value> lines ("glm", daemon/api/tools.py), tool
# results in <tool_response> after <|observation|>, and <think> blocks.
GLM45_TEMPLATE = _template("glm4_moe")

# DeepSeek-V3.1's chat template (the `chat_template` of deepseek-ai/DeepSeek-V3.1's
# tokenizer_config.json, as published): <｜begin▁of▁sentence｜>, the system messages joined
# by blank lines, <｜User｜> and <｜Assistant｜> turns ended by <｜end▁of▁sentence｜>, history
# calls as <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>ARGUMENTS<｜tool▁call▁end｜>
# ...<｜tool▁calls▁end｜> (the arguments as the JSON text they are), tool results in
# <｜tool▁output▁begin｜>...<｜tool▁output▁end｜>, and the variable `thinking` (default false)
# opening <think> in the generation prompt or closing it (</think>). It does not write
# `tools`: the model card gives the tool description to put in the system prompt, which
# moed writes (daemon/api/tools.py, "deepseek").
DEEPSEEK_V31_TEMPLATE = _template("deepseek_v3")

# Mixtral-8x7B-Instruct-v0.1's chat template (the `chat_template` of
# mistralai/Mixtral-8x7B-Instruct-v0.1's tokenizer_config.json): BOS, then [INST] user
# [/INST] and the assistant's answer ended by EOS, the roles alternating from a user; any
# other role (system, tool) raises. No tool format: moed's "generic" one, the tools at the
# start of the first user message (daemon/api/tools.py, `refuses_system`).
MIXTRAL_TEMPLATE = _template("mixtral")

# Qwen1.5-MoE-A2.7B-Chat's chat template (the `chat_template` of
# Qwen/Qwen1.5-MoE-A2.7B-Chat's tokenizer_config.json): ChatML with a default system message
# ("You are a helpful assistant") when the first message is not one. No tool format.
QWEN15_TEMPLATE = _template("qwen2_moe")

# OLMoE-1B-7B-0924-Instruct's chat template (the `chat_template` of
# allenai/OLMoE-1B-7B-0924-Instruct's tokenizer_config.json, the Tulu format): BOS
# (<|endoftext|>), then <|system|>, <|user|> and <|assistant|> turns, each tag on its own
# line, the assistant's ended by EOS (<|endoftext|> too). No tool format.
OLMOE_TEMPLATE = _template("olmoe")

# GPT-OSS's chat format, harmony (OpenAI's harmony response format): messages
# `<|start|>ROLE<|channel|>CHANNEL<|message|>TEXT<|end|>`, analysis / commentary / final
# channels, calls `to=functions.NAME` ending in <|call|>, the answer ending in <|return|>
# ("harmony", daemon/api/harmony.py). moed's own template of that layout (see its head).
GPT_OSS_TEMPLATE = _template("gpt_oss")

# The chat template make-model writes per architecture (ChatML where the family's own is
# not written).
CHAT_TEMPLATES = {"qwen3_moe": QWEN3_TEMPLATE, "glm4_moe": GLM45_TEMPLATE,
                  "deepseek_v3": DEEPSEEK_V31_TEMPLATE, "gpt_oss": GPT_OSS_TEMPLATE,
                  "mixtral": MIXTRAL_TEMPLATE, "qwen2_moe": QWEN15_TEMPLATE, "olmoe": OLMOE_TEMPLATE}


@dataclass(frozen=True)
class FamilyTokens:
    """A family's own tokens, added after the trained vocabulary (ids from the end of the
    trained vocabulary up, in this order): `special` ones (skipped when decoding) and plain
    added ones (kept: the text of turns and calls), and which of them are its BOS and EOS
    (None: <|endoftext|> and <|im_end|>, with no BOS written to tokenizer_config.json), and
    the further tokens that end an answer (generation_config's eos_token_id: EOS,
    <|endoftext|>, `stops`)."""

    special: tuple[str, ...]
    added: tuple[str, ...]
    bos: str | None = None
    eos: str | None = None
    stops: tuple[str, ...] = ()


# The families' added tokens as their published tokenizer.json has them, in id order:
# - DeepSeek-V3.1 (deepseek-ai/DeepSeek-V3.1): begin/end of sentence are special; the turn,
#   think and tool-call markers are plain added tokens (special: false).
# - Qwen3 (Qwen/Qwen3-30B-A3B, ids 151657-151668): <tool_call>, </tool_call>,
#   <tool_response>, </tool_response>, <think>, </think>, plain (special: false); its
#   <|endoftext|>, <|im_start|> and <|im_end|> are the three special tokens every generated
#   tokenizer has.
# - GLM-4.5 (zai-org/GLM-4.5, ids 151350-151359): <think> to </arg_value>, plain.
# - Mixtral-Instruct and OLMoE-Instruct: their BOS and EOS, which their templates write.
# - GPT-OSS: harmony's special tokens, single tokens of its o200k_harmony vocabulary (ids
#   200002-200012 there), so that the template's markup encodes as the real model's does;
#   its generation_config ends an answer at <|return|>, <|endoftext|> and <|call|> (a tool
#   call's end).
# Plain added tokens stay in decoded text, where the reasoning and tool-call parsers read
# them; a constrained call names them as tokens (daemon/api/tools.py, `LarkText`).
FAMILY_TOKENS = {
    "deepseek_v3": FamilyTokens(
        special=("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"),
        added=("<｜User｜>", "<｜Assistant｜>", "<think>", "</think>", "<｜tool▁calls▁begin｜>",
               "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>",
               "<｜tool▁output▁begin｜>", "<｜tool▁output▁end｜>"),
        bos="<｜begin▁of▁sentence｜>", eos="<｜end▁of▁sentence｜>"),
    "qwen3_moe": FamilyTokens(
        special=(),
        added=("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>",
               "</think>")),
    "glm4_moe": FamilyTokens(
        special=(),
        added=("<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>",
               "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>")),
    # Mixtral's <s> and </s> (ids 1 and 2 there), special; its [INST] tags are plain text
    "mixtral": FamilyTokens(special=("<s>", "</s>"), added=(), bos="<s>", eos="</s>"),
    # OLMoE-Instruct's BOS and EOS are both <|endoftext|>; its role tags are plain text
    "olmoe": FamilyTokens(special=(), added=(), bos="<|endoftext|>", eos="<|endoftext|>"),
    "gpt_oss": FamilyTokens(
        special=("<|return|>", "<|constrain|>", "<|channel|>", "<|start|>", "<|end|>",
                 "<|message|>", "<|call|>"),
        added=(), bos="<|endoftext|>", eos="<|return|>", stops=("<|call|>",)),
}
HARMONY_TOKENS = FAMILY_TOKENS["gpt_oss"].special

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


def build_tokenizer(vocab_size: int = 512, arch: str | None = None) -> Tokenizer:
    """Train the byte-level BPE tokenizer used by generated checkpoints.

    Args:
        vocab_size: target vocabulary size including the 3 special tokens
            (`<|endoftext|>` = 0, `<|im_start|>` = 1, `<|im_end|>` = 2) and the 256
            byte tokens; the remaining entries are merges learned from a fixed
            built-in text. The result may be smaller if the text runs out of merges.
        arch: the family; its own tokens (`FAMILY_TOKENS`) are added after the
            trained vocabulary, which they do not change.

    Returns:
        A `tokenizers.Tokenizer` with a ByteLevel pre-tokenizer (add_prefix_space=False)
        and ByteLevel decoder; deterministic for a given `vocab_size`.

    Raises:
        ValueError: vocab_size < 259 (the special and byte tokens would not fit).
    """
    minimum = len(SPECIAL_TOKENS) + 256
    if vocab_size < minimum:
        raise ValueError(f"vocab_size must be >= {minimum}, got {vocab_size}")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator([_BPE_CORPUS], trainer=trainer)
    family = FAMILY_TOKENS.get(arch or "")
    if family is not None:
        tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in family.special])
        tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in family.added])
    return tokenizer


def added_token_ids(tokenizer: Tokenizer, arch: str | None = None) -> dict[str, int]:
    """The ids of the special tokens and of the family's own tokens."""
    family = FAMILY_TOKENS.get(arch or "")
    names = SPECIAL_TOKENS + ((family.special + family.added) if family is not None else ())
    return {token: tokenizer.token_to_id(token) for token in names}


def bos_eos(arch: str | None = None) -> tuple[str, str]:
    """The family's BOS and EOS tokens (<|endoftext|> and <|im_end|> unless its own): the
    ids config.json names."""
    family = FAMILY_TOKENS.get(arch or "")
    if family is None or family.eos is None:
        return "<|endoftext|>", "<|im_end|>"
    return family.bos or "<|endoftext|>", family.eos


def stop_tokens(arch: str | None = None) -> tuple[str, ...]:
    """The tokens that end an answer, generation_config's eos_token_id: the family's EOS,
    <|endoftext|> and its further stops (GPT-OSS's <|call|>), each once (OLMoE's EOS is
    <|endoftext|>)."""
    family = FAMILY_TOKENS.get(arch or "")
    return tuple(dict.fromkeys((bos_eos(arch)[1], "<|endoftext|>", *(family.stops if family is not None else ()))))


def tokenizer_config(ids: dict, model_max_length: int, chat_template: str = CHATML_TEMPLATE,
                     arch: str | None = None) -> dict:
    """tokenizer_config.json contents: the added tokens (`added_token_ids`), the chat
    template (ChatML unless given: `CHAT_TEMPLATES` has the families' own) and, for a
    family with its own tokens, its BOS (which its template writes) and EOS."""
    family = FAMILY_TOKENS.get(arch or "")
    plain = family.added if family is not None else ()
    return {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": {
            str(token_id): {"content": token, "lstrip": False, "normalized": False,
                            "rstrip": False, "single_word": False, "special": token not in plain}
            for token, token_id in sorted(ids.items(), key=lambda kv: kv[1])},
        "bos_token": family.bos if family is not None else None,
        "chat_template": chat_template,
        "clean_up_tokenization_spaces": False,
        "eos_token": bos_eos(arch)[1],
        "model_max_length": model_max_length,
        "pad_token": "<|endoftext|>",
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": None,
    }
