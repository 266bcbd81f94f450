"""kiln's tokenizer: byte-level BPE training, tiktoken-exact encoding, and the ecosystem's file formats.

from kiln.tokenizer import Tokenizer, train_bpe
tok = train_bpe(texts, vocab_size=4096, pattern="gpt4")
ids = tok.encode_ordinary("hello world")
tok.save("runs/tok"); tok = Tokenizer.load("runs/tok")
"""

from kiln.tokenizer.patterns import PATTERNS, resolve_pattern
from kiln.tokenizer.tokenizer import DisallowedSpecialError, Tokenizer
from kiln.tokenizer.train import train_bpe

__all__ = ["PATTERNS", "DisallowedSpecialError", "Tokenizer", "resolve_pattern", "train_bpe"]
