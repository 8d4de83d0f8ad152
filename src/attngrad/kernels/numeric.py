"""Scalar building blocks shared by every numba kernel: dtype widening/narrowing and a vectorisable exp.

Kernels see tensor data through the numpy views made by :func:`attngrad.kernels.tensor_view.kernel_view`:
float32 data as ``float32``, bfloat16 data as ``uint16`` and float16 data as ``int16``. ``widen`` and
``narrow`` dispatch on that element type at compile time, so one kernel source serves the three dtypes
and numba compiles one specialisation per dtype.

Rounding: ``narrow`` rounds to nearest, ties to even (CANN's CAST_RINT), and keeps nan and inf.
float16 conversions use the CPU's F16C instructions (LLVM ``fpext``/``fptrunc`` of ``half``) when the
compile target has them, else the exact integer versions below; both give the same bits (tests/test_numeric.py).

Vector code: LLVM vectorises a loop only through operations it can prove lane-independent, so the helpers
here are written as LLVM intrinsics where numba's own lowering would block it (``fmaximum`` for a max
reduction, ``rint`` and a 2**n bit build in ``exp32``, a bit mask expanded to floats in ``select_bits``), and
``prefer_512_bit_vectors`` lets a kernel use AVX-512 registers where LLVM's default for this CPU is 256 bits.
"""

from __future__ import annotations

import math
import platform

import numpy as np
from llvmlite import ir
from numba import carray, njit, types
from numba.core import cgutils, config
from numba.core.codegen import get_host_cpu_features
from numba.extending import intrinsic, overload

# fastmath without the no-nan / no-inf assumptions: nan and inf must propagate as CANN's kernels propagate them.
FASTMATH = {"reassoc", "contract", "arcp", "nsz", "afn"}

_TWO_POW_112 = np.float32(2.0**112)


def widen(x):  # pragma: no cover - compiled through the overload below
    """Element of a kernel view -> float32 (exact)."""
    raise NotImplementedError


def narrow(v, like):  # pragma: no cover
    """float32 -> element type of ``like`` (a kernel-view array), round to nearest even."""
    raise NotImplementedError


@intrinsic
def f32_bits(typingctx, v):
    """Reinterpret a float32 as its uint32 bit pattern (an LLVM bitcast, no memory traffic)."""
    if v != types.float32:
        return None

    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], ir.IntType(32))

    return types.uint32(types.float32), codegen


@intrinsic
def bits_f32(typingctx, u):
    """Reinterpret the low 32 bits of an integer as a float32 (numba widens uint32 arithmetic to 64 bits)."""
    if not isinstance(u, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        low = builder.trunc(args[0], ir.IntType(32)) if u.bitwidth > 32 else args[0]
        return builder.bitcast(low, ir.FloatType())

    return types.float32(u), codegen


def _call_f32_intrinsic(builder, name: str, args, fastmath=()):
    f32 = ir.FloatType()
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(f32, [f32] * len(args)), name)
    return builder.call(fn, args, fastmath=fastmath)


def _prefetch_hint(locality: int, where: str):
    """An intrinsic ``(address) -> None``: hint the CPU to load the cache line at ``address`` (an integer address,
    e.g. ``a.ctypes.data`` plus an offset in bytes) for reading into the caches ``where`` names (``llvm.prefetch``
    with this locality). No effect on results, never faults."""

    def typer(typingctx, address):
        if not isinstance(address, types.Integer):
            return None

        def codegen(context, builder, sig, args):
            i8p, i32 = ir.IntType(8).as_pointer(), ir.IntType(32)
            fn = cgutils.get_or_insert_function(builder.module,
                                                ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32]),
                                                "llvm.prefetch.p0")
            pointer = builder.inttoptr(context.cast(builder, args[0], sig.args[0], types.intp), i8p)
            builder.call(fn, [pointer, ir.Constant(i32, 0), ir.Constant(i32, locality), ir.Constant(i32, 1)])
            return context.get_dummy_value()

        return types.void(address), codegen

    typer.__doc__ = f"Prefetch the cache line at ``address`` {where}."
    return intrinsic(typer)


prefetch = _prefetch_hint(3, "into the level 1 and 2 caches (``prefetcht0``)")
prefetch_l2 = _prefetch_hint(2, "into the level 2 cache only (``prefetcht1``)")


@njit(inline="always")
def prefetch_bytes(address, nbytes, into_l2=False):
    """:func:`prefetch` every cache line of the ``nbytes`` at ``address`` (nothing when nbytes <= 0), or
    :func:`prefetch_l2` with ``into_l2`` (a constant). For streams that the hardware prefetchers lose: they stop
    at each 4 KiB page and do not follow rows read in descending order.

    ``into_l2`` is for a burst of lines fetched a row ahead of a compute-bound loop: there a burst of
    ``prefetcht0`` made the loop itself wait (likely on the level 1 cache's few miss buffers, which each such
    prefetch holds until its line arrives) and one of ``prefetcht1`` did not (docs/performance.md, 'What limits
    each operator')."""
    for offset in range(0, nbytes, 64):
        if into_l2:
            prefetch_l2(address + offset)
        else:
            prefetch(address + offset)


@intrinsic
def _void_pointer(typingctx, address):
    """An integer address as a ``void*`` (for ``numba.carray``)."""
    if not isinstance(address, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], cgutils.voidptr_t)

    return types.voidptr(address), codegen


@njit(inline="always")
def array_at(address, n, dtype):
    """The ``n`` elements of ``dtype`` at an integer address as a 1-D C array. Unlike a view (slice or row) of
    an array it counts no reference: a view takes one per call, an atomic instruction, which costs more than a
    short row and waits for pending non-temporal stores."""
    return carray(_void_pointer(address), n, dtype)


