"""Reference models shared by tests, examples and benchmarks."""

from .gpt import GPT as GPT
from .gpt import GPTConfig as GPTConfig
from .gpt import token_batch as token_batch
from .mlp import MLP as MLP
from .mlp import regression_batch as regression_batch

__all__ = ["GPT", "GPTConfig", "MLP", "regression_batch", "token_batch"]
