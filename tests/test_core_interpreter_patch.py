"""The interpreter shortcuts (`device.skip_repatching_in_device_calls`): a kernel calling @triton.jit
helpers computes the same bits as with Triton's own patching, `triton.language` is patched once per
launch, not once per helper call per program, and is left as it was after the launch."""
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

    def count_patches(patch_builtin):
        monkeypatch.setattr(ti, "_patch_builtin", lambda *a: (calls.append(a[0]), patch_builtin(*a))[1])

    count_patches(ti._patch_builtin)
    wrapped = []   # builtins replaced by the interpreter's wrapper, launch by launch
    set_attr = ti._LangPatchScope.set_attr
    monkeypatch.setattr(ti._LangPatchScope, "set_attr", lambda self, obj, name, value: (
        wrapped.append((id(obj), name)) if getattr(value, "__qualname__", "") == "_patch_attr.<locals>.<lambda>"
        else None, set_attr(self, obj, name, value))[1])
    x = torch.randn(100, generator=torch.Generator().manual_seed(0))

    def run():
        calls.clear()
        wrapped.clear()
        out = torch.empty_like(x)
        _kernel[(4,)](x, out, 1.5, x.numel(), BLOCK=32)
        return out, len(calls)

    def left_patched():
        return {(id(obj), name) for obj in (tl, tl.core, tl.math, tl.tensor) for name in dir(obj)
                if getattr(getattr(obj, name, None), "__qualname__", "") == "_patch_attr.<locals>.<lambda>"}

    # Triton's own path leaves a device function's patches in place (it never undoes them), so a kernel
    # run earlier in this process, before the shortcut, may have left some: the launch must add none
    before = left_patched()
    fast, fast_patches = run()
    fast_wrapped = sorted(wrapped)
    # the language is as before once the launch ended
    patched = left_patched() - before
    assert not patched, f"left patched after the launch: {sorted(patched)[:5]}"
    if not before:
        assert tl.core.is_builtin(tl.load) and tl.core.is_builtin(tl.sqrt)
    original_patch, original_launch, original_builtin = ti._inferbook_originals
    monkeypatch.setattr(ti, "_patch_lang", original_patch)
    monkeypatch.setattr(ti.GridExecutor, "__call__", original_launch)
    count_patches(original_builtin)
    slow, slow_patches = run()
    assert torch.equal(fast, slow), "the shortcut changed the kernel's bits"
    assert fast_wrapped == sorted(wrapped) and len(fast_wrapped) > 50, "not the same builtins patched"
    # Triton's own path patches once for the launch and again at each of the 4 programs x 3 helper
    # calls; the shortcut only for the launch
    assert 0 < fast_patches and slow_patches == fast_patches * (1 + 4 * 3), (fast_patches, slow_patches)