@njit(inline="always")
def unowned(a):
    """``a`` as a view (same shape and strides) that holds no reference: numba counts none on it. Passing an array
    to a helper inside a loop can take an atomic reference count per iteration, and one on an array every thread
    reads bounces its count between the cores. The caller keeps ``a`` alive while the view is in use."""
    return np.lib.stride_tricks.as_strided(array_at(a.ctypes.data, 1, a.dtype), shape=a.shape, strides=a.strides)


@njit(inline="always")
def aligned_empty(shape, dtype):
    """``np.empty(shape, dtype)`` whose data starts on a 64-byte boundary (a cache line, one AVX-512 register).
    numba's ``np.empty`` returns addresses 32 bytes past one, so that every 64-byte load or store of a scratch
    row spans two cache lines."""
    n = 1
    for extent in shape:
        n *= extent
    raw = np.empty(n + 64, dtype)
    skip = ((-raw.ctypes.data) & 63) // raw.itemsize
    return raw[skip:skip + n].reshape(shape)


@njit(inline="always")
def row_address(a, i0, i1, i2):
    """Address of ``a[i0, i1, i2, 0, ...]`` of an array of rank >= 3 (any strides): a 4-D array's row, or the
    first row of a 5-D array's ``[i0, i1, i2]`` matrix."""
    return a.ctypes.data + i0 * a.strides[0] + i1 * a.strides[1] + i2 * a.strides[2]


@njit(inline="always")
def row_view(a, i0, i1, i2):
    """``a[i0, i1, i2, :]`` of a 4-D array whose last dim is unit-stride, as a C-contiguous 1-D array
    (:func:`array_at`): loops over it vectorise, and compile the same (so give the same bits), whatever a's other
    strides and however numba types a (indexing a layout-'A' array vectorises differently)."""
    return array_at(row_address(a, i0, i1, i2), a.shape[3], a.dtype)


TRANSPOSE_BLOCK = 16  # side of the square blocks :func:`transpose_block` moves through registers


def _swap_masks(h: int) -> tuple[list[int], list[int]]:
    """shufflevector masks over two rows (a: 0..15, b: 16..31) that swap, in every 2h x 2h block of a pair of rows
    h apart, the upper right h x h block with the lower left one."""
    n = TRANSPOSE_BLOCK
    low = [c if c & h == 0 else n + c - h for c in range(n)]
    high = [c + h if c & h == 0 else n + c for c in range(n)]
    return low, high


def _transpose_block(stream: bool):
    """The intrinsic :func:`transpose_block` (``stream``: :func:`stream_transpose_block`)."""

    @intrinsic
    def block(typingctx, src, src_pitch, dst, dst_pitch, like):
        if not isinstance(like, types.Array) or like.dtype.bitwidth not in (16, 32):
            return None
        return types.void(src, src_pitch, dst, dst_pitch, like), _transpose_block_codegen(like, stream)

    return block


def _transpose_block_codegen(like, stream: bool):
    n = TRANSPOSE_BLOCK
    row = ir.VectorType(ir.IntType(like.dtype.bitwidth), n)

    def codegen(context, builder, sig, args):
        def address(base, pitch, r):
            offset = builder.mul(pitch, ir.Constant(pitch.type, r))
            return builder.inttoptr(builder.add(base, offset), row.as_pointer())

        src_, src_pitch_, dst_, dst_pitch_ = (context.cast(builder, a, t, types.intp)
                                              for a, t in zip(args[:4], sig.args[:4]))
        rows = [builder.load(address(src_, src_pitch_, r), align=1) for r in range(n)]
        h = n // 2
        while h:
            low, high = (ir.Constant(ir.VectorType(ir.IntType(32), n), m) for m in _swap_masks(h))
            for r in range(n):
                if r & h == 0:
                    a, b = rows[r], rows[r + h]
                    rows[r], rows[r + h] = builder.shuffle_vector(a, b, low), builder.shuffle_vector(a, b, high)
            h //= 2
        for r in range(n):
            store = builder.store(rows[r], address(dst_, dst_pitch_, r), align=_STREAM_BLOCK if stream else 1)
            if stream:
                store.set_metadata("nontemporal", builder.module.add_metadata([ir.Constant(ir.IntType(32), 1)]))
        return context.get_dummy_value()

    return codegen


transpose_block = _transpose_block(False)
transpose_block.__doc__ = """``dst[c, r] = src[r, c]`` for a 16 x 16 block of like's element type (4 or 2
bytes): src and dst are integer addresses, the pitches their row strides in bytes. The 16 rows are loaded as vectors
and transposed by 64 shuffles (the off-diagonal blocks of sides 8, 4, 2, 1 swapped in turn), then stored: 6 vector
instructions per row where an element-by-element copy takes 16 scalar loads and stores."""
stream_transpose_block = _transpose_block(True)
stream_transpose_block.__doc__ = """:func:`transpose_block` whose 16 rows of 64 bytes (float32) are written by
non-temporal stores (see :func:`streams`): dst and dst_pitch must be multiples of 64."""


