"""The C/Python seam of the fused kernels, declared once.

`KERNELS` lists every function of kernels.c that Python calls, with its C signature, and
`LAYER_WEIGHTS` the order of one layer's weight pointers that forward_bf16 walks. From them:

- the ctypes bindings: argtypes and restype, and a keyword-only Python function per kernel
  (pointer arguments take tensors, or None where the table says the C side accepts NULL);
- `abi_header()`: the C header the build includes (the LW_* enum, and the KERNEL() macro);
- the load-time check: each kernel is defined in C through KERNEL(), which compiles a
  second function `abi_<name>` returning the definition's own signature text; `bind` compares
  it with the table, argument by argument, and raises KernelABIError on any difference.

A mismatch would otherwise be silent memory corruption (a swapped H / KVH, a dropped pointer).
Adding a kernel: write it in C as `KERNEL(ret, name, params...) { ... }` and add one `Kernel` row
here; adding an argument: change the C parameter list, the row, and the call.
"""
from __future__ import annotations

import ctypes
import re
from dataclasses import dataclass
from typing import Callable, Optional


class KernelABIError(RuntimeError):
    """The kernel library and the table disagree: calling it would corrupt memory."""


@dataclass(frozen=True)
class Kernel:
    name: str                  # the C symbol (per_dtype: name_bf16 and name_f32)
    sig: str                   # "ret(params)" in C, as the definition writes it; T: the element type
    nullable: tuple[str, ...] = ()   # pointer arguments the C side accepts as NULL (Python None)
    per_dtype: bool = False    # compiled once per element type by kernels_body.h / kernels.c
    guard: Optional[str] = None   # a no-argument kernel: bound only where it returns non-zero


# The element type T of the per-dtype kernels, by symbol suffix.
DTYPES = {"bf16": "uint16_t", "f32": "float"}

# One layer's weight pointers for forward_bf16, in order (0 for an absent bias / last norm).
LAYER_WEIGHTS = ("qkv", "qkv_b", "o", "gu", "down", "ln2", "ln1_next")
# One layer's ops in forward_bf16, in order: a call starts and stops at the boundary before any of
# them (kernels.layer_stack counts positions in these, layer * len(FORWARD_STAGES) + op).
FORWARD_STAGES = ("qkv", "rope", "attn", "o", "ln2", "gu", "silu", "down", "ln1")

# LoRA (model/lora.py): one record per (layer, linear layer, adapter slot), int64 fields in this
# order: the float32 A rows of every adapted part stacked ([rank, K], 0: the slot does not adapt
# this linear), their count, how many parts; then per part its float32 B^T ([r, n], scaling folded
# in), first output column, columns, first row of A, rows. The records of one layer's linears are
# in LORA_LINEARS order; a part is one of a fused linear's projections (q, k, v; gate, up).
LORA_LINEARS = ("qkv", "o", "gu", "down")
LORA_PARTS = 3
LORA_PART = ("b", "off", "cols", "roff", "r")
LORA_RECORD = ("a", "rank", "parts") + tuple(f"{f}{p}" for p in range(LORA_PARTS) for f in LORA_PART)

_LORA = ("const T *x, int64_t K, T *y, int64_t ldy, const int64_t *rec, const int64_t *lrows, "
         "const int64_t *litems, const int64_t *lslot, int64_t nitems")

_ATT = ("const T *q, int64_t q_stride, const T *pool, int64_t cap1, T *out, int64_t rows, int64_t H, "
        "int64_t KVH, int64_t hd, const int64_t *slot_tab, const int64_t *off, const int64_t *ctx, "
        "int64_t max_ctx, float scale")

