"""Decode-graph knobs on the H200 (tests/test_decode_knobs.py on the CPU): each alone and all
together, against a package with every knob off, fp32 and bf16, NaN-poisoned sessions. Each case
compiles a package of its own, so under `--dist loadgroup` (tests/gpu/conftest.py) they run in
four xdist groups, two a dtype, each building its dtype's baseline once: in one file's queue the
twenty cases were the GPU suite's critical path (the twenty-ninth session's suite was cut at
430 s inside them).

Run with `pytest -m gpu tests/gpu`.
"""
from __future__ import annotations

import pytest

pytestmark = pytest.mark.gpu

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA GPU: run these on the H200 (pytest -m gpu)", allow_module_level=True)

from grace.runtime import load  # noqa: E402
from grace.tools.models import CachedLlama  # noqa: E402
from test_generate_gpu import MAX_SEQ, NEW, _compile, _logits_and_tokens, _rel  # noqa: E402


# decode-graph knobs (tests/test_decode_knobs.py on the CPU), each alone and all together, against
# a package with all of them off (the split-K GEMV's default K, 8192, is past this model's 2048)
_ATTN_OFF = "lower.SHARE_MIN_READS=0,codegen.ATTN_PACK_GQA=0,codegen.ATTN_V_EARLY=False"
_OFF = (f"{_ATTN_OFF},fuse_append.APPEND_AFTER_ATTENTION=False,"
        "codegen.ATTN_KV_BEFORE_WAIT=False,fuse_rows.PAIR_GATE_UP=False,"
        "codegen.GEMV_PREFETCH_ALL_MAX_BYTES=0")
KNOBS_OFF = f"off:{_OFF}"


def _off_but(name, settings):
    """The baseline with the knob's own settings replacing the baseline's value for them (a
    variant refuses a constant set twice)."""
    own = {part.split("=")[0] for part in settings.split(",")}
    kept = [part for part in _OFF.split(",") if part.split("=")[0] not in own]
    return f"{name}:{','.join(kept + settings.split(','))}"


KNOBS = {
    "split": "split:codegen.GEMV_SPLIT_MIN_K=2048,lower.SHARE_MIN_READS=0,codegen.ATTN_PACK_GQA=0,"
             "codegen.ATTN_V_EARLY=False",
    "share": "share:codegen.ATTN_PACK_GQA=0,codegen.ATTN_V_EARLY=False",
    "gqa": "gqa:lower.SHARE_MIN_READS=0,codegen.ATTN_V_EARLY=False",
    "vearly": "vearly:lower.SHARE_MIN_READS=0,codegen.ATTN_PACK_GQA=0",
    "pfall": _off_but("pfall", "codegen.GEMV_PREFETCH_ALL_MAX_BYTES=16777216"),
    # the split down projections sum their own splits (aot/fuse_splitk.py)
    "splitk": f"splitk:{_OFF},codegen.GEMV_SPLIT_MIN_K=2048,fuse_splitk.SPLIT_K_IN_KERNEL=True",
    # the split down projections summed by the RMSNorm's mean after them (aot/fuse_norm.py)
    "foldmean": f"foldmean:{_OFF},codegen.GEMV_SPLIT_MIN_K=2048,"
                "fuse_norm.FOLD_INTO_ROW_REDUCTIONS=True",
    # the RMSNorm means reduced inside the template GEMVs that read them (aot/fuse_stats.py)
    "fold": _off_but("fold", "fuse_stats.FOLD_INTO_TEMPLATE=True"),
    "all": "all:codegen.GEMV_SPLIT_MIN_K=2048,codegen.GEMV_PREFETCH_ALL_MAX_BYTES=16777216",
    # the appends after the attention, which loads its key blocks before gdc_wait()
    "kvearly": f"kvearly:{_ATTN_OFF},fuse_append.APPEND_AFTER_ATTENTION=True,"
               "codegen.ATTN_KV_BEFORE_WAIT=True,fuse_append.APPEND_IN_ATTENTION=False",
    # and the appends stored by the attention itself, no kernels of their own
    "inattn": f"inattn:{_ATTN_OFF},fuse_append.APPEND_AFTER_ATTENTION=True,"
              "codegen.ATTN_KV_BEFORE_WAIT=True,fuse_append.APPEND_IN_ATTENTION=True",
    # the gate+up GEMVs store silu(gate) * up for the down projections (aot/fuse_rows.py)
    "pair": _off_but("pair", "fuse_rows.PAIR_GATE_UP=True"),
    # the split-KV attentions combine their own splits, no attn_combine kernels (fuse_combine)
    "combine": _off_but("combine", "fuse_combine.COMBINE_IN_ATTENTION=True"),
    # GEMV tiles by the row's kind: 2 rows where the grid is small, 8 where the row is an expression
    "rowtiles": f"rowtiles:{_OFF},fuse_rows.PLAIN_ROW_TILE=2048,fuse_rows.PLAIN_ROW_MAX_PER_SM=6,"
                "fuse_rows.EXPR_ROW_TILE=8192",
}


