"""The CUDA driver API through ctypes, for kernels/cuda_exl3.py and kernels/cuda_gemv.py: cubins
loaded as modules and their kernels launched on torch's current stream (so CUDA graphs capture
them), with programmatic dependent launch where asked. No build step, no torch extension."""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch


class _LaunchAttr(ctypes.Structure):
    """CUlaunchAttribute: id, padding, a 64-byte value union (cuda.h; 72 bytes)."""
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_int * 16)]


class _LaunchConfig(ctypes.Structure):
    """CUlaunchConfig (cuda.h; 56 bytes)."""
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("smem", ctypes.c_uint),
                ("stream", ctypes.c_void_p), ("attrs", ctypes.POINTER(_LaunchAttr)), ("n_attrs", ctypes.c_uint)]


PDL_ATTR = 6                 # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
MAX_DYNAMIC_SMEM = 8         # CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
STATIC_SMEM_LIMIT = 48 * 1024  # dynamic shared memory past this needs the attribute raised


class _Driver:
    """The few CUDA driver entry points we need, through ctypes."""

    def __init__(self):
        self.lib = ctypes.CDLL("libcuda.so.1")
        v = ctypes.c_void_p
        self.lib.cuLaunchKernel.argtypes = [v, ctypes.c_uint, ctypes.c_uint, ctypes.c_uint, ctypes.c_uint,
                                            ctypes.c_uint, ctypes.c_uint, ctypes.c_uint, v,
                                            ctypes.POINTER(v), ctypes.POINTER(v)]
        self.lib.cuModuleLoadData.argtypes = [ctypes.POINTER(v), ctypes.c_char_p]
        self.lib.cuModuleGetFunction.argtypes = [ctypes.POINTER(v), v, ctypes.c_char_p]
        self.lib.cuCtxGetCurrent.argtypes = [ctypes.POINTER(v)]
        self.lib.cuCtxSetCurrent.argtypes = [v]
        self.lib.cuLaunchKernelEx.argtypes = [ctypes.POINTER(_LaunchConfig), v, ctypes.POINTER(v), ctypes.POINTER(v)]
        self.lib.cuOccupancyMaxActiveBlocksPerMultiprocessor.argtypes = [ctypes.POINTER(ctypes.c_int), v,
                                                                         ctypes.c_int, ctypes.c_size_t]
        self.lib.cuFuncSetAttribute.argtypes = [v, ctypes.c_int, ctypes.c_int]
        u64p, u32p, i = ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_uint32), ctypes.c_int
        self.lib.cuTensorMapEncodeTiled.argtypes = [v, i, ctypes.c_uint32, v, u64p, u64p, u32p, u32p, i, i, i, i]
        # cuFuncGetParamInfo (CUDA 12.4+): a kernel's parameter count, checked against each launch's
        # arguments (a missing one would be read as whatever lies past the packed values)
        self.param_info = getattr(self.lib, "cuFuncGetParamInfo", None)
        if self.param_info is not None:
            self.param_info.argtypes = [v, ctypes.c_size_t, ctypes.POINTER(ctypes.c_size_t), ctypes.POINTER(ctypes.c_size_t)]
        self.pdl = _LaunchAttr(id=PDL_ATTR)
        self.pdl.value[0] = 1

    def check(self, res: int, what: str) -> None:
        if res != 0:
            msg = ctypes.c_char_p()
            self.lib.cuGetErrorString(res, ctypes.byref(msg))
            raise RuntimeError(f"{what}: CUDA error {res} ({(msg.value or b'?').decode()})")

    def current_ctx(self) -> ctypes.c_void_p:
        ctx = ctypes.c_void_p()
        self.check(self.lib.cuCtxGetCurrent(ctypes.byref(ctx)), "cuCtxGetCurrent")
        return ctx


_driver: _Driver | None = None

TMAP_FLOAT16, TMAP_SWIZZLE_128B, TMAP_L2_256B = 6, 3, 3      # cuda.h's CUtensorMap* enums


class TensorMap:
    """A CUtensorMap (128 bytes, 64-byte aligned, host memory): a kernel's ``const
    __grid_constant__ CUtensorMap`` parameter for TMA copies; Module.launch passes it by value."""

    def __init__(self):
        self._buf = ctypes.create_string_buffer(128 + 64)
        self.addr = (ctypes.addressof(self._buf) + 63) & ~63


def tensor_map_2d(ptr: int, rows: int, cols: int, row_stride: int, box_cols: int, box_rows: int) -> TensorMap:
    """The tensor map of fp16 rows (``row_stride`` bytes apart) at device address ``ptr``: boxes of
    ``box_rows`` x ``box_cols`` (128 bytes at most), 128-byte swizzle in shared memory."""
    d, m = driver(), TensorMap()
    dims = (ctypes.c_uint64 * 2)(cols, rows)
    strides = (ctypes.c_uint64 * 1)(row_stride)
    box = (ctypes.c_uint32 * 2)(box_cols, box_rows)
    unit = (ctypes.c_uint32 * 2)(1, 1)
    d.check(d.lib.cuTensorMapEncodeTiled(ctypes.c_void_p(m.addr), TMAP_FLOAT16, 2, ctypes.c_void_p(ptr), dims, strides,
                                         box, unit, 0, TMAP_SWIZZLE_128B, TMAP_L2_256B, 0),
            f"tensor map of {rows} x {cols} fp16 rows, boxes {box_rows} x {box_cols}")
    return m