KERNELS: tuple[Kernel, ...] = (
    Kernel("rmsnorm", "void(const T *x, const T *delta, T *x_out, const T *w, T *h, int64_t rows, int64_t D, "
           "float eps)", nullable=("delta", "h"), per_dtype=True),
    Kernel("rope_kv", "void(T *qkv, int64_t rows, int64_t H, int64_t KVH, int64_t hd, const int64_t *pos, "
           "const float *cos_t, const float *sin_t, T *pool, int64_t cap1, const int64_t *slots)", per_dtype=True),
    Kernel("silu_mul", "void(const T *gu, T *out, int64_t rows, int64_t I)", per_dtype=True),
    Kernel("attention", f"void({_ATT})", per_dtype=True),
    Kernel("quant_rows", "void(const T *x, int8_t *q, float *s, int64_t rows, int64_t K)", per_dtype=True),
    Kernel("dequant", "void(const int32_t *acc, const float *sx, const float *sw, const T *bias, T *y, "
           "int64_t rows, int64_t N)", nullable=("bias",), per_dtype=True),
    Kernel("lora", f"void({_LORA})", per_dtype=True),
    Kernel("argmax_rows", "void(const float *x, int64_t rows, int64_t V, int64_t *out)"),
    Kernel("argmax_masked_rows", "void(const float *x, int64_t rows, int64_t V, const int32_t *mask, int64_t W, "
           "const int64_t *mrow, int64_t *out)"),
    Kernel("bitmask_apply_rows", "void(float *x, int64_t ld, int64_t V, const int32_t *mask, int64_t W, "
           "const int64_t *rows, int64_t n)"),
    Kernel("has_w4a8", "int(void)"),
    Kernel("quant_groups_bf16", "void(const uint16_t *x, int8_t *q, float *dx, float *sx, int64_t rows, "
           "int64_t K)", guard="has_w4a8"),
    Kernel("w4a8_mm_bf16", "void(const int8_t *xq, const float *dx, const float *sx, int64_t rows, int64_t K, "
           "const uint8_t *w, int64_t N, uint16_t *y)", guard="has_w4a8"),
    Kernel("has_bf16_mm", "int(void)"),
    Kernel("has_bf16_dp", "int(void)", guard="has_bf16_mm"),
    Kernel("bf16_dp_pays", "int(void)", guard="has_bf16_mm"),
    Kernel("bf16_mm", "void(const uint16_t *x, int64_t rows, int64_t K, const uint16_t *w, int64_t N, "
           "const uint16_t *bias, void *y, int out_f32, int dp)", nullable=("bias",), guard="has_bf16_mm"),
    Kernel("forward_bf16_supports", "int(int64_t H, int64_t KVH, int64_t hd)"),
    Kernel("forward_bf16", "int64_t(int64_t s0, int64_t S, const int64_t *lw, uint16_t *x, uint16_t *h, "
           "uint16_t *qkv, uint16_t *att, uint16_t *gu, uint16_t *act, uint16_t *tmp, float *xf, int64_t M, int64_t D, "
           "int64_t H, int64_t KVH, int64_t hd, int64_t I, const int64_t *pos, const float *cos_t, "
           "const float *sin_t, uint16_t *pool, int64_t layer_elems, int64_t cap1, const int64_t *slots, "
           "const int64_t *slot_tab, const int64_t *off, const int64_t *ctx, int64_t max_ctx, float scale, "
           "float eps, int dp, const int64_t *lora, int64_t lora_slots, const int64_t *lrows, "
           "const int64_t *litems, const int64_t *lslot, int64_t nitems, float probe, float least, int stop, "
           "float stretch, float *seen)",
           nullable=("lora", "lrows", "litems", "lslot", "seen"),
           guard="has_bf16_mm"),
    Kernel("has_w8_mm", "int(void)"),
    Kernel("w8_mm_bf16", "void(const uint16_t *x, int64_t rows, int64_t K, const int8_t *w, const float *s, "
           "int64_t N, void *y, int out_f32)", guard="has_w8_mm"),
)

_SCALARS = {"int64_t": ctypes.c_int64, "int": ctypes.c_int, "float": ctypes.c_float}
_RESTYPES = {"void": None, "int": ctypes.c_int, "int64_t": ctypes.c_int64}