@njit(inline="always")
def transpose_matrix(src, src_pitch, dst, dst_pitch, rows, cols, like, stream=False):
    """``dst[c, r] = src[r, c]`` for a ``[rows, cols]`` matrix of like's element type (4 or 2 bytes) at address
    src into the ``[cols, rows]`` one at dst (pitches: row strides in bytes, multiples of the element size): whole
    16 x 16 blocks by :func:`transpose_block` (with ``stream``, a float32 dst and dst_pitch that are multiples of
    64 bytes: :func:`stream_transpose_block`; the caller fences, :func:`stream_fence`), the edges element by element
    through flat views of both matrices (a store into an ``array_at`` taken inside the loop was dropped as dead
    code once inlined into a prange body)."""
    n = TRANSPOSE_BLOCK
    size = like.itemsize
    streamed = stream and size * n == _STREAM_BLOCK and dst % _STREAM_BLOCK == 0 and dst_pitch % _STREAM_BLOCK == 0
    whole_rows, whole_cols = rows - rows % n, cols - cols % n
    for r0 in range(0, whole_rows, n):
        for c0 in range(0, whole_cols, n):
            block_src, block_dst = src + r0 * src_pitch + c0 * size, dst + c0 * dst_pitch + r0 * size
            if streamed:
                stream_transpose_block(block_src, src_pitch, block_dst, dst_pitch, like)
            else:
                transpose_block(block_src, src_pitch, block_dst, dst_pitch, like)
    if rows == 0 or cols == 0:
        return
    src_step, dst_step = src_pitch // size, dst_pitch // size
    source = array_at(src, (rows - 1) * src_step + cols, like.dtype)
    target = array_at(dst, (cols - 1) * dst_step + rows, like.dtype)
    for r in range(rows):  # the right edge of the whole rows, then the bottom rows
        for c in range(whole_cols if r < whole_rows else 0, cols):
            target[c * dst_step + r] = source[r * src_step + c]


SELECT_BITS = 16  # floats written by one select_bits


@intrinsic
def select_bits(typingctx, src, shift, value, dst):
    """The 16 float32 at address dst: ``value`` where bit ``shift + t`` of the LSB-first bit string at address src
    is set, else 0 (t < 16, 0 <= shift < 8). One unaligned 4-byte load (all four bytes must be readable), a shift,
    and one select on a 16-lane mask: a bit mask expanded to floats by a vector store, where LLVM turns a loop
    over the bits into a test and a scalar store per bit."""
    if not (isinstance(src, types.Integer) and isinstance(shift, types.Integer) and value == types.float32
            and isinstance(dst, types.Integer)):
        return None
    lanes = ir.VectorType(ir.FloatType(), SELECT_BITS)

    def codegen(context, builder, sig, args):
        i32 = ir.IntType(32)
        source, target = (context.cast(builder, args[k], sig.args[k], types.intp) for k in (0, 3))
        word = builder.load(builder.inttoptr(source, i32.as_pointer()), align=1)
        bits = builder.trunc(builder.lshr(word, context.cast(builder, args[1], sig.args[1], types.int32)),
                             ir.IntType(SELECT_BITS))
        mask = builder.bitcast(bits, ir.VectorType(ir.IntType(1), SELECT_BITS))
        one = builder.insert_element(ir.Constant(lanes, ir.Undefined), args[2], ir.Constant(i32, 0))
        splat = builder.shuffle_vector(one, ir.Constant(lanes, ir.Undefined),
                                       ir.Constant(ir.VectorType(i32, SELECT_BITS), None))
        chosen = builder.select(mask, splat, ir.Constant(lanes, None))
        builder.store(chosen, builder.inttoptr(target, lanes.as_pointer()), align=4)
        return context.get_dummy_value()

    return types.void(src, shift, value, dst), codegen


STREAM_MIN_BYTES = 16 << 20  # outputs from this size on are written by non-temporal stores (copy_row)
_STREAM_BLOCK = 64  # bytes per non-temporal store: one cache line, one AVX-512 register


def streams(nbytes: int) -> bool:
    """Whether an output of ``nbytes`` should bypass the caches (``copy_row(..., stream=True)``): it is then
    too large to be read back from cache by its consumer, and a plain store first reads every destination
    line from memory (write-allocate), which costs a third of the bandwidth of a streaming kernel."""
    return nbytes >= STREAM_MIN_BYTES


