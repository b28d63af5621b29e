"""Small models written in plain torch: the README example and the tests' workloads.

They cover the op families of the target workloads: a Llama-style block (RMS norm, rotary
embedding, causal SDPA, SiLU-gated MLP), a ViT-style encoder (patchify convolution, class token,
layer norm, GELU MLP) and a plain MLP.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class MLP(nn.Module):
    def __init__(self, d_in=64, d_hidden=128, d_out=32):
        super().__init__()
        self.fc1 = nn.Linear(d_in, d_hidden)
        self.fc2 = nn.Linear(d_hidden, d_out)

    def forward(self, x):  # x: [B, d_in]
        return self.fc2(F.gelu(self.fc1(x)))


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim) + 0.1 * torch.randn(dim))

    def forward(self, x):
        var = x.pow(2).mean(-1, keepdim=True)
        return self.weight * (x * torch.rsqrt(var + self.eps))


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class LlamaBlock(nn.Module):
    """One decoder block, gpt-fast style. x: [B, S, D]."""

    def __init__(self, dim=64, n_heads=4, n_kv_heads=2, hidden=172, max_seq=128):
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = n_heads, n_kv_heads, dim // n_heads
        self.wq = nn.Linear(dim, n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(n_heads * self.head_dim, dim, bias=False)
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.attn_norm, self.ffn_norm = RMSNorm(dim), RMSNorm(dim)
        inv = 1.0 / (10000 ** (torch.arange(0, self.head_dim, 2).float() / self.head_dim))
        freqs = torch.outer(torch.arange(max_seq).float(), inv)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def forward(self, x):
        b, s, _ = x.shape
        h = self.attn_norm(x)
        q = self.wq(h).view(b, s, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.wk(h).view(b, s, self.n_kv, self.head_dim).transpose(1, 2)
        v = self.wv(h).view(b, s, self.n_kv, self.head_dim).transpose(1, 2)
        cos, sin = self.cos[:s], self.sin[:s]
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        # grouped-query attention inside SDPA (torch 2.11's export cannot prove the contiguity
        # guards that repeat_interleave / expand+reshape of k, v add for a dynamic S)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           enable_gqa=self.n_kv != self.n_heads)
        y = y.transpose(1, 2).reshape(b, s, -1)
        x = x + self.wo(y)
        h = self.ffn_norm(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


class TinyViT(nn.Module):
    """ViT-style encoder: patchify conv, class token, pre-norm blocks. x: [B, 3, H, W]."""

    def __init__(self, img=32, patch=8, dim=64, depth=2, heads=4, classes=10):
        super().__init__()
        self.patch = nn.Conv2d(3, dim, patch, stride=patch)
        n = (img // patch) ** 2
        self.cls = nn.Parameter(torch.randn(1, 1, dim) * 0.02)
        self.pos = nn.Parameter(torch.randn(1, n + 1, dim) * 0.02)
        self.blocks = nn.ModuleList(
            [nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.0, activation="gelu",
                                        batch_first=True, norm_first=True) for _ in range(depth)])
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, classes)

    def forward(self, x):
        x = self.patch(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], dim=1) + self.pos
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.norm(x)[:, 0])


def hf_gpt2(n_layer=2, n_embd=64, n_head=4, vocab=128, n_positions=64):
    from transformers import GPT2Config, GPT2LMHeadModel
    cfg = GPT2Config(n_layer=n_layer, n_embd=n_embd, n_head=n_head, vocab_size=vocab,
                     n_positions=n_positions, use_cache=False, attn_implementation="sdpa")
    return _logits_only(GPT2LMHeadModel(cfg).eval())


def hf_bert(layers=2, hidden=64, heads=4, vocab=128, max_pos=128):
    from transformers import BertConfig, BertModel
    cfg = BertConfig(num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=heads,
                     intermediate_size=4 * hidden, vocab_size=vocab, max_position_embeddings=max_pos,
                     attn_implementation="sdpa")
    return _first_output(BertModel(cfg, add_pooling_layer=False).eval())


class _logits_only(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids):
        return self.model(input_ids=input_ids, use_cache=False).logits


class _first_output(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids):
        return self.model(input_ids=input_ids).last_hidden_state


# ---- a causal LM with a static KV cache, gpt-fast style ---------------------------------------
class KVCache(nn.Module):
    """Static cache as registered buffers, updated in place at device-side positions."""

    def __init__(self, batch, max_seq, n_kv, head_dim, dtype=torch.float32):
        super().__init__()
        shape = (batch, n_kv, max_seq, head_dim)
        self.register_buffer("k_cache", torch.zeros(shape, dtype=dtype))
        self.register_buffer("v_cache", torch.zeros(shape, dtype=dtype))

    def update(self, input_pos, k_val, v_val):  # input_pos: [T]; k_val, v_val: [B, H_kv, T, D]
        k_out, v_out = self.k_cache, self.v_cache
        k_out[:, :, input_pos] = k_val
        v_out[:, :, input_pos] = v_val
        return k_out, v_out


class CachedAttention(nn.Module):
    def __init__(self, dim, n_heads, n_kv_heads, max_seq, batch=1):
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = n_heads, n_kv_heads, dim // n_heads
        self.wqkv = nn.Linear(dim, (n_heads + 2 * n_kv_heads) * self.head_dim, bias=False)
        self.wo = nn.Linear(n_heads * self.head_dim, dim, bias=False)
        self.kv_cache = KVCache(batch, max_seq, n_kv_heads, self.head_dim)

    def forward(self, x, cos, sin, mask, input_pos):  # x: [B, T, D]; cos, sin: [T, hd]
        b, t, _ = x.shape
        q_size, kv_size = self.n_heads * self.head_dim, self.n_kv * self.head_dim
        q, k, v = self.wqkv(x).split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        k = k.view(b, t, self.n_kv, self.head_dim).transpose(1, 2)
        v = v.view(b, t, self.n_kv, self.head_dim).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        k, v = self.kv_cache.update(input_pos, k, v)   # [B, H_kv, max_seq, D]
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                           enable_gqa=self.n_kv != self.n_heads)
        return self.wo(y.transpose(1, 2).reshape(b, t, -1))


class CachedBlock(nn.Module):
    def __init__(self, dim, n_heads, n_kv_heads, hidden, max_seq):
        super().__init__()
        self.attention = CachedAttention(dim, n_heads, n_kv_heads, max_seq)
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.attention_norm, self.ffn_norm = RMSNorm(dim), RMSNorm(dim)

    def forward(self, x, cos, sin, mask, input_pos):
        h = x + self.attention(self.attention_norm(x), cos, sin, mask, input_pos)
        f = self.ffn_norm(h)
        return h + self.w2(F.silu(self.w1(f)) * self.w3(f))


class CachedLlama(nn.Module):
    """A gpt-fast-style decoder LM: forward(idx [B, T], input_pos [T]) -> logits [B, T, vocab].
    The KV caches are registered buffers, written in place at `input_pos` (a device tensor), so one
    exported program serves prefill (T = prompt length) and decode (T = 1). `tie_embeddings`: the
    output projection is the embedding table (Llama-3.2-1B's tie_word_embeddings)."""

    def __init__(self, vocab=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, hidden=172,
                 max_seq=128, rope_base=10000.0, tie_embeddings=False):
        super().__init__()
        self.max_seq = max_seq
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(
            [CachedBlock(dim, n_heads, n_kv_heads, hidden, max_seq) for _ in range(n_layers)])
        self.norm = RMSNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)
        if tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        head_dim = dim // n_heads
        inv = 1.0 / (rope_base ** (torch.arange(0, head_dim, 2).float() / head_dim))
        freqs = torch.outer(torch.arange(max_seq).float(), inv)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("rope_cos", emb.cos(), persistent=False)
        self.register_buffer("rope_sin", emb.sin(), persistent=False)
        self.register_buffer("causal_mask",
                             torch.tril(torch.ones(max_seq, max_seq, dtype=torch.bool)),
                             persistent=False)

    def reset_cache(self):
        for layer in self.layers:
            layer.attention.kv_cache.k_cache.zero_()
            layer.attention.kv_cache.v_cache.zero_()

    @torch.no_grad()
    def greedy(self, prompt, n: int) -> list[int]:
        """Eager greedy decoding (the reference for generate()): n new ids after a 1-D prompt."""
        self.reset_cache()
        dev = self.causal_mask.device
        logits = self(prompt[None].to(dev), torch.arange(len(prompt), device=dev))
        out, pos = [int(logits[0, -1].argmax())], len(prompt)
        while len(out) < n:
            logits = self(torch.tensor([[out[-1]]], device=dev), torch.tensor([pos], device=dev))
            out.append(int(logits[0, -1].argmax()))
            pos += 1
        return out

    def forward(self, idx, input_pos):  # idx: [B, T] int64, input_pos: [T] int64
        mask = self.causal_mask[None, None, input_pos]          # [1, 1, T, max_seq]
        cos, sin = self.rope_cos[input_pos], self.rope_sin[input_pos]  # [T, hd]
        x = self.tok_embeddings(idx)
        for layer in self.layers:
            x = layer(x, cos, sin, mask, input_pos)
        return self.output(self.norm(x))

