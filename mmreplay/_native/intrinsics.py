"""LLVM intrinsics for the compiled kernels: memory prefetch, atomics on int64 arrays, addresses as pointers.

Invariant: each function here compiles to the one LLVM instruction or intrinsic its name says, with no
other effect: ``prefetch`` never faults (an address outside the process is ignored by the CPU), and the
atomics are sequentially consistent.
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.extending import intrinsic


@intrinsic
def prefetch(typingctx, addr):
    """Ask the CPU to start loading the cache line at ``addr`` (an integer address); nothing else happens."""
    def codegen(context, builder, signature, args):
        i8p = ir.IntType(8).as_pointer()
        i32 = ir.IntType(32)
        fn = builder.module.declare_intrinsic("llvm.prefetch", [i8p],
                                              ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32]))
        read, keep_in_all_levels, data_cache = (ir.Constant(i32, v) for v in (0, 3, 1))
        builder.call(fn, [builder.inttoptr(args[0], i8p), read, keep_in_all_levels, data_cache])
        return context.get_dummy_value()
    return types.void(types.int64), codegen


def _int64_array(arr) -> bool:
    return isinstance(arr, types.Array) and arr.dtype == types.int64


def _element_pointer(context, builder, signature, args):
    ary = context.make_array(signature.args[0])(context, builder, args[0])
    return builder.gep(ary.data, [args[1]])


@intrinsic
def atomic_load(typingctx, arr, idx):
    """``arr[idx]`` read atomically."""
    if not _int64_array(arr):
        return None
    def codegen(context, builder, signature, args):
        return builder.load_atomic(_element_pointer(context, builder, signature, args), "seq_cst", 8)
    return types.int64(arr, idx), codegen


@intrinsic
def atomic_store(typingctx, arr, idx, val):
    """``arr[idx] = val`` written atomically."""
    if not _int64_array(arr):
        return None
    def codegen(context, builder, signature, args):
        builder.store_atomic(args[2], _element_pointer(context, builder, signature, args), "seq_cst", 8)
        return context.get_dummy_value()
    return types.void(arr, idx, types.int64), codegen


@intrinsic
def atomic_cas(typingctx, arr, idx, old, new):
    """``arr[idx] = new`` if it holds ``old`` (True), atomically; else False."""
    if not _int64_array(arr):
        return None
    def codegen(context, builder, signature, args):
        pair = builder.cmpxchg(_element_pointer(context, builder, signature, args), args[2], args[3], "seq_cst",
                               "seq_cst")
        return builder.extract_value(pair, 1)
    return types.boolean(arr, idx, types.int64, types.int64), codegen


@intrinsic
def atomic_add(typingctx, arr, idx, val):
    """``arr[idx] += val`` atomically; the value before."""
    if not _int64_array(arr):
        return None
    def codegen(context, builder, signature, args):
        return builder.atomic_rmw("add", _element_pointer(context, builder, signature, args), args[2], "seq_cst")
    return types.int64(arr, idx, types.int64), codegen


@intrinsic
def address(typingctx, addr):
    """An integer address as a pointer, for ``numba.carray`` over a caller's array."""
    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], ir.IntType(8).as_pointer())
    return types.voidptr(types.int64), codegen
