"""The interpreter shortcut (`device.skip_repatching_in_device_calls`): a kernel calling @triton.jit
helpers computes the same bits, and `triton.language` is patched once per launch, not once per
helper call per program."""
import pytest
import torch

from inferbook import device

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402
from triton.runtime import interpreter as ti  # noqa: E402


@triton.jit
def _scaled(x, s):
    return x * s + tl.sqrt(tl.abs(x))


@triton.jit
def _twice(x, s):
    return _scaled(_scaled(x, s), s)


@triton.jit
def _kernel(x_ptr, out_ptr, s, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask)
    tl.store(out_ptr + offs, _twice(x, s), mask=mask)


@pytest.mark.skipif(not device.triton_interpreted(), reason="the shortcut is for the interpreter")
def test_helpers_compute_the_same_bits_with_one_patch_per_launch(monkeypatch):
    assert device.skip_repatching_in_device_calls() and ti._inferbook_skips_repatching
    calls = []
    patch_builtin = ti._patch_builtin
    monkeypatch.setattr(ti, "_patch_builtin", lambda *a: (calls.append(a[0]), patch_builtin(*a))[1])
    x = torch.randn(100, generator=torch.Generator().manual_seed(0))

    def run():
        calls.clear()
        out = torch.empty_like(x)
        _kernel[(4,)](x, out, 1.5, x.numel(), BLOCK=32)
        return out, len(calls)

    fast, fast_patches = run()
    # the language is as before once the launch ended: its builtins are Triton's own again
    assert tl.core.is_builtin(tl.load) and tl.core.is_builtin(tl.sqrt)
    original_patch, original_launch = ti._inferbook_originals
    monkeypatch.setattr(ti, "_patch_lang", original_patch)
    monkeypatch.setattr(ti.GridExecutor, "__call__", original_launch)
    slow, slow_patches = run()
    assert torch.equal(fast, slow), "the shortcut changed the kernel's bits"
    # Triton's own path patches once for the launch and again at each of the 4 programs x 3 helper
    # calls; the shortcut only for the launch
    assert 0 < fast_patches and slow_patches == fast_patches * (1 + 4 * 3), (fast_patches, slow_patches)