@intrinsic
def _stream_block(typingctx, dst, src):
    """Copy the 64 bytes at address src (any alignment) to the 64-byte aligned address dst by one
    non-temporal vector store (``!nontemporal``: ``vmovntdq`` on x86, written around the caches)."""
    if not (isinstance(dst, types.Integer) and isinstance(src, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        block = ir.VectorType(ir.IntType(32), _STREAM_BLOCK // 4).as_pointer()
        source, target = (builder.inttoptr(context.cast(builder, a, t, types.intp), block)
                          for a, t in zip((args[1], args[0]), (sig.args[1], sig.args[0])))
        store = builder.store(builder.load(source, align=1), target, align=_STREAM_BLOCK)
        store.set_metadata("nontemporal", builder.module.add_metadata([ir.Constant(ir.IntType(32), 1)]))
        return context.get_dummy_value()

    return types.void(dst, src), codegen


@intrinsic
def stream_fence(typingctx):
    """A full memory fence: non-temporal stores are weakly ordered, so a task that streamed its output fences
    before it ends (the threads that read the output next then see every byte)."""
    def codegen(context, builder, sig, args):
        builder.fence("seq_cst")
        return context.get_dummy_value()

    return types.void(), codegen


@njit(inline="always")
def copy_row(dst, src, nbytes, stream):
    """Copy ``nbytes`` from address src to address dst (non-overlapping). With ``stream`` the 64-byte aligned
    blocks of the destination are written by non-temporal stores (see :func:`streams`; the caller ends its
    task with :func:`stream_fence`), the unaligned head and tail by plain ones."""
    head = min((-dst) & (_STREAM_BLOCK - 1), nbytes) if stream else nbytes
    end = head + (nbytes - head) // _STREAM_BLOCK * _STREAM_BLOCK
    target, source = array_at(dst, nbytes, np.uint8), array_at(src, nbytes, np.uint8)
    for k in range(head):
        target[k] = source[k]
    for k in range(head, end, _STREAM_BLOCK):
        _stream_block(dst + k, src + k)
    for k in range(end, nbytes):
        target[k] = source[k]


@intrinsic
def fmaximum(typingctx, a, b):
    """IEEE maximum of two float32 (nan if either is nan; ``llvm.maximum``).

    LLVM vectorises a running ``top = fmaximum(top, z)`` over a row; ``z if z > top else top`` stays
    scalar without the no-nan flag. A softmax row holding a nan is all nan either way.
    """
    if a != types.float32 or b != types.float32:
        return None
    return types.float32(a, b), lambda ctx, builder, sig, args: _call_f32_intrinsic(builder, "llvm.maximum.f32", args)


@intrinsic
def fmax_any_nan(typingctx, a, b):
    """max of two float32 in one ``vmaxps`` (``llvm.maxnum`` with the no-nan flag): which operand a nan yields
    is left open. For a softmax row max whose nans reach the output anyway: a nan logit has a nan exp term,
    hence a nan sum and an all-nan row, whatever the maximum is."""
    if a != types.float32 or b != types.float32:
        return None
    return types.float32(a, b), lambda ctx, builder, sig, args: _call_f32_intrinsic(builder, "llvm.maxnum.f32",
                                                                                     args, ("nnan",))


@intrinsic
def _rint(typingctx, a):
    """Round a float32 to the nearest integer, ties to even (``llvm.rint``: one vector instruction)."""
    if a != types.float32:
        return None
    return types.float32(a), lambda ctx, builder, sig, args: _call_f32_intrinsic(builder, "llvm.rint.f32", args)


@intrinsic
def _pow2(typingctx, n):
    """2**n for an integral float32 n in [-127, 127], built in the exponent bits (n = -127 gives +0.0)."""
    if n != types.float32:
        return None

    def codegen(context, builder, sig, args):
        i32 = ir.IntType(32)
        k = builder.add(builder.fptosi(args[0], i32), ir.Constant(i32, 127))
        return builder.bitcast(builder.shl(k, ir.Constant(i32, 23)), ir.FloatType())

    return types.float32(n), codegen


@intrinsic
def prefer_512_bit_vectors(typingctx):
    """Let LLVM vectorise the enclosing function with 512-bit registers: that function only, not the functions it
    calls that numba compiles on their own (``cache=True`` kernel functions), which take their own call.

    LLVM's cost model prefers 256-bit vectors on AVX-512 CPUs (``prefer-vector-width``); the streaming
    kernels here are compute-bound per row (exp, conversions) and run faster at 512 bits. The function
    attribute only changes the width; without AVX-512 LLVM falls back to the widest legal vectors.
    llvmlite validates attribute names against a fixed list, hence the plain ``set.add``.
    """
    def codegen(context, builder, sig, args):
        set.add(builder.function.attributes, '"prefer-vector-width"="512"')
        return context.get_dummy_value()

    return types.none(), codegen


_FLUSH_DENORMALS = 0x8040  # MXCSR bits FTZ (15: denormal results become 0) and DAZ (6: denormal inputs read as 0)
_X86 = platform.machine().lower() in ("x86_64", "amd64")


def _mxcsr_call(builder, name, slot):
    """Emit the x86 intrinsic ``name`` (stmxcsr / ldmxcsr) on the 32-bit stack slot ``slot``."""
    i8p = ir.IntType(8).as_pointer()
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [i8p]), name)
    builder.call(fn, [builder.bitcast(slot, i8p)])


@intrinsic
def flush_denormals(typingctx):
    """Make the calling thread's float operations flush denormals to zero (results and inputs); returns the
    previous mode for :func:`restore_float_mode`. On x86 a vector operation with a denormal operand or result
    takes a microcode assist (docs/performance.md, 'Denormals in the backward's sweep'), and softmax sweeps meet
    them: a probability near the end of float32's normal range times a factor below 1. Flushing changes values
    below 2**-126 only. A no-op off x86."""
    def codegen(context, builder, sig, args):
        i32 = ir.IntType(32)
        if not _X86:
            return ir.Constant(i32, 0)
        slot = cgutils.alloca_once(builder, i32)
        _mxcsr_call(builder, "llvm.x86.sse.stmxcsr", slot)
        old = builder.load(slot)
        builder.store(builder.or_(old, ir.Constant(i32, _FLUSH_DENORMALS)), slot)
        _mxcsr_call(builder, "llvm.x86.sse.ldmxcsr", slot)
        return old

    return types.uint32(), codegen


@intrinsic
def restore_float_mode(typingctx, mode):
    """Restore the float mode that :func:`flush_denormals` returned."""
    if mode != types.uint32:
        return None

    def codegen(context, builder, sig, args):
        if _X86:
            slot = cgutils.alloca_once_value(builder, args[0])
            _mxcsr_call(builder, "llvm.x86.sse.ldmxcsr", slot)
        return context.get_dummy_value()

    return types.void(mode), codegen


def _target_has(feature: str) -> bool:
    """Whether numba's compile target (the host CPU unless NUMBA_CPU_FEATURES says otherwise) has ``feature``."""
    features = config.CPU_FEATURES if config.CPU_FEATURES is not None else get_host_cpu_features()
    return f"+{feature}" in features.split(",")


HAS_F16C = _target_has("f16c")
HAS_AVX512F = _target_has("avx512f")
HAS_AVX512_BF16 = _target_has("avx512bf16")
HAS_AVX512_FP16 = _target_has("avx512fp16")


class _BFloatType(ir.types._BaseFloatType):
    """LLVM's ``bfloat`` (llvmlite has no class for it); only used as the target of an ``fptrunc``."""
    null = "0.0"
    intrinsic_name = "bf16"

    def __str__(self):
        return "bfloat"

    def format_constant(self, value):
        raise NotImplementedError("bfloat constants are not used")


_BFloatType._create_instance()


@intrinsic
def _f16c_to_f32(typingctx, h):
    """float16 bits (int16) -> float32 by ``fpext half`` (F16C ``vcvtph2ps``: exact, subnormals included)."""
    if h != types.int16:
        return None

    def codegen(context, builder, sig, args):
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())

    return types.float32(h), codegen