@dataclass(frozen=True)
class Arg:
    type: str      # normalised C type: "const uint16_t *", "int64_t"
    name: str


def parse_signature(text: str, elem: Optional[str] = None) -> tuple[str, tuple[Arg, ...]]:
    """'ret(params)' -> (ret, args), with whitespace normalised, attributes dropped and the
    type name T replaced by `elem`. The same parser reads the table and the C definition's
    text, so formatting differences (line breaks, `T*x` vs `T *x`) never count as a mismatch."""
    text = re.sub(r"__attribute__\s*\(\(.*?\)\)\s*(?=\w)", "", text.strip())
    m = re.fullmatch(r"\s*(\w+)\s*\((.*)\)\s*", text, re.S)
    if not m:
        raise KernelABIError(f"cannot read the signature {text!r}: expected 'ret(params)'")
    ret, params = m.group(1), m.group(2).strip()
    args = []
    if params not in ("", "void"):
        for p in params.split(","):
            p = " ".join(p.replace("*", " * ").split())
            pm = re.fullmatch(r"(.*?)\s*(\w+)", p)
            if not pm or not pm.group(1):
                raise KernelABIError(f"cannot read the parameter {p!r} of {text!r}")
            words = pm.group(1).split()
            if elem is not None:
                words = [elem if w == "T" else w for w in words]
            args.append(Arg(" ".join(words), pm.group(2)))
    return ret, tuple(args)


def _ctype(t: str):
    if t.endswith("*"):
        return ctypes.c_void_p
    if t not in _SCALARS:
        raise KernelABIError(f"no ctypes mapping for the C type {t!r} (kernel_abi._SCALARS)")
    return _SCALARS[t]


def symbols(table: tuple[Kernel, ...]):
    """(C symbol, its row, its element type) for every symbol the table binds."""
    for k in table:
        if k.per_dtype:
            for suf, elem in DTYPES.items():
                yield f"{k.name}_{suf}", k, elem
        else:
            yield k.name, k, None


def compare(symbol: str, c_text: str, k: Kernel, elem: Optional[str]) -> None:
    """Raise KernelABIError naming `symbol` and the first argument where the C definition's
    signature (`c_text`, from abi_<symbol>) and the table's row differ."""
    c_ret, c_args = parse_signature(c_text, elem)
    t_ret, t_args = parse_signature(k.sig, elem)
    where = f"kernel {symbol}"
    if c_ret != t_ret:
        raise KernelABIError(f"{where}: returns {c_ret} in kernels.c, {t_ret} in kernel_abi.KERNELS")
    for i, (c, t) in enumerate(zip(c_args, t_args)):
        if c != t:
            raise KernelABIError(f"{where}: argument {i} is '{c.type} {c.name}' in kernels.c but "
                                 f"'{t.type} {t.name}' in kernel_abi.KERNELS")
    if len(c_args) != len(t_args):
        longer, side = (c_args, "kernels.c") if len(c_args) > len(t_args) else (t_args, "kernel_abi.KERNELS")
        extra = longer[min(len(c_args), len(t_args))]
        raise KernelABIError(f"{where}: {len(c_args)} arguments in kernels.c, {len(t_args)} in kernel_abi.KERNELS "
                             f"(argument '{extra.type} {extra.name}' only in {side})")
    names = {a.name for a in t_args}
    for n in k.nullable:
        if n not in names:
            raise KernelABIError(f"{where}: nullable argument {n!r} is not one of its arguments")


def _wrapper(symbol: str, fn, args: tuple[Arg, ...], nullable: tuple[str, ...]) -> Callable:
    """A keyword-only Python function with the kernel's own argument names, compiled once so that
    the call costs what a positional ctypes call costs (a generic **kwargs loop adds microseconds,
    and the per-op forward makes ~270 kernel calls a step). Pointer arguments take tensors."""
    conv = []
    for a in args:
        if not a.type.endswith("*"):
            conv.append(a.name)
        elif a.name in nullable:
            conv.append(f"(None if {a.name} is None else {a.name}.data_ptr())")
        else:
            conv.append(f"{a.name}.data_ptr()")
    params = ("*, " + ", ".join(a.name for a in args)) if args else ""
    src = f"def {symbol}({params}):\n    return _fn({', '.join(conv)})\n"
    scope = {"_fn": fn}
    exec(compile(src, f"<kernel_abi {symbol}>", "exec"), scope)   # noqa: S102 - source built from the table
    return scope[symbol]


