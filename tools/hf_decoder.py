"""A front-end that makes a Hugging Face decoder LM (LlamaForCausalLM, Qwen2ForCausalLM, ...)
exportable with a static KV cache that grace keeps as session state.

    lm = StaticCacheLM(hf_model, max_cache_len=256)
    path = grace.aot.compile(lm, output="lm.grace", **export_kwargs(256, buckets=[64, 256]))
    InterpretSession(path).generate(prompt_ids, 32)

Why a wrapper at all: transformers' own `StaticCache` keeps its tensors on a plain Python object
(transformers/cache_utils.py, `StaticLayer`): `keys`/`values` are allocated lazily inside the first
`update()` (so, traced, they are fresh zeros every call) and `cumulative_length` is a plain tensor
attribute. Non-strict torch.export only swaps tensors it reaches as *module attributes* for traced
inputs; a tensor reached any other way becomes a lifted constant, and `run_decompositions`
refuses a mutated one: "Constant ... is mutated in the forward method. Pls register it as buffer"
(torch/_export/utils.py, `_override_graph_signature_for_temp_registered_constants`).
transformers' `TorchExportableModuleWithStaticCache` (transformers/integrations/executorch.py)
allocates early and registers the same tensors as buffers, but the model still reads them through
the cache object, so each cache tensor enters the program twice, as buffer `key_cache_0` and as
lifted constant `...self_attn.lifted_tensor_2` (the same tensor object). AOT autograd's
`AOTDedupeWrapper` (torch/_functorch/_aot_autograd/runtime_wrappers.py) cannot drop a duplicate
that is mutated, wraps the graph in a function, and `run_decompositions` stops in
torch/_functorch/_aot_autograd/graph_compile.py, `aot_stage2_export`: "expected compiled_fn to be
GraphModule, got <class 'function'>". (An empty `buffers_to_mutate` right after torch.export is
normal in torch 2.13: the training IR keeps in-place ops; the mutations are listed once
`run_decompositions` functionalises them.)

So here the cache tensors are buffers of this module, and the `Cache` handed to transformers is
built afresh in every forward and reads them *through the module* (`getattr(owner, name)`) at call
time, which is exactly what export swaps. Positions come from the caller as a device tensor
(`cache_position`), not from a counter in the cache, so one exported program serves prefill and
decode and the runtime owns "where are we" (grace's generate mode feeds the next position back).
The causal mask is built here from `cache_position` and passed as a 4-D mask, which transformers
returns unchanged (masking_utils.py, `_preprocess_mask_arguments`) — none of its mask machinery
(vmap, compile-decorated helpers, `is_causal` skips that depend on the cache length) is traced.

Batch size 1 only: grace's generate mode drives one sequence per session. Checked with
transformers 5.24 (the cache goes in as `cache=`) and 4.57 (`past_key_values=`, `cache_position=`).
"""
from __future__ import annotations

import functools
import inspect

import torch
from torch import nn


@functools.cache
def _cache_classes():
    """transformers' Cache base classes, imported late so that grace imports without it."""
    from transformers.cache_utils import Cache, CacheLayerMixin

    class BufferCacheLayer(CacheLayerMixin):
        """One layer's K/V: writes at the caller's positions into its owner's buffers and
        returns the whole buffers (the attention mask hides the slots not yet written)."""

        is_compileable = True
        is_sliding = False

        def __init__(self, owner: "StaticCacheLM", index: int, cache_position: torch.Tensor):
            super().__init__()
            self.owner, self.index, self.cache_position = owner, index, cache_position
            self.is_initialized = True
            self.max_cache_len = owner.max_cache_len

        def lazy_initialization(self, key_states, value_states) -> None:
            pass   # the buffers exist from the start

        def update(self, key_states, value_states, *args, **kwargs):
            keys = getattr(self.owner, f"k_cache_{self.index}")      # looked up now: see module doc
            values = getattr(self.owner, f"v_cache_{self.index}")
            keys.index_copy_(2, self.cache_position, key_states.to(keys.dtype))
            values.index_copy_(2, self.cache_position, value_states.to(values.dtype))
            return keys, values

        def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
            return self.max_cache_len, 0

        def get_seq_length(self):
            # only asked when position_ids are missing or a mask is built by transformers; we
            # pass both, so this is the positions' start (a tensor, as StaticLayer returns)
            return self.cache_position[0]

        def get_max_length(self) -> int:
            return self.max_cache_len

        def get_max_cache_shape(self) -> int:   # abstract in transformers 4.5x
            return self.max_cache_len

    class BufferCache(Cache):
        def __init__(self, owner: "StaticCacheLM", cache_position: torch.Tensor):
            super().__init__(layers=[BufferCacheLayer(owner, i, cache_position)
                                     for i in range(owner.num_layers)])

    return BufferCache