@intrinsic
def _f32_to_f16c(typingctx, v):
    """float32 -> float16 bits (int16) by ``fptrunc`` (F16C ``vcvtps2ph``: round half to even, nan stays nan)."""
    if v != types.float32:
        return None

    def codegen(context, builder, sig, args):
        return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), ir.IntType(16))

    return types.int16(v), codegen


@intrinsic
def ordered_mul(typingctx, a, b):
    """float32 ``a * b`` that fast math keeps in place: its ``fmul`` carries FASTMATH's flags without
    ``reassoc`` (numba's fast-math pass fills in only instructions that have none), so LLVM cannot regroup
    ``ordered_mul(a, b) * c`` into ``a * (b * c)``, whose inner product may underflow or overflow first."""
    if a != types.float32 or b != types.float32:
        return None

    def codegen(context, builder, sig, args):
        product = builder.fmul(args[0], args[1])
        product.flags.extend(sorted(FASTMATH - {"reassoc"}))
        return product

    return types.float32(a, b), codegen


FLOAT16_GRID_LIMIT = np.float32(65520.0)  # |v| from here on rounds to a float16 inf; float16_grid stays finite


@intrinsic
def float16_grid(typingctx, v):
    """float32 v rounded to the nearest float16 value (half to even, float16 subnormals included), kept in
    float32: the value of ``widen(narrow(v, float16))`` (the sign of a zero aside) for every |v| <
    ``FLOAT16_GRID_LIMIT``, for infinities and nans. A finite |v| from the limit on, where float16 overflows,
    gives a finite value at least as large (from 2**115 on: any value, inf or nan): callers check their range.

    ``(v + c) - c`` with c = sign(v) 2**(e + 13), e = v's exponent but at least -14: the sum's last bit has
    the weight of v's float16 ulp (2**-24 below 2**-14, the float16 subnormals), so the add rounds v there.
    Four integer operations make c; the add and the subtract carry a fast-math flag set without ``reassoc``
    (numba's fast-math pass fills in only instructions that have none), so LLVM cannot fold them away. Two
    conversions (``vcvtps2ph``, ``vcvtph2ps``) would do the same with float16 overflow, at a higher cost."""
    if v != types.float32:
        return None

    def codegen(context, builder, sig, args):
        f32, i32 = ir.FloatType(), ir.IntType(32)
        bits = builder.bitcast(args[0], i32)
        c = builder.add(builder.and_(bits, ir.Constant(i32, 0xFF800000)), ir.Constant(i32, 13 << 23))
        lowest = builder.or_(builder.and_(bits, ir.Constant(i32, 0x80000000)), ir.Constant(i32, 0x3F000000))
        umax = cgutils.get_or_insert_function(builder.module, ir.FunctionType(i32, [i32, i32]), "llvm.umax.i32")
        c = builder.bitcast(builder.call(umax, [c, lowest]), f32)  # +-0.5 at least: unsigned max keeps the sign
        total = builder.fadd(args[0], c)
        total.flags.append("nsz")
        rounded = builder.fsub(total, c)
        rounded.flags.append("nsz")
        return rounded

    return types.float32(v), codegen


@njit(inline="always")
def _bf16_to_f32(h):
    return bits_f32(np.uint32(np.uint32(h) << np.uint32(16)))


@njit(inline="always")
def _f16_to_f32(h):
    u = np.uint32(np.uint16(h))
    sign = (u & np.uint32(0x8000)) << np.uint32(16)
    body = (u & np.uint32(0x7FFF)) << np.uint32(13)
    # exponent rebias by multiplication keeps subnormals exact; inf/nan keep their payload
    is_special = (u & np.uint32(0x7C00)) == np.uint32(0x7C00)
    mag = bits_f32(body | np.uint32(0x7F800000)) if is_special else bits_f32(body) * _TWO_POW_112
    return bits_f32(f32_bits(mag) | sign)


def _bf16_rounding(keep_nan: bool):
    """Intrinsic float32 -> bfloat16 bits (uint16), round half to even, written in LLVM IR so that every step stays
    in 32-bit lanes (numba widens uint32 arithmetic to 64 bits, which halves the vector width of the kernels'
    output loops). ``keep_nan``: a nan gives its quiet nan (sign and top payload kept); without it the rounding
    carry may turn a nan into an inf or a zero, and the loop is four vector operations shorter."""

    def typer(typingctx, v):
        if v != types.float32:
            return None

        def codegen(context, builder, sig, args):
            i32 = ir.IntType(32)
            c = lambda value: ir.Constant(i32, value)  # noqa: E731
            u = builder.bitcast(args[0], i32)
            high = builder.lshr(u, c(16))
            bits = builder.lshr(builder.add(builder.add(u, c(0x7FFF)), builder.and_(high, c(1))), c(16))
            if keep_nan:
                is_nan = builder.icmp_unsigned(">", builder.and_(u, c(0x7FFFFFFF)), c(0x7F800000))
                bits = builder.select(is_nan, builder.or_(high, c(0x40)), bits)
            return builder.trunc(bits, ir.IntType(16))

        return types.uint16(v), codegen

    return intrinsic(typer)


_f32_to_bf16 = _bf16_rounding(keep_nan=True)
_f32_to_bf16_finite = _bf16_rounding(keep_nan=False)


@intrinsic
def _f32_to_bf16_hw(typingctx, v):
    """float32 -> bfloat16 bits by ``fptrunc ... to bfloat``: one ``vcvtneps2bf16`` with AVX512-BF16 (round half
    to even, nan kept, but subnormal inputs and results flush to zero)."""
    if v != types.float32:
        return None

    def codegen(context, builder, sig, args):
        return builder.bitcast(builder.fptrunc(args[0], _BFloatType()), ir.IntType(16))

    return types.uint16(v), codegen


