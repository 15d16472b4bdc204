"""Reference models used by tests, benchmarks and the demo, and the named-model registry."""

from autopar.models.cnn import CNNConfig, ResNet
from autopar.models.gpt import GPT, GPTConfig
from autopar.models.llama import Llama, LlamaConfig
from autopar.models.mlp import MLPConfig, MLPStack
from autopar.models.moe import MoEConfig, MoELlama
from autopar.models.registry import NamedModel, build_named_model, get_named_model, named_models

__all__ = [
    "GPT",
    "CNNConfig",
    "GPTConfig",
    "Llama",
    "LlamaConfig",
    "MLPConfig",
    "MLPStack",
    "MoEConfig",
    "MoELlama",
    "NamedModel",
    "ResNet",
    "build_named_model",
    "get_named_model",
    "named_models",
]