class StaticCacheLM(nn.Module):
    """forward(input_ids [1, T] int64, cache_position [T] int64) -> logits [1, T, vocab].

    Token t of the call sits at position cache_position[t] of the sequence: its K/V are written
    there and it attends to cache slots 0..cache_position[t]. Prefill passes arange(P), each
    decode step the next position; positions must stay below `max_cache_len`."""

    def __init__(self, hf_model: nn.Module, max_cache_len: int):
        super().__init__()
        config = hf_model.config
        impl = getattr(config, "_attn_implementation", None) or "eager"
        if impl not in ("sdpa", "eager"):
            raise ValueError(f"attn_implementation {impl!r} is not supported: load the model with "
                             "attn_implementation='sdpa' (or 'eager')")
        layer_types = getattr(config, "layer_types", None) or []
        if any(t != "full_attention" for t in layer_types):   # a full-length mask would be wrong
            raise ValueError("only full-attention layers are supported, got "
                             f"{sorted(set(layer_types))}")
        max_pos = getattr(config, "max_position_embeddings", None)
        if max_pos is not None and max_cache_len > max_pos:
            raise ValueError(f"max_cache_len {max_cache_len} exceeds the model's "
                             f"max_position_embeddings {max_pos}")
        self.model = hf_model.eval()
        # transformers 5 takes the cache as `cache` and derives positions from position_ids;
        # 4.5x takes `past_key_values` and `cache_position`
        params = inspect.signature(hf_model.forward).parameters
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"
        self._takes_cache_position = "cache_position" in params
        self.max_cache_len = int(max_cache_len)
        self.num_layers = config.num_hidden_layers
        self.attn_implementation = impl
        n_kv = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        head_dim = (getattr(config, "head_dim", None)
                    or config.hidden_size // config.num_attention_heads)
        dtype = next(hf_model.parameters()).dtype
        device = next(hf_model.parameters()).device
        shape = (1, n_kv, self.max_cache_len, head_dim)
        for i in range(self.num_layers):
            # non-persistent: the caches are session state, not weights, and start at zero
            self.register_buffer(f"k_cache_{i}", torch.zeros(shape, dtype=dtype, device=device),
                                 persistent=False)
            self.register_buffer(f"v_cache_{i}", torch.zeros(shape, dtype=dtype, device=device),
                                 persistent=False)

    def reset_cache(self) -> None:
        for name, buf in self.named_buffers():
            if name.startswith(("k_cache_", "v_cache_")):
                buf.zero_()

    def causal_mask(self, cache_position: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """[1, 1, T, max_cache_len]: a query at position p sees slots 0..p. sdpa takes it as bool
        (grace skips all-false key blocks); eager attention adds it, so there it is 0 / -inf."""
        slots = torch.arange(self.max_cache_len, device=cache_position.device)
        allowed = (slots[None, :] <= cache_position[:, None])[None, None]
        if self.attn_implementation == "sdpa":
            return allowed
        zero = torch.zeros((), dtype=dtype, device=cache_position.device)
        return torch.where(allowed, zero, zero - float("inf"))

    def forward(self, input_ids: torch.Tensor, cache_position: torch.Tensor) -> torch.Tensor:
        if input_ids.dim() != 2 or input_ids.shape[0] != 1:
            raise ValueError(f"StaticCacheLM runs batch size 1 only: input_ids must be [1, T], "
                             f"got {list(input_ids.shape)}")
        cache = _cache_classes()(self, cache_position)
        mask = self.causal_mask(cache_position, self.k_cache_0.dtype)
        kwargs = {self._cache_kwarg: cache}
        if self._takes_cache_position:
            kwargs["cache_position"] = cache_position
        out = self.model(input_ids=input_ids, attention_mask=mask,
                         position_ids=cache_position[None], use_cache=True, **kwargs)
        return out.logits


def export_kwargs(max_cache_len: int, buckets=None, example_len: int = 5) -> dict:
    """Keyword arguments for `grace.aot.compile(StaticCacheLM(...), output=..., **kw)`: example
    inputs, a dynamic token count `seq` (1..max_cache_len) shared by both inputs, its buckets
    (default: max_cache_len only; decode gets its own T = 1 graph from generate mode) and the
    generate mapping."""
    from torch.export import Dim

    seq = Dim("seq", min=1, max=int(max_cache_len))
    example_len = max(2, min(int(example_len), int(max_cache_len)))   # 1 would specialise T
    return {
        "example_inputs": (torch.zeros(1, example_len, dtype=torch.long),
                           torch.arange(example_len)),
        "dynamic_shapes": {"input_ids": {1: seq}, "cache_position": {0: seq}},
        "buckets": {"seq": list(buckets) if buckets else [int(max_cache_len)]},
        "generate": {"tokens": "input_ids", "positions": "cache_position"},
    }


@torch.no_grad()
def greedy(hf_model: nn.Module, prompt: torch.Tensor, n: int) -> list[int]:
    """Eager greedy reference: n new ids after a 1-D prompt, recomputing the whole sequence each
    step without any cache, so it shares nothing with StaticCacheLM (and no eos stops it early,
    as in grace's generate without eos_token_id)."""
    seq = prompt.reshape(1, -1).to(next(hf_model.parameters()).device)
    out = []
    for _ in range(n):
        logits = hf_model(input_ids=seq, use_cache=False).logits
        nxt = int(logits[0, -1].argmax())
        out.append(nxt)
        seq = torch.cat([seq, seq.new_tensor([[nxt]])], dim=1)
    return out
