"""kiln's model: one decoder-only Transformer for GPT-2, Llama, Mistral, Qwen2/3 and Mixtral-style MoE.

from kiln.model import ModelConfig, Transformer, build_model, from_pretrained, save_pretrained
"""

from kiln.model.cache import ContiguousKVCache, KVCache, StreamingKVCache
from kiln.model.config import ModelConfig
from kiln.model.hf import from_pretrained, save_pretrained
from kiln.model.transformer import Transformer, build_model

__all__ = [
    "ContiguousKVCache",
    "KVCache",
    "ModelConfig",
    "StreamingKVCache",
    "Transformer",
    "build_model",
    "from_pretrained",
    "save_pretrained",
]
