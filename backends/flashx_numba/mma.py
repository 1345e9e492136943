"""Tensor cores from numba-cuda: the warp-wide ``mma.sync.aligned.m16n8k16`` product and the
float32 -> half-pair conversion, as inline PTX, with the fragment layout they imply.

numba-cuda has no tensor-core API, so each instruction is an ``@intrinsic`` whose code is one
llvmlite ``InlineAsm``. Operands travel as PTX registers: A (16x16) as four and B (16x8) as two
32-bit registers per lane, each holding two float16 or bfloat16 values (the lower-indexed
element in the low half); C and D (16x8, float32) as four floats per lane.

Lane ``l`` of the warp, with ``group = l // 4`` and ``pair = l % 4``, holds (PTX ISA,
"Matrix fragments for mma.m16n8k16"):

- A: register ``i`` holds row ``group + 8 * (i % 2)``, columns ``2 * pair + 8 * (i // 2)`` and
  the next one;
- B: register ``i`` holds rows (the k index) ``2 * pair + 8 * i`` and the next one, column
  ``group``;
- C, D: element ``i`` is row ``group + 8 * (i // 2)``, column ``2 * pair + i % 2``.

So the C fragments of two adjacent 16x8 tiles are, packed pairwise, the A fragment of their
16x16 union: FlashAttention's P goes from one product into the next without leaving registers.

Fragments come from shared memory by ``ldmatrix``: each lane names one 16-byte row of one of
four 8x8 matrices (lane ``l`` the row ``l % 8`` of matrix ``l // 8``), and each lane gets,
in register ``j``, the two elements of matrix ``j`` it holds in the layout above (row
``l // 4``, columns ``2 * (l % 4)`` on; with ``.trans``, of the transposed matrix). So A of
a row-major 16x16 tile, B of a tile stored n-major (K: keys along rows, features along
columns) and B of a tile stored k-major (V, read transposed) each take one ``ldmatrix.x4``
per two fragments' worth of registers; ``*_rows`` below say where each lane points.

Tiles reach shared memory by ``cp.async``: 16-byte copies from global memory that bypass the
registers and run while the warp goes on, finished by ``wait_copies`` (then a barrier
publishes them to the block).

Decoding reads its keys and values into registers instead, 16 bytes a lane at a time, by a
predicated ``ld.global.nc`` (``global_quad``).

The plain-Python forms below (``mma_lanes``, ``ldmatrix_lanes``) compute what the
instructions do for a whole warp's registers at once; the tests check the layout against
them, and the CUDA simulator, which has no warps, runs the kernels' NumPy tile forms instead
(``fragments``).
"""

from __future__ import annotations

import functools

import numpy as np

#: The two half types the instructions take, by flashx dtype name (PTX type suffix).
PTX_TYPE = {"float16": "f16", "bfloat16": "bf16"}


def a_position(lane: int, i: int) -> tuple[int, int]:
    """(row, column) of the first of the two elements of A register ``i`` of ``lane``."""
    return lane // 4 + 8 * (i % 2), 2 * (lane % 4) + 8 * (i // 2)


def b_position(lane: int, i: int) -> tuple[int, int]:
    """(k, column) of the first of the two elements of B register ``i`` of ``lane``."""
    return 2 * (lane % 4) + 8 * i, lane // 4


def c_position(lane: int, i: int) -> tuple[int, int]:
    """(row, column) of C or D element ``i`` of ``lane``."""
    return lane // 4 + 8 * (i // 2), 2 * (lane % 4) + i % 2


