"""The Qwen3 family's names where older code and other checkouts look for them.

The family lives in models/families/qwen3.py and its shared layers in models/layers.py;
benchmarks/bench_forward_ab.py loads this file from another checkout by path.
"""
from models.families.qwen3 import MLP, Attention, DecoderLayer, Qwen3Model
from models.layers import AttentionOps, RMSNorm, Rotary, apply_rotary, rms_norm

__all__ = ["MLP", "Attention", "AttentionOps", "DecoderLayer", "Qwen3Model", "RMSNorm", "Rotary",
           "apply_rotary", "rms_norm"]
