"""Just enough of the CUDA driver API, through ctypes, to act on a real GPU in tests.

The hardware tests need a process that holds a CUDA context on a given GPU (so NVML lists
it as a compute process) and a kernel that faults (so the driver raises an XID). Both use
``libcuda.so.1`` alone, which is on every host with the NVIDIA driver: no CUDA toolkit and
no Python GPU framework is needed. The faulting kernel is PTX, compiled by the driver.

Run as a script in a child process, so a fault or a held context never touches the test
process's own NVML state::

    python -m tests.hostagent.cuda_driver hold 0000:41:00.0   # "ready", then holds until EOF
    python -m tests.hostagent.cuda_driver fault 0000:41:00.0  # the launch's result name
"""

from __future__ import annotations

import ctypes
import sys

CUDA_SUCCESS = 0
CUDA_ERROR_ILLEGAL_ADDRESS = 700

# A kernel that stores one word at the address it is given. Given an address in the
# unmapped first page, the store faults: the driver reports an MMU fault (an XID) and
# the context is lost; the GPU itself keeps working.
POKE_PTX = b"""
.version 7.0
.target sm_50
.address_size 64
.visible .entry poke(.param .u64 address)
{
    .reg .u64 %rd<2>;
    .reg .u32 %r<2>;
    ld.param.u64 %rd1, [address];
    mov.u32 %r1, 1;
    st.global.u32 [%rd1], %r1;
    ret;
}
"""


class CudaError(RuntimeError):
    """A CUDA driver call returned ``code`` (named ``name``)."""

    def __init__(self, what: str, code: int, name: str) -> None:
        super().__init__(f"{what} failed: {name} ({code})")
        self.code = code
        self.name = name


class CudaDriver:
    """The driver library, initialized, with a primary context current on one GPU."""

    def __init__(self, bdf: str) -> None:
        self._lib = ctypes.CDLL("libcuda.so.1")
        self._check("cuInit", self._lib.cuInit(0))
        device = ctypes.c_int()
        self._check(
            "cuDeviceGetByPCIBusId",
            self._lib.cuDeviceGetByPCIBusId(ctypes.byref(device), bdf.encode()),
        )
        self._context = ctypes.c_void_p()
        self._check(
            "cuDevicePrimaryCtxRetain",
            self._lib.cuDevicePrimaryCtxRetain(ctypes.byref(self._context), device),
        )
        self._check("cuCtxSetCurrent", self._lib.cuCtxSetCurrent(self._context))

    def error_name(self, code: int) -> str:
        name = ctypes.c_char_p()
        if self._lib.cuGetErrorName(code, ctypes.byref(name)) != CUDA_SUCCESS or not name.value:
            return f"CUDA error {code}"
        return name.value.decode()

    def _check(self, what: str, code: int) -> None:
        if code != CUDA_SUCCESS:
            raise CudaError(what, code, self.error_name(code))

    def allocate(self, size: int) -> int:
        """Device memory of ``size`` bytes; its address."""
        address = ctypes.c_uint64()
        self._check(
            "cuMemAlloc", self._lib.cuMemAlloc_v2(ctypes.byref(address), ctypes.c_size_t(size))
        )
        return address.value

    def poke(self, address: int) -> int:
        """Run :data:`POKE_PTX` once on ``address`` and wait for it; the result code of
        the wait (:data:`CUDA_ERROR_ILLEGAL_ADDRESS` when the store faulted)."""
        module = ctypes.c_void_p()
        self._check("cuModuleLoadData", self._lib.cuModuleLoadData(ctypes.byref(module), POKE_PTX))
        function = ctypes.c_void_p()
        self._check(
            "cuModuleGetFunction",
            self._lib.cuModuleGetFunction(ctypes.byref(function), module, b"poke"),
        )
        argument = ctypes.c_uint64(address)
        arguments = (ctypes.c_void_p * 1)(ctypes.cast(ctypes.pointer(argument), ctypes.c_void_p))
        self._check(
            "cuLaunchKernel",
            self._lib.cuLaunchKernel(function, 1, 1, 1, 1, 1, 1, 0, None, arguments, None),
        )
        return int(self._lib.cuCtxSynchronize())


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] not in ("hold", "fault"):
        print("usage: cuda_driver.py hold|fault BDF", file=sys.stderr)
        return 2
    action, bdf = argv
    driver = CudaDriver(bdf)
    if action == "hold":
        driver.allocate(1 << 20)
        print("ready", flush=True)
        sys.stdin.read()  # hold the context until the parent closes our stdin
        return 0
    result = driver.poke(16)
    print(driver.error_name(result), flush=True)
    return 0 if result == CUDA_ERROR_ILLEGAL_ADDRESS else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
