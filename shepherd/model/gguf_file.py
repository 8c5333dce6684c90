"""A small, fast GGUF reader (metadata via struct, tensors as numpy memmap views)."""
from __future__ import annotations

import numpy as np

from shepherd.model.errors import ModelLoadError


class _GGUFTensor:
    __slots__ = ("name", "shape", "tensor_type", "data")

    def __init__(self, name, shape, tensor_type, data):
        self.name, self.shape, self.tensor_type, self.data = name, shape, tensor_type, data


class _GGUFFile:
    """A small, fast GGUF reader: metadata via struct, tensors as numpy memmap views.
    (gguf.GGUFReader takes seconds to parse a vocabulary; this takes ~0.1 s.)"""

    _SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
               10: "<Q", 11: "<q", 12: "<d"}
    _NP = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32,
           6: np.float32, 7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}

    def __init__(self, path: str, with_tensors: bool = True):
        import struct
        self.path = path
        self._mm = np.memmap(path, dtype=np.uint8, mode="r")
        data = self._mm
        self._buf = memoryview(data)
        self._pos = 0
        self._struct = struct
        if bytes(self._buf[:4]) != b"GGUF":
            raise ModelLoadError(f"{path}: not a GGUF file")
        self._pos = 4
        version = self._u("<I")
        if version < 2:
            raise ModelLoadError(f"{path}: GGUF version {version} is too old")
        n_tensors = self._u("<Q")
        n_kv = self._u("<Q")
        self.fields: dict = {}
        for _ in range(n_kv):
            key = self._str()
            vtype = self._u("<I")
            self.fields[key] = self._value(vtype)
        infos = []
        for _ in range(n_tensors):
            name = self._str()
            nd = self._u("<I")
            dims = [self._u("<Q") for _ in range(nd)]
            ttype = self._u("<I")
            off = self._u("<Q")
            infos.append((name, dims, ttype, off))
        align = int(self.fields.get("general.alignment", 32))
        start = (self._pos + align - 1) // align * align
        self.tensors: list[_GGUFTensor] = []
        if with_tensors:
            import gguf
            for name, dims, ttype, off in infos:
                qt = gguf.GGMLQuantizationType(ttype)
                block, tsize = gguf.GGML_QUANT_SIZES[qt]
                ne = 1
                for d in dims:
                    ne *= d
                nbytes = ne // block * tsize
                raw = data[start + off: start + off + nbytes]
                rows = ne // dims[0]
                self.tensors.append(_GGUFTensor(name, dims, qt, raw.reshape(rows, -1)))

    def _u(self, fmt):
        v = self._struct.unpack_from(fmt, self._buf, self._pos)[0]
        self._pos += self._struct.calcsize(fmt)
        return v

    def _str(self) -> str:
        n = self._u("<Q")
        s = bytes(self._buf[self._pos:self._pos + n]).decode("utf-8", errors="replace")
        self._pos += n
        return s

    def _value(self, vtype):
        if vtype == 8:
            return self._str()
        if vtype == 9:
            etype = self._u("<I")
            n = self._u("<Q")
            if etype == 8:
                out = []
                buf, pos, unpack = self._buf, self._pos, self._struct.unpack_from
                p = pos
                for _ in range(n):
                    ln = unpack("<Q", buf, p)[0]
                    p += 8
                    out.append(str(buf[p:p + ln], "utf-8", "replace"))
                    p += ln
                self._pos = p
                return out
            if etype in self._NP:
                dt = np.dtype(self._NP[etype])
                arr = np.frombuffer(self._buf, dtype=dt, count=n, offset=self._pos)
                self._pos += n * dt.itemsize
                return arr.tolist()
            return [self._value(etype) for _ in range(n)]
        fmt = self._SCALAR.get(vtype)
        if fmt is None:
            raise ModelLoadError(f"{self.path}: unknown GGUF value type {vtype}")
        return self._u(fmt)


def gguf_reader(path: str, with_tensors: bool = True) -> _GGUFFile:
    try:
        return _GGUFFile(path, with_tensors=with_tensors)
    except ModelLoadError:
        raise
    except Exception as e:
        raise ModelLoadError(f"{path}: not a readable GGUF file ({e})") from e


