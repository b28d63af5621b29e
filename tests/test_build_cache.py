"""The cubin cache key (aot/build.py): a changed recipe or option is a miss, so ~/.cache/grace never
serves a cubin that the current build.py would not have produced. No Triton compile runs here: the
cache entries are written by hand."""
from __future__ import annotations

import json
from dataclasses import replace

import pytest

pytest.importorskip("triton")

from grace.aot import build  # noqa: E402

REQ = build.BuildRequest("k", "def k(p0):\n    pass\n", ("*fp32",), 4, 3, "sm_90")


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("GRACE_CACHE_DIR", str(tmp_path))
    return tmp_path


def _store(req):
    """What compile_one leaves in the cache for `req`."""
    path = build.cache_dir() / f"{req.key()}.json"
    path.write_text(json.dumps({"shared": 0, "num_warps": req.num_warps, "global_scratch_size": 0,
                                "profile_scratch_size": 0}))
    path.with_suffix(".cubin").write_bytes(b"\x7fELF")


def test_a_cached_request_is_served_from_the_cache(cache):
    _store(REQ)
    assert build.is_cached(REQ)
    assert build.compile_one(REQ).cubin == b"\x7fELF"   # no Triton compile: the cached bytes


def test_a_new_recipe_version_misses_the_cache(cache, monkeypatch):
    _store(REQ)
    monkeypatch.setattr(build, "RECIPE_VERSION", build.RECIPE_VERSION + 1)
    assert not build.is_cached(REQ)


@pytest.mark.parametrize("change", [
    {"num_warps": 8}, {"num_stages": 2}, {"arch": "sm_80"}, {"param_types": ("*fp16",)},
    {"source": REQ.source + "\n"}, {"options": (("enable_fp_fusion", False),)},
])
def test_every_option_is_in_the_key(cache, change):
    _store(REQ)
    other = replace(REQ, **change)
    assert other.key() != REQ.key() and not build.is_cached(other)


def test_the_key_hashes_what_compile_one_hands_triton():
    """The recipe is read from the request by the key and by compile_one alike."""
    req = replace(REQ, param_types=("*fp32", "i64", "*i64"), options=(("debug", True),))
    assert req.triton_options() == {"num_warps": 4, "num_stages": 3, "debug": True}
    assert req.attrs() == {(0,): [["tt.divisibility", 16]], (2,): [["tt.divisibility", 16]]}
    assert req.target() == ("cuda", 90, 32)