def a_rows(lane: int) -> tuple[int, int]:
    """(row, word) of the row this lane names to ``ldmatrix`` for an A fragment of a row-major
    tile of 32-bit words (two halves each), relative to the fragment's first row and word."""
    return lane % 16, 4 * (lane // 16)


def b_rows(lane: int) -> tuple[int, int]:
    """(row, word) this lane names to ``ldmatrix`` for the B fragments of two adjacent n tiles
    of a tile stored n-major (rows n, words along k), relative to its first row and word:
    registers 0, 1 the first tile's, 2, 3 the second's."""
    return 8 * (lane // 16) + lane % 8, 4 * (lane // 8 % 2)


def b_rows_transposed(lane: int) -> tuple[int, int]:
    """As ``b_rows``, for a tile stored k-major (rows k, words along n), read by
    ``ldmatrix.trans``."""
    return lane % 16, 4 * (lane // 16)


# -- plain Python ---------------------------------------------------------------------------


def unpack_pair(word, dtype: str) -> tuple[np.float32, np.float32]:
    """The two values of a packed word, as float32 (exact)."""
    halves = np.array([int(word) & 0xFFFF, int(word) >> 16], np.uint16)
    if dtype == "float16":
        return tuple(halves.view(np.float16).astype(np.float32))
    return tuple((halves.astype(np.uint32) << 16).view(np.float32))


def mma_lanes(a: np.ndarray, b: np.ndarray, c: np.ndarray, dtype: str) -> np.ndarray:
    """D = A B + C for a warp: a (32, 4) and b (32, 2) packed words, c (32, 4) float32 -> d (32, 4).

    The products are exact in float64 and each sum is rounded once; the tensor cores' float32
    sums may differ from it in the last bits."""
    A, B = np.zeros((16, 16)), np.zeros((16, 8))
    for lane in range(32):
        for i in range(4):
            row, col = a_position(lane, i)
            A[row, col : col + 2] = unpack_pair(a[lane, i], dtype)
        for i in range(2):
            k, col = b_position(lane, i)
            B[k : k + 2, col] = unpack_pair(b[lane, i], dtype)
    product = A @ B
    d = np.empty((32, 4), np.float32)
    for lane in range(32):
        for i in range(4):
            row, col = c_position(lane, i)
            d[lane, i] = np.float32(product[row, col] + np.float64(c[lane, i]))
    return d


def ldmatrix_lanes(tile: np.ndarray, rows: list, transposed: bool) -> np.ndarray:
    """What ``ldmatrix.x4`` gives a warp: ``tile`` of 32-bit words, ``rows[l]`` the (row, word)
    lane ``l`` names -> (32, 4) words."""
    halves = tile.astype(np.uint32).view(np.uint16)  # half c of word w is half 2 * w + c
    matrices = [np.array([halves[r, 2 * w : 2 * w + 8] for r, w in rows[8 * j : 8 * j + 8]]) for j in range(4)]
    out = np.empty((32, 4), np.uint32)
    for lane in range(32):
        for j, m in enumerate(matrices):
            m = m.T if transposed else m
            low, high = m[lane // 4, 2 * (lane % 4) : 2 * (lane % 4) + 2]
            out[lane, j] = int(low) | int(high) << 16
    return out


# -- CUDA -----------------------------------------------------------------------------------


def _mma_intrinsic(ptx_type: str):
    from llvmlite import ir
    from numba import types
    from numba.cuda.extending import intrinsic

    instruction = (f"mma.sync.aligned.m16n8k16.row.col.f32.{ptx_type}.{ptx_type}.f32 "
                   "{$0, $1, $2, $3}, {$4, $5, $6, $7}, {$8, $9}, {$10, $11, $12, $13};")
    words, floats = [types.uint32] * 6, [types.float32] * 4
    result = types.UniTuple(types.float32, 4)

    @intrinsic
    def mma(typingctx, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        """(d0, d1, d2, d3) = A B + (c0, c1, c2, c3) for this lane's fragments (see the module)."""

        def codegen(context, builder, signature, arguments):
            f32, i32 = ir.FloatType(), ir.IntType(32)
            function = ir.FunctionType(ir.LiteralStructType([f32] * 4), [i32] * 6 + [f32] * 4)
            values = [context.cast(builder, value, given, wanted)
                      for value, given, wanted in zip(arguments, signature.args, words + floats)]
            asm = ir.InlineAsm(function, instruction, "=f,=f,=f,=f,r,r,r,r,r,r,0,1,2,3")
            d = builder.call(asm, values)
            return context.make_tuple(builder, result, [builder.extract_value(d, i) for i in range(4)])

        return result(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3), codegen

    return mma


def _pack_intrinsic(ptx_type: str):
    from llvmlite import ir
    from numba import types
    from numba.cuda.extending import intrinsic

    @intrinsic
    def pack(typingctx, low, high):
        """Two float32 rounded to nearest (ties to even) into one word, ``low`` in the low half."""

        def codegen(context, builder, signature, arguments):
            f32, i32 = ir.FloatType(), ir.IntType(32)
            values = [context.cast(builder, value, given, types.float32)
                      for value, given in zip(arguments, signature.args)]
            # cvt's first source goes to the upper half
            asm = ir.InlineAsm(ir.FunctionType(i32, [f32, f32]), f"cvt.rn.{ptx_type}x2.f32 $0, $1, $2;", "=r,f,f")
            return builder.call(asm, [values[1], values[0]])

        return types.uint32(low, high), codegen

    return pack


def _widen_intrinsic(ptx_type: str):
    from llvmlite import ir
    from numba import types
    from numba.cuda.extending import intrinsic

    @intrinsic
    def widen(typingctx, bits):
        """The half in the low 16 bits of ``bits`` as float32 (exact)."""

        def codegen(context, builder, signature, arguments):
            f32, i16, i32 = ir.FloatType(), ir.IntType(16), ir.IntType(32)
            word = context.cast(builder, arguments[0], signature.args[0], types.uint32)
            if ptx_type == "bf16":  # bfloat16 is float32's upper half
                return builder.bitcast(builder.shl(word, ir.Constant(i32, 16)), f32)
            asm = ir.InlineAsm(ir.FunctionType(f32, [i16]), "cvt.f32.f16 $0, $1;", "=f,h")
            return builder.call(asm, [builder.trunc(word, i16)])

        return types.float32(bits), codegen

    return widen


def _item_pointer(context, builder, array_type, array, indices, index_types, address_space):
    """The address of ``array[indices]`` in ``address_space`` (1 global, 3 shared), as an integer
    (64 and 32 bits)."""
    from llvmlite import ir
    from numba import types
    from numba.cuda import cgutils

    wanted = [context.cast(builder, i, t, types.intp) for i, t in zip(indices, index_types)]
    pointer = cgutils.get_item_pointer(context, builder, array_type, context.make_array(array_type)(
        context, builder, array), wanted)
    pointer = builder.addrspacecast(pointer, ir.PointerType(pointer.type.pointee, address_space))
    return builder.ptrtoint(pointer, ir.IntType(64 if address_space == 1 else 32))


@functools.cache
def _address_intrinsics():
    from numba import types
    from numba.cuda.extending import intrinsic

    @intrinsic
    def shared_address(typingctx, tile, row, word):
        """The address of ``tile[row, word]`` (a 2D shared array) in the shared window, as uint32."""

        def codegen(context, builder, signature, arguments):
            return _item_pointer(context, builder, signature.args[0], arguments[0], arguments[1:], signature.args[1:],
                                 3)

        return types.uint32(tile, row, word), codegen

    @intrinsic
    def global_address(typingctx, x, b, n, h, w):
        """The global address of ``x[b, n, h, w]``, as int64 (numba's mixed unsigned and signed
        arithmetic would leave integers)."""

        def codegen(context, builder, signature, arguments):
            return _item_pointer(context, builder, signature.args[0], arguments[0], arguments[1:], signature.args[1:],
                                 1)

        return types.int64(x, b, n, h, w), codegen

    return shared_address, global_address


# The instructions below take a shared address as a register and a byte offset as an immediate
# (``[address+offset]``, constraint "n"): the offset must fold to a constant (unrolled loops over
# compile-time shapes), and a thread then keeps one address register per tile, not one per
# fragment or copy that the compiler would hoist out of the kernels' loops.


def _ldmatrix_intrinsic(transposed: bool):
    from llvmlite import ir
    from numba import types
    from numba.cuda.extending import intrinsic

    instruction = (f"ldmatrix.sync.aligned.m8n8.x4{'.trans' if transposed else ''}.shared.b16 "
                   "{$0, $1, $2, $3}, [$4+$5];")
    result = types.UniTuple(types.uint32, 4)

    @intrinsic
    def ldmatrix(typingctx, address, offset):
        """Four fragment registers of this lane, its own row being the 16 bytes at shared address
        ``address + offset`` (16-byte aligned; ``offset`` a compile-time constant)."""

        def codegen(context, builder, signature, arguments):
            i32 = ir.IntType(32)
            values = [context.cast(builder, value, given, types.uint32)
                      for value, given in zip(arguments, signature.args)]
            # side effect: a read of memory that barriers and copies change, never hoisted past them
            asm = ir.InlineAsm(ir.FunctionType(ir.LiteralStructType([i32] * 4), [i32, i32]), instruction,
                               "=r,=r,=r,=r,r,n,~{memory}", side_effect=True)
            words = builder.call(asm, values)
            return context.make_tuple(builder, result, [builder.extract_value(words, i) for i in range(4)])

        return result(address, offset), codegen

    return ldmatrix


@functools.cache
def _shared_word_intrinsics():
    from llvmlite import ir
    from numba import types
    from numba.cuda.extending import intrinsic

    @intrinsic
    def shared_word(typingctx, address, offset):
        """The 32-bit word at shared address ``address + offset`` (``offset`` a compile-time constant)."""

        def codegen(context, builder, signature, arguments):
            i32 = ir.IntType(32)
            values = [context.cast(builder, value, given, types.uint32)
                      for value, given in zip(arguments, signature.args)]
            asm = ir.InlineAsm(ir.FunctionType(i32, [i32, i32]), "ld.shared.b32 $0, [$1+$2];", "=r,r,n,~{memory}",
                               side_effect=True)
            return builder.call(asm, values)

        return types.uint32(address, offset), codegen

    @intrinsic
    def store_shared_pair(typingctx, address, offset, low, high):
        """Store the words ``low``, ``high`` at shared address ``address + offset`` (8-byte aligned;
        ``offset`` a compile-time constant)."""

        def codegen(context, builder, signature, arguments):
            i32 = ir.IntType(32)
            values = [context.cast(builder, value, given, types.uint32)
                      for value, given in zip(arguments, signature.args)]
            asm = ir.InlineAsm(ir.FunctionType(ir.VoidType(), [i32] * 4), "st.shared.v2.b32 [$0+$1], {$2, $3};",
                               "r,n,r,r,~{memory}", side_effect=True)
            builder.call(asm, values)
            return context.get_dummy_value()

        return types.void(address, offset, low, high), codegen

    @intrinsic
    def shared_quad(typingctx, address, offset):
        """The four float32 at shared address ``address + offset`` (16-byte aligned; ``offset`` a
        compile-time constant), in one 16-byte load."""

        def codegen(context, builder, signature, arguments):
            f32, i32 = ir.FloatType(), ir.IntType(32)
            values = [context.cast(builder, value, given, types.uint32)
                      for value, given in zip(arguments, signature.args)]
            asm = ir.InlineAsm(ir.FunctionType(ir.LiteralStructType([f32] * 4), [i32, i32]),
                               "ld.shared.v4.f32 {$0, $1, $2, $3}, [$4+$5];", "=f,=f,=f,=f,r,n,~{memory}",
                               side_effect=True)
            quad = builder.call(asm, values)
            result = types.UniTuple(types.float32, 4)
            return context.make_tuple(builder, result, [builder.extract_value(quad, i) for i in range(4)])

        return types.UniTuple(types.float32, 4)(address, offset), codegen

    return shared_word, store_shared_pair, shared_quad


def _copy_intrinsic():
    from llvmlite import ir
    from numba import types
    from numba.cuda.extending import intrinsic

    @intrinsic
    def copy_async(typingctx, target, offset, source, inside):
        """Start copying the 16 bytes at global address ``source`` to shared address ``target +
        offset`` (``offset`` a compile-time constant); zeros instead where not ``inside`` (the
        source is then not read, but must be an address of the tensor)."""

        def codegen(context, builder, signature, arguments):
            i32, i64 = ir.IntType(32), ir.IntType(64)
            wanted = (types.uint32, types.uint32, types.int64, types.boolean)
            target, offset, source, flag = [context.cast(builder, value, given, cast)
                                            for value, given, cast in zip(arguments, signature.args, wanted)]
            size = builder.select(flag, ir.Constant(i32, 16), ir.Constant(i32, 0))
            asm = ir.InlineAsm(ir.FunctionType(ir.VoidType(), [i32, i32, i64, i32]),
                               "cp.async.cg.shared.global [$0+$1], [$2], 16, $3;", "r,n,l,r,~{memory}",
                               side_effect=True)
            builder.call(asm, [target, offset, source, size])
            return context.get_dummy_value()

        return types.void(target, offset, source, inside), codegen

    @intrinsic
    def wait_copies(typingctx):
        """Wait until this thread's copies have landed (a barrier then shows them to the block)."""

        def codegen(context, builder, signature, arguments):
            asm = ir.InlineAsm(ir.FunctionType(ir.VoidType(), []), "cp.async.wait_all;", "~{memory}",
                               side_effect=True)
            builder.call(asm, [])
            return context.get_dummy_value()

        return types.void(), codegen

    return copy_async, wait_copies


@functools.cache
def _global_quad_intrinsic():
    from llvmlite import ir
    from numba import types
    from numba.cuda.extending import intrinsic

    result = types.UniTuple(types.uint32, 4)

    @intrinsic
    def global_quad(typingctx, address, inside):
        """The four 32-bit words at global address ``address`` (16-byte aligned), in one 16-byte load
        through the read-only data cache; zeros where not ``inside``, whose address is not read.

        The load is predicated rather than branched around: the compiler may issue it as early as
        the address is known, and a thread keeps several in flight. Read-only: the memory must not
        change while the kernel runs."""

        def codegen(context, builder, signature, arguments):
            i32, i64 = ir.IntType(32), ir.IntType(64)
            address = context.cast(builder, arguments[0], signature.args[0], types.int64)
            flag = context.cast(builder, arguments[1], signature.args[1], types.uint32)
            asm = ir.InlineAsm(ir.FunctionType(ir.LiteralStructType([i32] * 4), [i64, i32]),
                               "{.reg .pred p; setp.ne.u32 p, $5, 0; mov.b32 $0, 0; mov.b32 $1, 0; mov.b32 $2, 0; "
                               "mov.b32 $3, 0; @p ld.global.nc.v4.u32 {$0, $1, $2, $3}, [$4];}",
                               "=r,=r,=r,=r,l,r")
            words = builder.call(asm, [address, flag])
            return context.make_tuple(builder, result, [builder.extract_value(words, i) for i in range(4)])

        return result(address, inside), codegen

    return global_quad


@functools.cache
def global_load_intrinsics():
    """(global_address, global_quad): 16-byte loads of rows of global arrays into registers (the
    decoding kernel's keys and values); device-callable on a GPU only."""
    return _address_intrinsics()[1], _global_quad_intrinsic()


@functools.cache
def shared_memory_intrinsics():
    """(shared_address, global_address, shared_word, store_shared_pair, ldmatrix, ldmatrix_transposed,
    copy_async, wait_copies): device-callable on a GPU only."""
    return (*_address_intrinsics(), *_shared_word_intrinsics()[:2], _ldmatrix_intrinsic(False),
            _ldmatrix_intrinsic(True), *_copy_intrinsic())


@functools.cache
def micro_tile_intrinsics():
    """(shared_address, shared_quad): the float32 micro-tiles' reads of shared memory, 16 bytes
    at a time at immediate offsets from one address a tile; device-callable on a GPU only."""
    return _address_intrinsics()[0], _shared_word_intrinsics()[2]


@functools.cache
def intrinsics(dtype: str):
    """(mma, pack, widen) for ``dtype``, float16 or bfloat16: device-callable on a GPU only."""
    ptx_type = PTX_TYPE[dtype]
    return _mma_intrinsic(ptx_type), _pack_intrinsic(ptx_type), _widen_intrinsic(ptx_type)
