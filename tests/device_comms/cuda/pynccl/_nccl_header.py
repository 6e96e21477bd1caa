"""A small parser of ``nccl.h``: function prototypes (as ctypes) and enum values.

Written for the tests, independently of :mod:`device_comms.cuda.pynccl.library`,
so the binding's signature table is checked against the header itself.
"""

from __future__ import annotations

import ctypes
import re
from typing import Any

from device_comms.cuda.pynccl.library import NcclUniqueId

# C type name (after removing const and the pointer stars) -> ctypes type.
C_TYPES: dict[str, Any] = {
    "int": ctypes.c_int,
    "size_t": ctypes.c_size_t,
    "char": ctypes.c_char,
    "ncclResult_t": ctypes.c_int,
    "ncclDataType_t": ctypes.c_int,
    "ncclRedOp_t": ctypes.c_int,
    "ncclComm_t": ctypes.c_void_p,  # typedef struct ncclComm* ncclComm_t
    "cudaStream_t": ctypes.c_void_p,  # typedef struct CUstream_st* cudaStream_t
    "ncclUniqueId": NcclUniqueId,
}

_PROTO = re.compile(r"(ncclResult_t|const\s+char\s*\*)\s*(nccl\w+)\s*\(([^)]*)\)\s*;")
_ENUM = re.compile(r"typedef\s+enum\s*\{(.*?)\}\s*(\w+)\s*;", re.S)
_ENTRY = re.compile(r"(\w+)\s*=\s*(-?(?:0x[0-9a-fA-F]+|\d+))\s*(?=,|$)")


def strip_comments(text: str) -> str:
    """``text`` without ``/* */`` and ``//`` comments."""
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
    return re.sub(r"//[^\n]*", " ", text)


def to_ctype(decl: str) -> Any:
    """The ctypes type of a C type or parameter declaration (``const void* sendbuff``)."""
    decl = re.sub(r"\bconst\b", " ", decl)
    stars = decl.count("*")
    words = decl.replace("*", " ").split()
    base = words[0]
    if base == "void" and stars:
        stars -= 1
        t: Any = ctypes.c_void_p
    elif base == "char" and stars:
        stars -= 1
        t = ctypes.c_char_p
    elif base in C_TYPES:
        t = C_TYPES[base]
    else:  # a type the binding does not use: shows up in a failed comparison
        return f"<unmapped C type {decl.strip()}>"
    for _ in range(stars):
        t = ctypes.POINTER(t)
    return t


def prototypes(header: str) -> dict[str, tuple[Any, tuple[Any, ...]]]:
    """Every ``nccl*`` function of ``header`` as ``name -> (restype, argtypes)``."""
    out = {}
    for ret, name, params in _PROTO.findall(strip_comments(header)):
        params = " ".join(params.split())
        args = () if params in ("", "void") else tuple(to_ctype(p) for p in params.split(","))
        out[name] = (to_ctype(ret), args)
    return out


def enums(header: str) -> dict[str, dict[str, int]]:
    """``typedef enum`` name -> {member: value} (members with a literal value only)."""
    out = {}
    for body, name in _ENUM.findall(strip_comments(header)):
        entries = {}
        for part in body.split(","):
            m = _ENTRY.search(part.strip())
            if m:
                entries[m.group(1)] = int(m.group(2), 0)
        out[name] = entries
    return out


def define(header: str, name: str) -> int:
    """The integer value of ``#define name <int>``."""
    m = re.search(rf"#define\s+{name}\s+(\d+)", header)
    if m is None:
        raise KeyError(name)
    return int(m.group(1))