def driver() -> _Driver:
    global _driver
    if _driver is None:
        _driver = _Driver()
    return _driver


class Module:
    """One loaded cubin on one device: kernels by name, launched on torch's current stream."""

    aff_rows = 0     # rows a slot its MUL1 AFF kernels take (set by cuda_exl3.module; 0: none)
    xdup_words = 0   # uint32 its PRO kernels keep a row's k-tile in shared memory with XDUP_SMEM (cuda_exl3.module)

    def __init__(self, path: Path, device: torch.device):
        d = driver()
        with torch.cuda.device(device):
            torch.zeros(1, device=device)          # make torch's (primary) context current here
            self.ctx = d.current_ctx()
            self.mod = ctypes.c_void_p()
            d.check(d.lib.cuModuleLoadData(ctypes.byref(self.mod), path.read_bytes()), f"load {path.name}")
        self.device = device
        self.fns: dict[str, ctypes.c_void_p] = {}
        self.occupancy: dict[tuple, int] = {}
        self.n_params: dict[str, int | None] = {}
        self.smem_max: dict[str, int] = {}

    def param_count(self, name: str) -> int | None:
        """How many parameters kernel ``name`` takes (None: the driver cannot say)."""
        if name not in self.n_params:
            d, n = driver(), None
            if d.param_info is not None:
                off, size = ctypes.c_size_t(), ctypes.c_size_t()
                n = 0
                while n < 256 and d.param_info(self.fn(name), n, ctypes.byref(off), ctypes.byref(size)) == 0:
                    n += 1
                n = n or None        # a driver that answers nothing for index 0: unknown
            self.n_params[name] = n
        return self.n_params[name]

    def fn(self, name: str) -> ctypes.c_void_p:
        f = self.fns.get(name)
        if f is None:
            f = ctypes.c_void_p()
            driver().check(driver().lib.cuModuleGetFunction(ctypes.byref(f), self.mod, name.encode()), name)
            self.fns[name] = f
        return f

    def allow_smem(self, name: str, smem: int) -> None:
        """Let kernel ``name`` take ``smem`` bytes of dynamic shared memory (past 48 KiB the
        function's limit must be raised before a launch or an occupancy query with them)."""
        if smem > STATIC_SMEM_LIMIT and smem > self.smem_max.get(name, 0):   # (every launch asks: 0 B stops here)
            d = driver()
            d.check(d.lib.cuFuncSetAttribute(self.fn(name), MAX_DYNAMIC_SMEM, smem), f"{name}: {smem} B of shared memory")
            self.smem_max[name] = smem

    def blocks_per_sm(self, name: str, block: int, smem: int = 0) -> int:
        """Resident blocks of ``name`` per SM (registers and shared memory decide): sizes one-wave grids."""
        key = (name, block, smem)
        n = self.occupancy.get(key)
        if n is None:
            c = ctypes.c_int()
            d = driver()
            self.allow_smem(name, smem)
            d.check(d.lib.cuOccupancyMaxActiveBlocksPerMultiprocessor(ctypes.byref(c), self.fn(name), block, smem),
                    f"occupancy {name}")
            n = self.occupancy[key] = max(1, c.value)
        return n

    def launch(self, name: str, grid, block: int, *args, pdl: bool = False, smem: int = 0) -> None:
        """args: tensors (or None for NULL) become pointers, Python ints int32, floats float32,
        TensorMaps their 128 bytes. ``pdl``:
        programmatic dependent launch (the kernel starts early and griddepcontrol.wait's).
        ``smem``: bytes of dynamic shared memory."""
        want = self.param_count(name)
        if want is not None and want != len(args):
            raise RuntimeError(f"{name}: takes {want} parameters, launched with {len(args)}")
        vals = []
        for a in args:
            if isinstance(a, TensorMap):
                vals.append(a)
            elif a is None:
                vals.append(ctypes.c_uint64(0))
            elif isinstance(a, torch.Tensor):
                vals.append(ctypes.c_uint64(a.data_ptr()))
            elif isinstance(a, float):
                vals.append(ctypes.c_float(a))
            else:
                vals.append(ctypes.c_int32(int(a)))
        params = (ctypes.c_void_p * len(vals))(*[v.addr if isinstance(v, TensorMap)
                                                  else ctypes.cast(ctypes.pointer(v), ctypes.c_void_p) for v in vals])
        gx, gy = (grid, 1) if isinstance(grid, int) else grid
        stream = ctypes.c_void_p(torch.cuda.current_stream(self.device).cuda_stream)
        d = driver()
        fn = self.fn(name)
        self.allow_smem(name, smem)

        def go():
            if not pdl:
                return d.lib.cuLaunchKernel(fn, gx, gy, 1, block, 1, 1, smem, stream, params, None)
            cfg = _LaunchConfig(grid=(gx, gy, 1), block=(block, 1, 1), smem=smem, stream=stream,
                                attrs=ctypes.pointer(d.pdl), n_attrs=1)
            return d.lib.cuLaunchKernelEx(ctypes.byref(cfg), fn, params, None)

        # the module lives in its device's primary context; a thread may have another (or none)
        # current (several GPUs in one process, a fresh server thread): switch for the launch only
        cur = d.current_ctx()
        switch = cur.value != self.ctx.value
        if switch:
            d.check(d.lib.cuCtxSetCurrent(self.ctx), "cuCtxSetCurrent")
        try:
            d.check(go(), name)
        finally:
            if switch:
                d.lib.cuCtxSetCurrent(cur)
