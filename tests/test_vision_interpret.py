"""The CNN family on the CPU: convolutions (grouped, depthwise, 1-D, 3-D, transposed), batch norm
(folded and standalone), pooling, resampling and index shuffles, compiled and run through the
interpreter against fp64 eager on fresh inputs (NaN-poisoned arena)."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")
nn = torch.nn
F = torch.nn.functional

from tests.test_e2e_interpret import check  # noqa: E402

pytestmark = pytest.mark.slow


def _randomize_bn(model):
    """Fresh BatchNorm layers normalise by mean 0, var 1: give them real statistics."""
    g = torch.Generator().manual_seed(1)
    for m in model.modules():
        if isinstance(m, (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)):
            m.running_mean.copy_(torch.randn(m.num_features, generator=g) * 0.5)
            m.running_var.copy_(torch.rand(m.num_features, generator=g) + 0.5)
            m.weight.data.copy_(torch.randn(m.num_features, generator=g))
            m.bias.data.copy_(torch.randn(m.num_features, generator=g))
    return model


class Bottleneck(nn.Module):
    def __init__(self, cin, mid, cout, stride):
        super().__init__()
        self.c1, self.b1 = nn.Conv2d(cin, mid, 1, bias=False), nn.BatchNorm2d(mid)
        self.c2, self.b2 = nn.Conv2d(mid, mid, 3, stride, 1, bias=False), nn.BatchNorm2d(mid)
        self.c3, self.b3 = nn.Conv2d(mid, cout, 1, bias=False), nn.BatchNorm2d(cout)
        self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False),
                                  nn.BatchNorm2d(cout))

    def forward(self, x):
        y = F.relu(self.b1(self.c1(x)))
        y = F.relu(self.b2(self.c2(y)))
        return F.relu(self.b3(self.c3(y)) + self.down(x))


class TinyResNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem, self.bn = nn.Conv2d(3, 8, 7, 2, 3, bias=False), nn.BatchNorm2d(8)
        self.blocks = nn.Sequential(Bottleneck(8, 4, 16, 1), Bottleneck(16, 8, 24, 2))
        self.fc = nn.Linear(24, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.bn(self.stem(x))), 3, 2, 1)
        x = self.blocks(x)
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


class TinyMobileNet(nn.Module):
    """Inverted residuals: 1x1 expand, depthwise 3x3 (stride 2, and a channel multiplier), SE
    with hardsigmoid, hardswish, a batch norm that follows no convolution."""

    def __init__(self):
        super().__init__()
        self.stem, self.b0 = nn.Conv2d(3, 8, 3, 2, 1, bias=False), nn.BatchNorm2d(8)
        self.exp, self.b1 = nn.Conv2d(8, 16, 1, bias=False), nn.BatchNorm2d(16)
        self.dw, self.b2 = nn.Conv2d(16, 16, 3, 2, 1, groups=16, bias=False), nn.BatchNorm2d(16)
        self.dw2 = nn.Conv2d(16, 32, 5, 1, 2, groups=16)          # multiplier 2, with bias
        self.se1, self.se2 = nn.Conv2d(32, 8, 1), nn.Conv2d(8, 32, 1)
        self.proj, self.b3 = nn.Conv2d(32, 12, 1, bias=False), nn.BatchNorm2d(12)
        self.post = nn.BatchNorm2d(12)
        self.fc = nn.Linear(12, 5)

    def forward(self, x):
        x = F.hardswish(self.b0(self.stem(x)))
        x = F.hardswish(self.b1(self.exp(x)))
        x = F.hardswish(self.b2(self.dw(x)))
        x = F.silu(self.dw2(x))
        s = F.hardsigmoid(self.se2(F.relu(self.se1(F.adaptive_avg_pool2d(x, 1)))))
        x = self.b3(self.proj(x * s))
        x = F.mish(self.post(x + 1.0))
        return self.fc(x.mean((2, 3)))


def test_resnet_style(tmp_path):
    check(_randomize_bn(TinyResNet()), lambda: (torch.randn(2, 3, 33, 31),), tmp_path, tol=1e-4)


def test_mobilenet_style(tmp_path):
    check(_randomize_bn(TinyMobileNet()), lambda: (torch.randn(2, 3, 32, 30),), tmp_path,
          tol=1e-4)


def test_batch_norm_folds_into_the_convolution():
    """A conv + batch norm lowers to the GEMM alone, and the conv's own weights are not stored
    (nor the folded ones: K = 27 is padded to 32, and only the padded copy is read)."""
    from grace.aot.export import export_model, to_core_aten
    from grace.aot.lower import lower
    m = _randomize_bn(nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU())).eval()
    program = lower(to_core_aten(export_model(m, (torch.randn(1, 3, 8, 8),))))
    assert [k.family for k in program.kernels] == ["pointwise", "matmul", "pointwise"]
    assert sorted(b.name for b in program.weights) == ["fold.convolution.bias",
                                                       "fold.convolution.weight.padded"]


class Convs(nn.Module):
    def __init__(self):
        super().__init__()
        self.g = nn.Conv2d(8, 12, 3, 1, 1, groups=4)
        self.g2 = nn.Conv2d(8, 8, (3, 2), (2, 1), (1, 0), dilation=(1, 2), groups=2, bias=False)
        self.c1 = nn.Conv1d(4, 6, 3, 2, 1)
        self.dw1 = nn.Conv1d(4, 8, 5, padding=2, groups=4)
        self.c3 = nn.Conv3d(2, 3, 3, 1, 1)
        self.t = nn.ConvTranspose2d(8, 6, 3, 2, 1, output_padding=1, groups=2)
        self.b1 = nn.BatchNorm1d(6)

    def forward(self, x, y, z):
        return (self.g(x).sum() + self.g2(x).sum(), self.b1(self.c1(y)), self.dw1(y),
                self.c3(z), self.t(x))


def test_convolutions(tmp_path):
    m = _randomize_bn(Convs())
    make = lambda: (torch.randn(2, 8, 9, 10), torch.randn(2, 4, 11), torch.randn(1, 2, 5, 4, 6))
    check_all(m, make, tmp_path)


class Pools(nn.Module):
    def forward(self, x, z):
        return (F.max_pool2d(x, 3, 2, 1), F.max_pool2d(x, 2, ceil_mode=True),
                F.max_pool2d(x, (3, 2), (1, 2), (1, 1), dilation=(2, 1)),
                F.avg_pool2d(x, 3, 2, 1), F.avg_pool2d(x, 3, 2, 1, count_include_pad=False),
                F.avg_pool2d(x, 3, 2, 1, ceil_mode=True), F.avg_pool2d(x, 2, divisor_override=3),
                F.adaptive_avg_pool2d(x, (3, 4)), F.adaptive_max_pool2d(x, (4, 3)),
                F.adaptive_avg_pool1d(x.flatten(2), 5), F.max_pool1d(x.flatten(2), 4),
                F.avg_pool1d(x.flatten(2), 3), F.max_pool3d(z, 2), F.avg_pool3d(z, 2, 1),
                F.adaptive_avg_pool3d(z, (2, 1, 3)))


def check_all(model, make, tmp_path, tol=1e-5):
    """Every output of `model` matches fp64 eager: one compile, one interpreter run."""
    import numpy as np

    from grace.aot import compile as grace_compile
    from grace.formats import read_package
    from tests.test_e2e_interpret import interpret, rel_err
    torch.manual_seed(0)
    model = model.eval()
    path = grace_compile(model, make(), output=tmp_path / "m.grace", progress=False,
                         fp32_matmul="ieee")
    fresh = make()
    names = [i["name"] for i in read_package(path).manifest["inputs"]]
    outs = interpret(path, {n: x.numpy() for n, x in zip(names, fresh)}, tmp_path)
    with torch.no_grad():
        refs = model.double()(*[x.double() if x.is_floating_point() else x for x in fresh])
    refs = refs if isinstance(refs, tuple) else (refs,)
    got = [outs[k] for k in sorted(outs, key=lambda k: int(k[3:] or 0))]
    assert len(got) == len(refs)
    for i, (g, r) in enumerate(zip(got, refs)):
        assert g.shape == tuple(r.shape), (i, g.shape, r.shape)
        assert not np.isnan(g).any(), f"output {i}: NaN (a kernel read memory nobody wrote)"
        err = rel_err(g, r.numpy())
        assert err < tol, f"output {i}: relative error {err:.2e}"


def test_pools(tmp_path):
    check_all(Pools(), lambda: (torch.randn(2, 3, 9, 11), torch.randn(1, 2, 5, 6, 4)), tmp_path)


class Resample(nn.Module):
    def forward(self, x):
        return (F.interpolate(x, scale_factor=2, mode="nearest"),
                F.interpolate(x, size=(7, 5), mode="nearest"),
                F.interpolate(x, scale_factor=1.5, mode="nearest-exact"),
                F.interpolate(x, size=(12, 17), mode="bilinear", align_corners=False),
                F.interpolate(x, scale_factor=2, mode="bilinear", align_corners=True),
                F.interpolate(x, size=(3, 4), mode="bilinear"),
                F.interpolate(x.flatten(2), size=30, mode="linear"),
                torch.flip(x, [1, 3]), x.repeat(2, 1, 3, 1), x[0].repeat(2, 1, 1, 1),
                torch.diagonal(x, 0, 2, 3), torch.diagonal(x, 2, -1, -2),
                torch.diagonal(x, -1, 0, 1), x.unfold(2, 3, 2), x.unfold(-1, 2, 1),
                # a channels-last value restrided by the decomposition (as_strided), and directly
                F.adaptive_avg_pool2d(x.permute(0, 2, 3, 1).relu().permute(0, 3, 1, 2), 1),
                torch.as_strided(x, (2, 4), (3, 1), 5), torch.as_strided(x.exp(), (3, 3), (1, 8)))


def test_resample_and_shuffles(tmp_path):
    check_all(Resample(), lambda: (torch.randn(2, 3, 6, 8),), tmp_path)


class Select(nn.Module):
    def __init__(self, inner, i):
        super().__init__()
        self.inner, self.i = inner, i

    def forward(self, *args):
        return self.inner(*args)[self.i]


def test_cnn_with_a_dynamic_batch(tmp_path):
    """Convolutions (im2col, grouped, depthwise), folded batch norm and pooling over a batch that
    is a dynamic dimension: one package, batches that are and are not bucket sizes."""
    import numpy as np
    from torch.export import Dim

    from grace.aot import compile as grace_compile
    from tests.test_buckets_interpret import rel_err, run_cases

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.c, self.bn = nn.Conv2d(3, 8, 3, 2, 1, bias=False), nn.BatchNorm2d(8)
            self.g = nn.Conv2d(8, 8, 3, 1, 1, groups=2)
            self.dw = nn.Conv2d(8, 8, 3, 1, 1, groups=8)
            self.fc = nn.Linear(8, 4)

        def forward(self, x):
            x = F.max_pool2d(F.relu(self.bn(self.c(x))), 2)
            x = F.avg_pool2d(self.dw(F.relu(self.g(x))), 2, 1)
            return self.fc(F.adaptive_avg_pool2d(x, 1).flatten(1))

    torch.manual_seed(0)
    model = _randomize_bn(Net()).eval()
    path = grace_compile(model, (torch.randn(2, 3, 16, 16),), output=tmp_path / "m.grace",
                         progress=False, fp32_matmul="ieee", buckets={"batch": [4, 8]},
                         dynamic_shapes={"x": {0: Dim("batch", min=1, max=8)}})
    inputs = {f"B{n}": torch.randn(n, 3, 16, 16) for n in (1, 3, 4, 7)}
    results = run_cases(path, {c: {"x": x.numpy()} for c, x in inputs.items()}, tmp_path)
    with torch.no_grad():
        for case, x in inputs.items():
            got = results[case]
            assert "error" not in got, got.get("error")
            ref = model.double()(x.double()).numpy()
            assert got["out"].shape == ref.shape
            assert not np.isnan(got["out"]).any()
            assert rel_err(got["out"], ref) < 1e-5, case
            assert str(got["graph"]) == ("batch=4" if x.shape[0] <= 4 else "batch=8")


def test_mobilenet_style_fp16(tmp_path):
    """Half precision: the folded weights are rounded once, the depthwise sums run in fp32."""
    check(_randomize_bn(TinyMobileNet()), lambda: (torch.randn(2, 3, 32, 30).half(),), tmp_path,
          tol=2e-2, dtype=torch.float16)


class VisionEdges(nn.Module):
    """Edge sizes: 1x1 maps, windows as large as the input, adaptive pooling to a larger size
    (overlapping windows), upsampling from 1x1, size-1 flips, a zero repeat (empty output)."""

    def __init__(self):
        super().__init__()
        self.c = nn.Conv2d(3, 4, 3, padding=1)
        self.dw = nn.Conv2d(3, 3, 3, padding=1, groups=3)

    def forward(self, x, y):
        return (self.c(y), self.dw(y), F.max_pool2d(x, (2, 3)), F.avg_pool2d(x, (2, 3)),
                F.adaptive_avg_pool2d(x, (3, 5)), F.adaptive_max_pool2d(x, (3, 4)),
                F.interpolate(y, scale_factor=3, mode="nearest"),
                F.interpolate(y, size=(2, 3), mode="bilinear"),
                torch.flip(y, [0, 2, 3]), x.repeat(1, 0, 1, 1), x.unfold(3, 3, 1))


def test_vision_ops_at_edge_sizes(tmp_path):
    check_all(VisionEdges(), lambda: (torch.randn(1, 3, 2, 3), torch.randn(1, 3, 1, 1)), tmp_path)