@njit(inline="always")
def _f32_to_f16(v):
    u = f32_bits(v)
    sign = (u >> np.uint32(16)) & np.uint32(0x8000)
    a = u & np.uint32(0x7FFFFFFF)
    if a >= np.uint32(0x47800000):  # >= 65536: overflow to inf, or inf/nan
        o = np.uint32(0x7E00) if a > np.uint32(0x7F800000) else np.uint32(0x7C00)
    elif a < np.uint32(0x38800000):  # below the fp16 normal range: let the fp32 adder round
        magic = np.uint32(0x3F000000)  # 0.5: aligns the fp16 subnormal ulp with the fp32 ulp
        o = f32_bits(bits_f32(a) + bits_f32(magic)) - magic
    else:
        odd = (a >> np.uint32(13)) & np.uint32(1)
        o = (a + np.uint32(0xC8000FFF) + odd) >> np.uint32(13)
    return np.int16(np.uint16(o | sign))


_widen_f16 = _f16c_to_f32 if HAS_F16C else _f16_to_f32
_narrow_f16 = _f32_to_f16c if HAS_F16C else _f32_to_f16


@njit(inline="always")
def float16_rounded(v):
    """float32 -> float32 rounded to float16 (half to even; inf beyond float16's range, nan kept): the values of
    ``widen(narrow(v, like))`` for float16, inlined, with no function call that would keep a loop around it from
    being vectorised."""
    return _widen_f16(_narrow_f16(np.float32(v)))


@overload(widen, inline="always")
def _widen_impl(x):
    if x == types.float32:
        return lambda x: x
    if x == types.uint16:
        return lambda x: _bf16_to_f32(x)
    if x == types.int16:
        return lambda x: _widen_f16(x)
    if isinstance(x, (types.Boolean, types.Integer)):
        return lambda x: np.float32(x)
    return None


@overload(narrow)
def _narrow_impl(v, like):
    dt = like.dtype
    if dt == types.float32:
        return lambda v, like: np.float32(v)
    if dt == types.uint16:
        return lambda v, like: _f32_to_bf16(np.float32(v))
    if dt == types.int16:
        return lambda v, like: _narrow_f16(np.float32(v))
    return None


def narrow_ftz(v, like):  # pragma: no cover
    """float32 -> the element type of ``like`` for kernel-internal operands (P, dS before their GEMMs): as
    ``narrow``, except that bfloat16 uses the CPU's conversion instruction where it has one (AVX512-BF16),
    which flushes values below 2**-126 (about 1.2e-38) to zero. It gives ``narrow``'s bits for every other
    value (zeros, normal numbers, inf, nan), so results written to the user may use it only where none of
    the values is a float32 subnormal (:func:`smallest_positive`)."""
    raise NotImplementedError


def _flushes(like) -> bool:
    """Whether ``narrow_ftz(v, like)`` flushes subnormals (bfloat16 with AVX512-BF16): decided at compile time."""
    return like.dtype == types.uint16 and HAS_AVX512_BF16


@overload(narrow_ftz)
def _narrow_ftz_impl(v, like):
    if _flushes(like):
        return lambda v, like: _f32_to_bf16_hw(np.float32(v))
    return lambda v, like: narrow(v, like)


def narrow_ftz_flushes(like):  # pragma: no cover - compiled through the overload below
    """Whether ``narrow_ftz(v, like)`` flushes subnormals, as a compile-time constant (a test on it compiles away)."""
    raise NotImplementedError


@overload(narrow_ftz_flushes, inline="always")
def _narrow_ftz_flushes_impl(like):
    flushes = _flushes(like)
    return lambda like: flushes


def narrow_finite(v, like):  # pragma: no cover
    """float32 -> the element type of ``like``: ``narrow``'s bits for every value but nan (bfloat16 skips the nan
    test, four of its nine vector operations; a nan may come out as an inf or a zero). For values known to hold no
    nan."""
    raise NotImplementedError


@overload(narrow_finite)
def _narrow_finite_impl(v, like):
    if like.dtype == types.uint16:
        return lambda v, like: _f32_to_bf16_finite(np.float32(v))
    return lambda v, like: narrow(v, like)


def track_nan(acc, v, like):  # pragma: no cover - compiled through the overload below
    """The check that lets a row be rounded by :func:`narrow_finite`: ``acc + v`` (start from 0) where it skips
    the nan test (bfloat16), else ``acc`` unchanged (no work). A nan among the values makes the sum a nan (so may
    inf - inf: a false alarm only costs an exact rounding)."""
    raise NotImplementedError


@overload(track_nan, inline="always")
def _track_nan_impl(acc, v, like):
    if like.dtype == types.uint16:
        return lambda acc, v, like: acc + v
    return lambda acc, v, like: acc


def narrow_fast(v, like):  # pragma: no cover
    """float32 -> the element type of ``like`` by the cheapest rounding: ``narrow_ftz`` where it flushes
    (AVX512-BF16), else ``narrow_finite``. ``narrow``'s bits for every value that is neither a nan nor, where
    ``narrow_ftz`` flushes, a float32 subnormal (:func:`narrow_ftz_exact`)."""
    raise NotImplementedError


@overload(narrow_fast)
def _narrow_fast_impl(v, like):
    if _flushes(like):
        return lambda v, like: narrow_ftz(v, like)
    return lambda v, like: narrow_finite(v, like)


NO_POSITIVE = np.uint32(0xFFFFFFFF)  # start of a :func:`track_smallest_positive` reduction


@intrinsic
def track_smallest_positive(typingctx, acc, v):
    """Running minimum of the positive float32 values v, kept as ``bits(v) - 1`` in a uint32 (start from
    ``NO_POSITIVE``): one ``vpsubd`` and one ``vpminud`` per vector, a reduction LLVM vectorises. A zero wraps
    to ``NO_POSITIVE`` and so is skipped; negative values and nans have larger bit patterns than any positive
    number, so they are kept only while no positive value has been seen. :func:`smallest_positive` reads it."""
    if acc != types.uint32 or v != types.float32:
        return None

    def codegen(context, builder, sig, args):
        i32 = ir.IntType(32)
        umin = cgutils.get_or_insert_function(builder.module, ir.FunctionType(i32, [i32, i32]), "llvm.umin.i32")
        return builder.call(umin, [args[0], builder.sub(builder.bitcast(args[1], i32), ir.Constant(i32, 1))])

    return types.uint32(acc, v), codegen


