"""A ggml tensor read from Python inside ``cb_eval``: ``struct ggml_tensor``'s ctypes mirror
(checked against ggml once per context), its name, its buffer type and its data as numpy."""
from __future__ import annotations

import ctypes

import numpy as np

from runtime.native.ggml_lib import buffer_type_name, ggml

_GGML_MAX_DIMS = 4
_GGML_MAX_SRC = 10
_GGML_MAX_OP_PARAMS = 64
_GGML_MAX_NAME = 64

# ggml_type -> numpy dtype, for the tensor types router outputs use.
_NUMPY_TYPES = {i: np.dtype(t) for i, t in ((0, np.float32), (1, np.float16), (24, np.int8),
                                            (25, np.int16), (26, np.int32), (27, np.int64),
                                            (28, np.float64))}


class GgmlTensor(ctypes.Structure):
    """``struct ggml_tensor`` of ggml 0.25.3 (ggml.h). Checked against ``ggml_get_name``."""

    _fields_ = [
        ("type", ctypes.c_int),
        ("buffer", ctypes.c_void_p),
        ("ne", ctypes.c_int64 * _GGML_MAX_DIMS),    # elements per dim, ne[0] contiguous
        ("nb", ctypes.c_size_t * _GGML_MAX_DIMS),   # stride per dim, bytes
        ("op", ctypes.c_int),
        ("op_params", ctypes.c_int32 * (_GGML_MAX_OP_PARAMS // 4)),
        ("flags", ctypes.c_int32),
        ("src", ctypes.c_void_p * _GGML_MAX_SRC),
        ("view_src", ctypes.c_void_p),
        ("view_offs", ctypes.c_size_t),
        ("data", ctypes.c_void_p),
        ("name", ctypes.c_char * _GGML_MAX_NAME),
        ("extra", ctypes.c_void_p),
        ("padding", ctypes.c_char * 8),
    ]


NAME_OFFSET = GgmlTensor.name.offset  # bytes from a tensor pointer to its name


def tensor_buffer_type_name(ptr: int) -> str:
    """The buffer type a (model) tensor was allocated in: "CPU_Mapped", "CUDA0", ..."""
    buffer = GgmlTensor.from_address(ptr).buffer
    return buffer_type_name(ggml().base.ggml_backend_buffer_get_type(buffer))


# -- reading tensors inside cb_eval --------------------------------------------------------

def tensor_name(ptr: int) -> bytes:
    """The node's name (``ggml_tensor.name``), read straight from the struct."""
    return ctypes.string_at(ptr + NAME_OFFSET)


def check_tensor_layout(ptr: int) -> None:
    """Assert our struct mirror puts ``name`` where ggml does (checked once per context)."""
    got = ggml().base.ggml_get_name(ptr)
    if got != ptr + NAME_OFFSET:
        raise RuntimeError(f"ggml_tensor layout mismatch: name at +{got - ptr}, "
                           f"expected +{NAME_OFFSET}")
    t = GgmlTensor.from_address(ptr)
    dtype = _NUMPY_TYPES.get(t.type)
    if dtype is not None and 0 not in tuple(t.ne):
        span = dtype.itemsize + sum((n - 1) * b for n, b in zip(t.ne, t.nb))
        if span != ggml().base.ggml_nbytes(ptr):
            raise RuntimeError(f"ggml_tensor layout mismatch: byte span {span} != "
                               f"ggml_nbytes {ggml().base.ggml_nbytes(ptr)}")


def read_tensor(ptr: int) -> np.ndarray:
    """Copy a (possibly strided, possibly device-resident) tensor into a numpy array of
    shape (ne3, ne2, ne1, ne0). Uses ``ggml_backend_tensor_get`` over the tensor's byte span
    (``ggml_nbytes`` for the non-block types read here), then applies the strides ``nb`` on
    the host copy."""
    t = GgmlTensor.from_address(ptr)
    dtype = _NUMPY_TYPES.get(t.type)
    if dtype is None:
        raise TypeError(f"tensor {t.name.decode()!r}: unsupported ggml type {t.type}")
    ne, nb = tuple(t.ne), tuple(t.nb)          # ggml order: ne[0] is contiguous
    itemsize = dtype.itemsize
    if 0 in ne:
        return np.empty((ne[3], ne[2], ne[1], ne[0]), dtype=dtype)
    nbytes = itemsize + sum((n - 1) * b for n, b in zip(ne, nb))   # == ggml_nbytes here
    flat = np.empty(-(-nbytes // itemsize), dtype=dtype)          # host copy, whole items
    ggml().base.ggml_backend_tensor_get(ptr, flat.ctypes.data, 0, nbytes)
    view = np.ndarray((ne[3], ne[2], ne[1], ne[0]), dtype=dtype, buffer=flat,
                      strides=(nb[3], nb[2], nb[1], nb[0]))
    return view.copy()
