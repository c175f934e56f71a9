"""Make Triton's interpreter round like the GPU, so CPU runs of the kernel show its exact results.

Triton 3.8's interpreter (``triton/runtime/interpreter.py``) computes two things
differently from every GPU it targets:

- ``tl.fma(x, y, z)`` as ``x * y + z`` in float32, rounded twice. The kernel's
  scaled fp8 store (``_round_for_store``: reciprocal, then a residual step that
  is exact only through a fused multiply-add) is then merely within an ulp of
  ``x / scale``, so ties and near-ties of the fp8 grid come out wrong.
- float32 -> bfloat16 as a truncation (``cast_impl`` passes no rounding mode;
  its RTNE branch also rounds half up, not to even), where the GPU's
  ``cvt.rn.bf16.f32`` (and torch) round to nearest even.

:func:`install` replaces those two builder methods with IEEE-exact versions:
the fma in float64 with an error-free sum and round-to-odd before the final
rounding to float32 (exact: 53 >= 24 + 2 bits), the bf16 cast by torch's own
round-to-nearest-even. ``tests/backends/test_triton.py`` checks both against
exact rational arithmetic and through a kernel, so a Triton upgrade that renames
the hooks fails loudly instead of silently running the old rounding.

It also changes one thing the other way. Triton 3.8 negates a float (``-v``)
with a true negation, while Triton 3.6 (the GPU image's) compiles ``-v`` as
``0 - v``, which is +0, not -0, for ``v = +0``. The interpreter's negation does
as 3.6's, so that a kernel whose zeros' signs rest on a negation fails here as it
would there (a residual step once turned -0 quotients into +0 on an H100;
``test_the_interpreter_negates_as_triton_3_6_compiles`` checks the hook). The
two Tritons differ there, so where a zero's sign matters the kernel multiplies
by -1 instead, which both compile alike. Everything else of the interpreter is
unchanged.

What CI still cannot show (the ``gpu`` tests do): the GPU's own fp8
conversion instructions, the compiler's contraction of ``a * b + c`` into fma
in the rotation, and the GPU's handling of float32 subnormals.
"""

from __future__ import annotations

import numpy as np
import torch


def exact_fma32(x, y, z) -> np.ndarray:
    """``round_to_float32(x * y + z)`` with a single rounding, for float32 arrays (or scalars)."""
    x64, y64, z64 = (np.asarray(a, dtype=np.float64) for a in (x, y, z))
    with np.errstate(invalid="ignore", over="ignore"):
        p = x64 * y64  # exact: two 24-bit significands need 48 bits
        s = p + z64
        # TwoSum: s + err == p + z exactly.
        bz = s - p
        err = (p - (s - bz)) + (z64 - bz)
        # Round to odd: s is off the exact sum only when err != 0; forcing its last bit to 1
        # then makes the final rounding to 24 bits see which side of a tie the exact sum is on.
        bits = s.view(np.int64)
        nudge = np.isfinite(s) & (err != 0) & ((bits & 1) == 0)
        s = np.where(nudge, np.nextafter(s, np.where(err > 0, np.inf, -np.inf)), s)
        return s.astype(np.float32)


def rne_bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 values as bfloat16 bit patterns (uint16), rounded to nearest even like the GPU."""
    t = torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32)).to(torch.bfloat16)
    return t.view(torch.int16).numpy().view(np.uint16).reshape(np.shape(x))


_installed = False


def install() -> None:
    """Patch the interpreter's builder (idempotent). Raises if Triton's interpreter has changed shape."""
    global _installed
    if _installed:
        return
    import triton.language as tl
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    for hook in ("create_fma", "cast_impl", "create_fneg", "unary_op"):
        if not callable(getattr(builder, hook, None)):
            raise RuntimeError(f"Triton's InterpreterBuilder has no {hook}; update tests/exact_interpreter.py")
    handle = interpreter.TensorHandle
    original_fma, original_cast = builder.create_fma, builder.cast_impl

    def create_fma(self, x, y, z):
        if z.dtype.scalar == tl.float32:
            return handle(exact_fma32(x.data, y.data, z.data), z.dtype.scalar)
        return original_fma(self, x, y, z)

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            return handle(rne_bf16_bits(src.data), dst_type.scalar)
        return original_cast(self, src, dst_type)

    def create_fneg(self, x):
        return self.unary_op(x, lambda a: np.zeros_like(a) - a)  # Triton 3.6's 0 - v

    builder.create_fma = create_fma
    builder.cast_impl = cast_impl
    builder.create_fneg = create_fneg
    _installed = True
