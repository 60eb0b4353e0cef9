"""Tokenizers: a checkpoint's own (tokenizer.json / tokenizer_config.json, through transformers),
or the built-in byte-level tokenizer of the tiny presets (256 bytes + 3 specials, built with the
`tokenizers` library, so it needs no file and no download)."""

from __future__ import annotations

from pathlib import Path

from ..errors import InvalidRequestError

SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


class Tokenizer:
    def __init__(self, hf_tokenizer, eos_token_ids: tuple[int, ...] = ()):
        self.hf = hf_tokenizer
        eos = set(eos_token_ids)
        if hf_tokenizer.eos_token_id is not None:
            eos.add(int(hf_tokenizer.eos_token_id))
        self.eos_token_ids = tuple(sorted(eos))

    @property
    def vocab_size(self) -> int:
        return len(self.hf)

    def encode(self, text: str) -> list[int]:
        """Tokenize one span on its own, without special tokens added."""
        if not isinstance(text, str):
            raise InvalidRequestError(f"expected text, got {type(text).__name__}")
        return list(self.hf.encode(text, add_special_tokens=False))

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens)

    @property
    def chat_template(self) -> str | None:
        return getattr(self.hf, "chat_template", None)

    def apply_chat_template(self, messages, add_generation_prompt: bool = True) -> str:
        if not self.chat_template:
            raise InvalidRequestError("this model's tokenizer has no chat template")
        return self.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)

    @classmethod
    def from_dir(cls, path: str | Path, eos_token_ids=()) -> "Tokenizer | None":
        """The checkpoint's tokenizer, or None when the directory has no tokenizer files."""
        path = Path(path)
        if not (path / "tokenizer.json").exists() and not (path / "tokenizer_config.json").exists():
            return None
        from transformers import AutoTokenizer

        return cls(AutoTokenizer.from_pretrained(str(path)), eos_token_ids)

    @classmethod
    def builtin_bytes(cls) -> "Tokenizer":
        from tokenizers import Tokenizer as RawTokenizer
        from tokenizers import decoders, models, pre_tokenizers
        from transformers import PreTrainedTokenizerFast

        alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
        raw = RawTokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(alphabet)}, merges=[]))
        raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        raw.decoder = decoders.ByteLevel()
        raw.add_special_tokens(list(SPECIALS))
        tok = PreTrainedTokenizerFast(tokenizer_object=raw, eos_token=SPECIALS[0], pad_token=SPECIALS[0])
        tok.chat_template = _CHAT_TEMPLATE
        return cls(tok)
