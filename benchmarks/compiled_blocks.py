"""What compiling the blocks is worth, in the cost model: transformers' models against
autopar's own of the same shape, eager and compiled.

autopar's GPT and Llama call fused ops (one GELU, one norm, the SiLU gate in two ops);
transformers writes some of them out as many element-wise ops (GPT-2's tanh GELU is
seven), which eager mode runs as as many kernels, each a pass through memory. Compiled
(:mod:`autopar.graph.fusion`), both are the same fused kernels, so their predictions
should meet. Each row estimates one configuration (data parallelism over 8 H100,
micro-batch 8 sequences of 1024 tokens, or 2 of 4096 for the Llama pair, no
recomputation) with ``compile`` off and on, and reports the step and the activations a
device keeps: compiled, the element-wise intermediates that eager mode saves (GPT-2's
GELU chain, RMSNorm's fp32 copies) are recomputed in the backward
(:mod:`autopar.graph.compiled_saved`). A cost-model comparison, not a measurement: no
GPU ran here.
"""

from __future__ import annotations

import argparse

import torch
import transformers
from _report import markdown_table, write_csv, write_result

import autopar
from autopar.models.gpt import GPT, GPTConfig
from autopar.models.llama import Llama, LlamaConfig


def _gpt2(label: str, *, dim: int, layers: int, heads: int):
    """transformers' GPT-2 and autopar's GPT of one shape, 8 sequences of 1024 tokens."""
    cfg = transformers.GPT2Config(n_layer=layers, n_embd=dim, n_head=heads, n_positions=1024)
    own = GPTConfig(vocab_size=cfg.vocab_size, seq_len=1024, dim=dim, n_layers=layers, n_heads=heads)
    return label, transformers.GPT2LMHeadModel(cfg), GPT(own), 1024, 8


def _pairs():
    with torch.device("meta"):
        yield _gpt2("GPT-2 124M", dim=768, layers=12, heads=12)
        yield _gpt2("GPT-2 1.5B", dim=1600, layers=48, heads=25)
        llama = transformers.LlamaConfig(
            hidden_size=2048,
            intermediate_size=8192,
            num_hidden_layers=16,
            num_attention_heads=32,
            num_key_value_heads=8,
            vocab_size=128256,
            max_position_embeddings=4096,
        )
        own = LlamaConfig(
            dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim=8192, vocab_size=128256, seq_len=4096
        )
        yield "Llama-3.2-1B shape", transformers.LlamaForCausalLM(llama), Llama(own), 4096, 2


def main() -> None:
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args()  # --help; no options
    cluster = autopar.preset("dgx-h100", nodes=1)
    rows = []
    for label, hf, own, seq, mbs in _pairs():
        step, held = {}, {}
        for name, model in (("transformers", hf), ("autopar", own)):
            for compiled in (False, True):
                fixed = {"tp": 1, "pp": 1, "micro_batch_size": mbs, "recompute": "none", "compile": compiled}
                plan = autopar.estimate(model, cluster, fixed, global_batch_size=8 * mbs, seq_len=seq)
                step[name, compiled] = plan.prediction.step_time_s
                held[name, compiled] = plan.prediction.stages[0].memory.activations_bytes / 2**30
        rows.append(
            {
                "model": label,
                "transformers eager (ms)": f"{1e3 * step['transformers', False]:.2f}",
                "autopar eager (ms)": f"{1e3 * step['autopar', False]:.2f}",
                "eager ratio": f"{step['transformers', False] / step['autopar', False]:.3f}",
                "transformers compiled (ms)": f"{1e3 * step['transformers', True]:.2f}",
                "autopar compiled (ms)": f"{1e3 * step['autopar', True]:.2f}",
                "compiled ratio": f"{step['transformers', True] / step['autopar', True]:.3f}",
                "compiled / eager (transformers)": f"{step['transformers', True] / step['transformers', False]:.3f}",
                "activations eager / compiled, transformers (GiB)": (
                    f"{held['transformers', False]:.2f} / {held['transformers', True]:.2f}"
                ),
                "activations eager / compiled, autopar (GiB)": (
                    f"{held['autopar', False]:.2f} / {held['autopar', True]:.2f}"
                ),
            }
        )
        print(rows[-1], flush=True)
    write_csv("compiled_blocks", rows)
    write_result(
        "compiled_blocks",
        "Compiled blocks in the cost model: transformers against autopar's models",
        markdown_table(rows) + "\n\nOne step on 8 H100 (dgx-h100 preset), data parallelism, bf16, flash attention, no "
        "recomputation; `ratio` is transformers' step over autopar's. Activations: what a device keeps for the "
        "backward at its peak, eager and compiled (a compiled block saves what torch.compile's partitioner "
        "saves, `autopar.graph.compiled_saved`). Predicted, not measured.\n",
    )


if __name__ == "__main__":
    main()