@njit(inline="always")
def smallest_positive(acc):
    """The smallest positive value seen by :func:`track_smallest_positive`; without one, 0.0 if every value was
    zero, else one of the negative values (-0.0 included) or nans: never a positive number."""
    return bits_f32(np.uint64(acc) + np.uint64(1))


def track_flushable(acc, v, like):  # pragma: no cover - compiled through the overload below
    """:func:`track_smallest_positive` where ``narrow_ftz(v, like)`` flushes subnormals, else ``acc`` unchanged
    (no work): every other ``narrow_ftz`` is exact for any value."""
    raise NotImplementedError


@overload(track_flushable, inline="always")
def _track_flushable_impl(acc, v, like):
    if _flushes(like):
        return lambda acc, v, like: track_smallest_positive(acc, v)
    return lambda acc, v, like: acc


_MIN_NORMAL = np.float32(2.0**-126)


@njit(inline="always")
def narrow_ftz_exact(tiny, scale):
    """Whether ``narrow_ftz(v * scale, like)`` gives ``narrow``'s bits for every v >= 0 of a set whose
    :func:`track_flushable` is ``tiny``: no nonzero ``v * scale`` is a float32 subnormal (the product is monotone
    in v, so the smallest positive v gives the smallest nonzero product). Nans round alike both ways."""
    return smallest_positive(tiny) * scale >= _MIN_NORMAL or tiny == NO_POSITIVE


# Cephes expf: exp(x) = 2^n * exp(r), n = rint(x / ln2), r = x - n*ln2 split in two parts (Cody-Waite)
LOG2E = np.float32(1.4426950408889634)
_LN2_HI = np.float32(0.693359375)
_LN2_LO = np.float32(-2.12194440e-4)
_P0 = np.float32(1.9875691500e-4)
_P1 = np.float32(1.3981999507e-3)
_P2 = np.float32(8.3334519073e-3)
_P3 = np.float32(4.1665795894e-2)
_P4 = np.float32(1.6666665459e-1)
_P5 = np.float32(5.0000001201e-1)
_EXP_LO = np.float32(-88.0)  # rint(-88 / ln2) = -127: 2^n is built as +0.0, so exp(<= -88) = 0 and exp(-inf) = 0


@njit(inline="always", fastmath=FASTMATH)
def exp32(x):
    """float32 exp that numba vectorises (np.exp does not here). Relative error < 5e-7.

    exp(x) for x <= -87.68 is 0 (the exact results there are below 1.2e-38 * 0.7); nan stays nan;
    exp(-inf) = 0. No upper clamp: n stops at 127, so from ln(FLT_MAX) = 88.7228 on the polynomial
    exceeds 2 and p * 2^127 overflows to +inf (also for x = +inf: every term of p is positive).
    Branch-free (vmaxps, vminps, blends); nan is restored at the end.
    """
    xc = x if x > _EXP_LO else _EXP_LO  # nan -> _EXP_LO
    n = _rint(xc * LOG2E)
    n = n if n < np.float32(127.0) else np.float32(127.0)
    r = xc - n * _LN2_HI - n * _LN2_LO
    p = ((((_P0 * r + _P1) * r + _P2) * r + _P3) * r + _P4) * r + _P5
    p = p * r * r + r + np.float32(1.0)
    res = p * _pow2(n)
    return x if x != x else res


# 2**f on [-0.5, 0.5]: 1 + f * (c1 + f * (c2 + ...)), relative-minimax fit (max relative error 1.9e-7 in fp32)
_E1 = np.float32(0.6931470036506653)
_E2 = np.float32(0.24022242426872253)
_E3 = np.float32(0.05550733581185341)
_E4 = np.float32(0.009671512991189957)
_E5 = np.float32(0.001326472731307149)
_MIN_POW = np.float32(-127.0)
_MAX_POW = np.float32(127.0)


@njit(inline="always", fastmath=FASTMATH)
def _poly5(f):
    """2**f for |f| <= 0.5, relative error < 2e-7."""
    return ((((_E5 * f + _E4) * f + _E3) * f + _E2) * f + _E1) * f + np.float32(1.0)


# 2**f on [-0.5, 0.5] to degree 4, relative-minimax fit: relative error < 2.9e-6 in fp32, 1/170 of half an ulp of
# bfloat16 (2**-9) or float16 (2**-11 of the value): a result rounded to those moves by one ulp in well under 1%
# of cases, against the degree-5 polynomial.
_H1 = np.float32(0.6931241750717163)
_H2 = np.float32(0.24024099111557007)
_H3 = np.float32(0.05590643733739853)
_H4 = np.float32(0.009582847356796265)


def _exp_coefficients(*pow2_coefficients):
    """Coefficients of e**r = 2**(r log2 e) from those of a 2**f polynomial in f: c_k (log2 e)**k, so the fit
    keeps its relative error on |r| <= ln(2) / 2."""
    return tuple(np.float32(float(c) * math.log2(math.e)**k) for k, c in enumerate(pow2_coefficients, 1))


_X1, _X2, _X3, _X4, _X5 = _exp_coefficients(_E1, _E2, _E3, _E4, _E5)
_Y1, _Y2, _Y3, _Y4 = _exp_coefficients(_H1, _H2, _H3, _H4)
_LN2 = np.float32(math.log(2))  # ln 2 rounded to float32 ...
_LN2_REST = np.float32(math.log(2) - float(_LN2))  # ... and the rest, rounded
_ROUNDER = np.float32(1.5 * 2**23 + 127)  # x + _ROUNDER, for |x| <= 128, is in [2**23, 2**24): a whole number


