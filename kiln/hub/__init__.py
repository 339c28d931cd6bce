"""HF-format files on disk: config.json, safetensors (single or sharded), tokenizer files.

This layer imports nothing else of kiln except `kiln.errors`.
"""

from kiln.hub.chat import CHATML_TEMPLATE, ChatTemplate
from kiln.hub.config import read_config, write_config
from kiln.hub.tokenizer import Tokenizer
from kiln.hub.weights import load_weights, save_weights, weight_files

__all__ = [
           "CHATML_TEMPLATE",
           "ChatTemplate",
           "Tokenizer",
           "load_weights",
           "read_config",
           "save_weights",
           "weight_files",
           "write_config",
]