@pytest.fixture(scope="module")
def knob_baseline(tmp_path_factory):
    """Per dtype: the decoder the knobs are tried on (a K-2048 down projection to split), and the
    logits and tokens of its package with every knob off, computed once for all knobs."""
    from grace.tools.variants import applied, parse_variant
    made = {}

    def get(dtype):
        if dtype not in made:
            torch.manual_seed(0)
            model = CachedLlama(vocab=512, dim=256, n_layers=4, n_heads=8, n_kv_heads=2,
                                hidden=2048, max_seq=MAX_SEQ).eval().to(dtype)
            path = tmp_path_factory.mktemp("knobs") / "plain.grace"
            with applied(parse_variant(KNOBS_OFF)):
                plain = load(_compile(model, path, **_knob_kw(dtype)))
            made[dtype] = model, _logits_and_tokens(plain, KNOB_PROMPT)
        return made[dtype]
    return get


KNOB_PROMPT = torch.randint(0, 512, (40,), generator=torch.Generator().manual_seed(5))


def _knob_kw(dtype):
    return {"fp32_matmul": "ieee"} if dtype == torch.float32 else {}


@pytest.mark.parametrize("dtype", [
    pytest.param(torch.float32, marks=pytest.mark.xdist_group("knobs-fp32"), id="dtype0"),
    pytest.param(torch.bfloat16, marks=pytest.mark.xdist_group("knobs-bf16"), id="dtype1")])
@pytest.mark.parametrize("knob", [pytest.param(k, marks=pytest.mark.xdist_group(f"half{i % 2}"))
                                  for i, k in enumerate(sorted(KNOBS))])
def test_decode_knobs_keep_the_logits(tmp_path, knob_baseline, knob, dtype):
    """Split-K GEMVs (the down projection's K 2048 in 2 chunks), the shared residual stream,
    packed grouped-query heads, values loaded with their keys and small GEMVs' weights all
    loaded before the wait: prefill and decode logits as the knobs-off package's (fp32: to
    summation order; bf16: to its rounding), NaN-poisoned sessions, and in fp32 generate() gives
    eager's greedy tokens."""
    from grace.tools.variants import applied, parse_variant

    model, (want, want_tokens) = knob_baseline(dtype)
    with applied(parse_variant(KNOBS[knob])):
        knobbed = load(_compile(model, tmp_path / f"{knob}.grace", **_knob_kw(dtype)))
    got, got_tokens = _logits_and_tokens(knobbed, KNOB_PROMPT)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for g, w in zip(got, want):
        assert torch.isfinite(g).all() and _rel(g, w) < tol
    if dtype == torch.float32:
        assert got_tokens == want_tokens == model.greedy(KNOB_PROMPT, NEW)