class KernelLib:
    """The bound kernels: one keyword-only function per symbol of the table (None where its
    guard said the CPU lacks it), plus `cdll`, the loaded library."""

    def __init__(self, cdll):
        self.cdll = cdll

    def __getattr__(self, name):   # only reached for names the table does not bind
        raise AttributeError(f"kernel {name!r} is not in kernel_abi.KERNELS")


def bind(cdll, table: Optional[tuple[Kernel, ...]] = None) -> KernelLib:
    """Check every kernel of `table` (default KERNELS) against the library's own signature text
    and bind it. Raises KernelABIError on the first difference (or a kernel the library lacks)."""
    table = KERNELS if table is None else table
    lib = KernelLib(cdll)
    for symbol, k, elem in symbols(table):
        if k.guard is not None:
            g = lib.__dict__.get(k.guard)
            if g is None and k.guard not in lib.__dict__:
                raise KernelABIError(f"kernel {symbol}: its guard {k.guard} must come earlier in the table")
            if g is None or not g():
                setattr(lib, symbol, None)
                continue
        try:
            fn, abi = getattr(cdll, symbol), getattr(cdll, f"abi_{symbol}")
        except AttributeError:
            raise KernelABIError(f"kernel {symbol}: in kernel_abi.KERNELS but the library has no {symbol} "
                                 f"defined through KERNEL() (no abi_{symbol})") from None
        abi.argtypes, abi.restype = [], ctypes.c_char_p
        compare(symbol, abi().decode(), k, elem)
        ret, args = parse_signature(k.sig, elem)
        fn.argtypes = [_ctype(a.type) for a in args]
        fn.restype = _RESTYPES[ret]
        setattr(lib, symbol, _wrapper(symbol, fn, args, k.nullable))
    return lib


def abi_header() -> str:
    """The C header the build generates and kernels.c includes: KERNEL() and the LW_* order."""
    lw = ", ".join(f"LW_{n.upper()}" for n in LAYER_WEIGHTS)
    lr = ", ".join(f"LR_{n.upper()}" for n in LORA_RECORD)
    ll = ", ".join(f"LL_{n.upper()}" for n in LORA_LINEARS)
    fs = ", ".join(f"FS_{n.upper()}" for n in FORWARD_STAGES)
    return f"""/* generated by shepherd/model/kernel_abi.py at build time: do not edit */
#ifndef SHEPHERD_KERNEL_ABI_H
#define SHEPHERD_KERNEL_ABI_H
/* KERNEL(ret, name, params...) defines `ret name(params)` and beside it abi_<name>(), which returns
 * the definition's own signature text (T unexpanded): kernel_abi.bind checks it at load. */
#define ABI_CAT_(a, b) a##_##b
#define ABI_CAT(a, b) ABI_CAT_(a, b)
#define KERNEL(ret, name, ...) \\
    const char *ABI_CAT(abi, name)(void) {{ return #ret "(" #__VA_ARGS__ ")"; }} \\
    ret name(__VA_ARGS__)
/* one layer's weight pointers for forward_bf16, in kernel_abi.LAYER_WEIGHTS order */
enum {{ {lw}, LW_N }};
/* one layer's ops in forward_bf16, in kernel_abi.FORWARD_STAGES order */
enum {{ {fs}, FWD_STAGES }};
/* one LoRA record (kernel_abi.LORA_RECORD), its part stride, and a layer's linears in record order */
enum {{ {lr}, LR_N }};
#define LR_PART {len(LORA_PART)}
enum {{ {ll}, LL_N }};
#endif
"""