@intrinsic
def _exp_reduction(typingctx, d):
    """float32 d in [-88, 88] -> ``(r, r_fine, 2**n)``: n = rint(d log2 e), ``r = d - n _LN2`` and ``r_fine = r - n
    _LN2_REST``, so e**d = e**r_fine 2**n (r to float16 / bfloat16 precision).

    One ``fma`` gives ``a = d log2 e + _ROUNDER`` rounded to a whole number, ``n = a - _ROUNDER`` exactly, and the
    low 9 bits of ``a``'s significand hold n + 127: shifted into the exponent field they make 2**n (n = -127 gives
    +0.0). r and r_fine are one ``fma`` each; a nan d gives nan r. The subtraction carries a fast-math flag set of
    its own, without ``reassoc`` (numba's fast-math pass fills in only instructions that have none), so that LLVM
    cannot fold ``_ROUNDER - (x + _ROUNDER)`` back to -x."""
    if d != types.float32:
        return None

    def codegen(context, builder, sig, args):
        f32, i32 = ir.FloatType(), ir.IntType(32)
        fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(f32, [f32] * 3), "llvm.fma.f32")
        rounder = ir.Constant(f32, float(_ROUNDER))
        a = builder.call(fma, [args[0], ir.Constant(f32, float(LOG2E)), rounder])
        minus_n = builder.fsub(rounder, a)
        minus_n.flags.append("nsz")  # see above: no reassoc
        r = builder.call(fma, [minus_n, ir.Constant(f32, float(_LN2)), args[0]])
        r_fine = builder.call(fma, [minus_n, ir.Constant(f32, float(_LN2_REST)), r])
        pow2 = builder.bitcast(builder.shl(builder.bitcast(a, i32), ir.Constant(i32, 23)), f32)
        return context.make_tuple(builder, sig.return_type, [r, r_fine, pow2])

    return types.UniTuple(types.float32, 3)(d), codegen


def exp_nonpositive(d, like):  # pragma: no cover - compiled through the overload below
    """e**d for d <= 0 (or nan), as precise as a result of ``like``'s element type needs."""
    raise NotImplementedError


@njit(inline="always", fastmath=FASTMATH)
def _exp_nonpositive(d, half):
    """e**d for d <= 0: the degree-4 polynomial when ``half`` (a compile-time constant), else the degree-5 one."""
    d = _EXP_LO if d < _EXP_LO else d  # nan passes (one vmaxps)
    r, r_fine, pow2 = _exp_reduction(d)
    if half:
        return ((((_Y4 * r + _Y3) * r + _Y2) * r + _Y1) * r + np.float32(1.0)) * pow2
    return (((((_X5 * r_fine + _X4) * r_fine + _X3) * r_fine + _X2) * r_fine + _X1) * r_fine + np.float32(1.0)) * pow2


@overload(exp_nonpositive, jit_options={"fastmath": FASTMATH})
def _exp_nonpositive_impl(d, like):
    """A softmax's ``exp(z - max)`` (d = z - max <= 0, so no upper clamp), with the degree-5 polynomial for float32
    results (relative error < 2e-7) and the degree-4 one for bfloat16 / float16 results (< 3.2e-6), which round the
    value to 8 or 11 bits anyway (both for results of at least 2**-126). The argument is reduced by ln 2 from d
    itself, never from a rounded ``d * log2 e`` (whose rounding would cost up to |d| 2**-24 of relative error).
    e**d = 0 exactly below about -87.68 (n = -127), nan stays nan."""
    half = like.dtype != types.float32
    return lambda d, like: _exp_nonpositive(d, half)


@njit(inline="always", fastmath=FASTMATH)
def exp2_32(t):
    """float32 2**t, vectorisable, relative error < 2e-7 for normal results below 2**127.5; 2**0 = 1 exactly,
    2**(<= -127) = 0, 2**(+inf) = inf, nan stays nan (the lower clamp is written so that a nan passes through
    it: one ``vmaxps``).

    The flash attention backward computes ``exp(z - m)`` as ``exp2_32((z - m) * log2 e)`` (its m comes from the
    caller's statistics, so ``z - m`` may be positive and must overflow to inf): ``z - m`` is exact when z is
    near the row max m (where the large terms are), and the Cody-Waite reduction of :func:`exp32` is not
    needed (t - rint(t) is exact). Folding log2 e into the scale instead would round ``m * log2 e``, an error
    of up to ``ulp(m)`` in t for large logits. Where ``z - m <= 0`` holds, :func:`exp_nonpositive` is more precise.
    """
    t = _MIN_POW if t < _MIN_POW else t
    n = _rint(t)
    n = _MAX_POW if n > _MAX_POW else n
    return _poly5(t - n) * _pow2(n)


def exp_for(x, like):  # pragma: no cover - compiled through the overload below
    """float32 exp(x), as precise as a result of ``like``'s element type needs."""
    raise NotImplementedError


@overload(exp_for, jit_options={"fastmath": FASTMATH})
def _exp_for_impl(x, like):
    """:func:`exp32` for float32 results; ``exp2_32(x * log2 e)`` for bfloat16 / float16 results, about a third
    fewer operations. Rounding ``x * log2 e`` (and log2 e itself) adds a relative error of up to
    ``1.23 |x| 2**-24``: with the polynomial's, at most 1.5e-6 where a float16 result is neither 0 nor inf
    (|x| < 17.4), 1/160 of half its ulp, and 6.7e-6 at x = 88.37 for bfloat16, 1/290 of half its ulp (above,
    where exp2_32's range ends at 2**127.5, up to 5.4e-5, 1/36 of it)."""
    if like.dtype == types.float32:
        return lambda x, like: exp32(x)
    return lambda x, like: exp2_32(x * LOG2E)
