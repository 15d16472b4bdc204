"""Extraction of the reference GPT against hand-counted FLOPs and parameters."""

from autopar.graph import extract
from autopar.models import GPT, GPTConfig


def test_gpt_flops_match_megatron_formula():
    cfg = GPTConfig(vocab_size=256, seq_len=64, dim=128, n_layers=4, n_heads=4)
    g = extract(GPT(cfg), seq_len=64, dtype="fp32")
    s, h, layers, v = 64, 128, 4, 256
    # Narayanan et al. 2021: 24 s h^2 + 4 s^2 h per layer, plus 2 s h V for the head
    expected = layers * (24 * s * h * h + 4 * s * s * h) + 2 * s * h * v
    matmul = sum(leaf.matmul_flops for u in g.units for leaf in g.profile_of(g.units.index(u)).leaves)
    assert abs(matmul - layers * 24 * s * h * h - 2 * s * h * v) / matmul < 1e-9
    assert abs(g.fwd_flops_per_sample - expected) / expected < 0.02
    assert g.num_params == sum(p.numel() for p in GPT(cfg).parameters())
