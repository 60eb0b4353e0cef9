from .spans import TokenizedPrompt, tokenize_prompt, tokens_digest
from .tokenizer import Tokenizer

__all__ = ["TokenizedPrompt", "Tokenizer", "tokenize_prompt", "tokens_digest"]
