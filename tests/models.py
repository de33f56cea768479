"""Small models the tests compile, built from configs in code (nothing downloaded)."""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from fxpipe.demo import RMSNorm, rotary_tables, _rotate as apply_rotary


class MLPBlock(nn.Module):
    """``x + W2·gelu(W1·x)`` with a 4d intermediate: the activation-heavy block of the
    memory tests and benchmarks."""

    def __init__(self, d: int):
        super().__init__()
        self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(x)))


def mlp(width: int = 16, depth: int = 4) -> nn.Sequential:
    mods: list[nn.Module] = []
    for _ in range(depth):
        mods += [nn.Linear(width, width), nn.GELU()]
    return nn.Sequential(*mods, nn.Linear(width, 4))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, dropout: float):
        super().__init__()
        self.heads = heads
        self.norm1 = RMSNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim, bias=False)
        self.norm2 = RMSNorm(dim)
        self.up = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(4 * dim, dim)
        self.drop = nn.Dropout(dropout)

    def forward(self, x, cos, sin):
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(d, dim=-1)
        q, k, v = (y.view(b, t, self.heads, d // self.heads).transpose(1, 2) for y in (q, k, v))
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.drop(self.proj(a.transpose(1, 2).reshape(b, t, d)))
        return x + self.drop(self.down(F.gelu(self.up(self.norm2(x)))))


class GPT(nn.Module):
    """Decoder: embedding (tied with the head), blocks in a ModuleList, RMSNorm, rotary."""

    def __init__(self, vocab: int = 64, dim: int = 32, heads: int = 4, depth: int = 3,
                 seq: int = 16, dropout: float = 0.0):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList([Block(dim, heads, dropout) for _ in range(depth)])
        self.norm = RMSNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight
        self.head_dim = dim // heads

    def forward(self, ids):
        x = self.embed(ids)
        cos, sin = rotary_tables(ids.shape[1], self.head_dim, ids.device, x.dtype)
        for blk in self.blocks:
            x = blk(x, cos, sin)
        return self.head(self.norm(x))


class ResBlock(nn.Module):
    def __init__(self, c: int):
        super().__init__()
        self.conv1 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c)
        self.conv2 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c)

    def forward(self, x):
        return F.relu(x + self.bn2(self.conv2(F.relu(self.bn1(self.conv1(x))))))


class ConvNet(nn.Module):
    def __init__(self, c: int = 8, depth: int = 3, classes: int = 10):
        super().__init__()
        self.stem = nn.Conv2d(3, c, 3, padding=1)
        self.blocks = nn.Sequential(*[ResBlock(c) for _ in range(depth)])
        self.fc = nn.Linear(c, classes)

    def forward(self, x):
        x = self.blocks(F.relu(self.stem(x)))
        return self.fc(x.mean(dim=(2, 3)))


class KwargsModel(nn.Module):
    """Takes keyword arguments (a mask among them) and returns a dict."""

    def __init__(self, dim: int = 16, depth: int = 3):
        super().__init__()
        self.inp = nn.Linear(dim, dim)
        self.layers = nn.ModuleList([nn.Linear(dim, dim) for _ in range(depth)])
        self.out = nn.Linear(dim, 2)

    def forward(self, x, *, mask, scale: float = 1.0):
        h = self.inp(x)
        skip = h
        for layer in self.layers:
            h = torch.tanh(layer(h)) * mask + skip * 0.5
        return {"logits": self.out(h) * scale, "hidden": h, "norm": h.norm()}


def tiny_llama(layers: int = 2, tie: bool = True):
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=64, use_cache=False, tie_word_embeddings=tie)
    return LlamaForCausalLM(cfg)


def tiny_gpt2(layers: int = 2):
    from transformers import GPT2Config, GPT2LMHeadModel
    cfg = GPT2Config(vocab_size=64, n_embd=32, n_layer=layers, n_head=4, n_positions=64,
                     use_cache=False, bos_token_id=0, eos_token_id=0, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(cfg)


def init_like_training(model: nn.Module, seed: int = 0) -> nn.Module:
    """Non-trivial weights (HF inits norms to ones), reproducibly."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(max(p.shape[-1], 1)))
    return model
