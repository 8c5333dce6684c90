"""The C/Python kernel seam (shepherd/model/kernel_abi.py): the table and the library must agree
argument by argument, or loading fails loudly, naming the kernel and the argument."""
from __future__ import annotations

import ctypes
import dataclasses
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from shepherd.model import kernel_abi, kernels
from shepherd.model.kernel_abi import KERNELS, Kernel, KernelABIError

MODEL_DIR = Path(kernels.__file__).parent


@pytest.fixture(scope="module")
def cdll():
    so = kernels.build()
    if so is None:
        pytest.skip("no C compiler: the fused kernels are off")
    return ctypes.CDLL(so)


def with_sig(name: str, sig: str, **kw) -> tuple[Kernel, ...]:
    """KERNELS with one row's signature (and fields) replaced."""
    assert any(k.name == name for k in KERNELS)
    return tuple(dataclasses.replace(k, sig=sig, **kw) if k.name == name else k for k in KERNELS)


def row(name: str) -> Kernel:
    return next(k for k in KERNELS if k.name == name)


def test_the_table_binds_the_built_library(cdll):
    lib = kernel_abi.bind(cdll)
    for symbol, k, _ in kernel_abi.symbols(KERNELS):
        fn = getattr(lib, symbol)
        assert fn is not None or k.guard is not None, symbol


def test_swapped_arguments_fail_at_load_naming_kernel_and_argument(cdll):
    sig = row("forward_bf16").sig.replace("int64_t H, int64_t KVH,", "int64_t KVH, int64_t H,")
    if kernel_abi.bind(cdll).forward_bf16 is None:
        pytest.skip("no AVX-512: forward_bf16 is not built here")
    with pytest.raises(KernelABIError, match=r"forward_bf16: argument 13 is 'int64_t H' in kernels.c "
                                             r"but 'int64_t KVH' in kernel_abi.KERNELS"):
        kernel_abi.bind(cdll, with_sig("forward_bf16", sig))


def test_a_missing_argument_or_a_changed_type_fails_at_load(cdll):
    dropped = row("rmsnorm").sig.replace(", float eps)", ")")
    with pytest.raises(KernelABIError, match=r"rmsnorm_bf16: 8 arguments in kernels.c, 7 in kernel_abi.KERNELS "
                                             r"\(argument 'float eps' only in kernels.c\)"):
        kernel_abi.bind(cdll, with_sig("rmsnorm", dropped))
    narrowed = row("argmax_rows").sig.replace("int64_t V", "int V")
    with pytest.raises(KernelABIError, match=r"argmax_rows: argument 2 is 'int64_t V' in kernels.c but 'int V'"):
        kernel_abi.bind(cdll, with_sig("argmax_rows", narrowed))
    with pytest.raises(KernelABIError, match=r"has_w8_mm: returns int in kernels.c, void in"):
        kernel_abi.bind(cdll, with_sig("has_w8_mm", "void(void)"))
    with pytest.raises(KernelABIError, match="no_such_kernel"):
        kernel_abi.bind(cdll, KERNELS + (Kernel("no_such_kernel", "void(void)"),))


def test_load_raises_instead_of_falling_back(cdll, monkeypatch):
    """A mismatch is a bug: load() must not hide it behind the pure-torch path."""
    monkeypatch.setattr(kernel_abi, "KERNELS", with_sig("silu_mul", "void(const T *gu, T *out, int64_t I, "
                                                                     "int64_t rows)"))
    monkeypatch.setattr(kernels, "_tried", False)
    monkeypatch.setattr(kernels, "_lib", None)
    with pytest.raises(KernelABIError, match=r"silu_mul_bf16: argument 2 is 'int64_t rows'"):
        kernels.load()


def test_a_c_definition_that_drifts_from_the_table_fails_at_load(tmp_path):
    """The other direction: kernels.c edited, the table not (here a tiny library built with the
    same generated header, whose argmax_rows swaps two arguments)."""
    cc = shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        pytest.skip("no C compiler")
    (tmp_path / "kernel_abi.h").write_text(kernel_abi.abi_header())
    (tmp_path / "k.c").write_text('#include <stdint.h>\n#include "kernel_abi.h"\n'
                                  "KERNEL(void, argmax_rows, const float *x, int64_t V, int64_t rows,\n"
                                  "       int64_t *out) { (void)x; (void)V; (void)rows; (void)out; }\n")
    subprocess.run([cc, "-shared", "-fPIC", "-I", str(tmp_path), str(tmp_path / "k.c"), "-o",
                    str(tmp_path / "k.so")], check=True)
    with pytest.raises(KernelABIError, match=r"argmax_rows: argument 1 is 'int64_t V' in kernels.c but "
                                             r"'int64_t rows' in kernel_abi.KERNELS"):
        kernel_abi.bind(ctypes.CDLL(str(tmp_path / "k.so")), (row("argmax_rows"),))


def test_kernels_are_called_by_name_only(cdll):
    lib = kernel_abi.bind(cdll)
    x = torch.tensor([[0.0, 3.0, 1.0], [5.0, -1.0, 2.0]])
    out = torch.empty(2, dtype=torch.long)
    lib.argmax_rows(x=x, rows=2, V=3, out=out)
    assert out.tolist() == [1, 0]
    with pytest.raises(TypeError):
        lib.argmax_rows(x, 2, 3, out)            # positional: the mistake the seam exists to prevent
    with pytest.raises(TypeError):
        lib.argmax_rows(x=x, rows=2, cols=3, out=out)


def test_every_kernel_in_c_is_in_the_table_and_back():
    src = (MODEL_DIR / "kernels.c").read_text() + (MODEL_DIR / "kernels_body.h").read_text()
    in_c = set()
    for m in re.finditer(r"^KERNEL\([^,]*,\s*(FN\()?(\w+)", src, re.M):   # FN(name): once per element type
        in_c |= {f"{m.group(2)}_{suf}" for suf in kernel_abi.DTYPES} if m.group(1) else {m.group(2)}
    assert in_c == {symbol for symbol, _, _ in kernel_abi.symbols(KERNELS)}
    # every C function Python binds goes through KERNEL(): no plain non-static definitions left
    plain = re.findall(r"^(?:void|int|float)\s+(?:FN\()?(\w+)\)?\(", src, re.M)
    assert not set(plain) & {k.name for k in KERNELS}


def test_layer_weight_order_is_the_generated_enum():
    header = kernel_abi.abi_header()
    enum = re.search(r"enum \{ (.*), LW_N \};", header).group(1).split(", ")
    assert enum == [f"LW_{n.upper()}" for n in kernel_abi.LAYER_WEIGHTS]
    t = torch.zeros(4)
    layer = {n: (t if n != "qkv_b" else None) for n in kernel_abi.LAYER_WEIGHTS}
    lw = kernels.Kernels.layer_weights([layer, layer])
    assert lw.tolist() == [0 if layer[n] is None else t.data_ptr() for n in kernel_abi.LAYER_WEIGHTS] * 2
    with pytest.raises(KeyError, match="expected"):
        kernels.Kernels.layer_weights([{**layer, "extra": t}])
