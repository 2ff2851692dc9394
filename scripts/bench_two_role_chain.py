"""Benchmark a design for batch-1 decode: d20's GEMV chain on SMs in two roles (scripts/two_role_chain.cu).

Session 23's ring (scripts/bench_gemv_ring.py) showed that a program which streams weights makes its own
barrier polls and activation loads wait behind its stream; session 24's probe
(scripts/bench_sync_under_stream.py) showed that a sync chain on *other* SMs stays near its unloaded cost
while HBM runs at its full rate, provided the stream keeps only ~40 KB in flight per SM. This script runs
the whole GEMV chain that way: clusters of `--cluster` CTAs, rank 0 the syncer (flag barrier with the other
syncers, loads each GEMV's input, hands it over through distributed shared memory), the others streamers
(a producer warp streams the CTA's rows by bulk copies into a shared-memory ring, at most `--inflight`
bands of 8 x 1280 bf16 in flight; eight consumer warps reduce one row each and store into the syncer's
shared memory). Same chain, weights and check as bench_gemv_ring: 4 GEMVs (3840 / 1280 / 5120 / 5120 rows
x 1280) per layer, `--layers` layers of distinct weights (L2-cold).

The CUDA source is compiled at run time by NVRTC (the libnvrtc that torch's CUDA wheels ship) and launched
with a cluster shape through the driver API (ctypes): no build step. Prints one JSON line per run (us per
layer for the chain and for the throttled stream alone, TB/s, the error against the float32 chain), then a
table. Results: CHANGELOG_GB10.md, session 24.

    python -m scripts.bench_two_role_chain --cluster 2,4,8 --inflight 1,2,3

Needs an NVIDIA GPU with clusters and bulk copies (sm_90+).
"""

from __future__ import annotations

import ctypes
import glob
import json
import sys
from pathlib import Path

from nanochat.flags import FlagParser
from scripts.bench_gemv_ring import _ints, chain_weights, cuda_device

K = 1280
RB = 8
BAND_BYTES = RB * K * 2
SOURCE = Path(__file__).with_name("two_role_chain.cu")


def smem_bytes(nslot: int) -> int:
    """The kernel's dynamic shared memory: ring, x + its barrier (128-byte pad), y, 2 x NSLOT + 1 barriers."""
    return nslot * BAND_BYTES + K * 4 + 128 + 5120 * 4 + 8 * (2 * nslot + 1)


def _lib(patterns: list[str], what: str) -> ctypes.CDLL:
    import torch

    roots = [Path(torch.__file__).parents[1] / "nvidia", Path(torch.__file__).parent / "lib"]
    for root in roots:
        for pat in patterns:
            hits = sorted(glob.glob(str(root / "**" / pat), recursive=True))
            if hits:
                return ctypes.CDLL(hits[-1])
    for pat in patterns:  # the system's
        try:
            return ctypes.CDLL(pat.replace("*", ""))
        except OSError:
            pass
    raise SystemExit(f"bench_two_role_chain: {what} not found (looked for {patterns} under {roots})")


def compile_ptx(defines: dict[str, int], arch: str) -> bytes:
    nvrtc = _lib(["libnvrtc.so.1*", "libnvrtc.so.*"], "libnvrtc")
    prog = ctypes.c_void_p()
    src = SOURCE.read_bytes()
    rc = nvrtc.nvrtcCreateProgram(ctypes.byref(prog), src, b"two_role_chain.cu", 0, None, None)
    assert rc == 0, f"nvrtcCreateProgram: {rc}"
    opts = [f"--gpu-architecture={arch}".encode(), b"-std=c++17", b"-default-device"]
    opts += [f"-D{k}={v}".encode() for k, v in defines.items()]
    arr = (ctypes.c_char_p * len(opts))(*opts)
    rc = nvrtc.nvrtcCompileProgram(prog, len(opts), arr)
    size = ctypes.c_size_t()
    nvrtc.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    nvrtc.nvrtcGetProgramLog(prog, log)
    if rc != 0:
        raise RuntimeError(f"NVRTC failed ({rc}):\n{log.value.decode(errors='replace')}")
    nvrtc.nvrtcGetPTXSize(prog, ctypes.byref(size))
    ptx = ctypes.create_string_buffer(size.value)
    nvrtc.nvrtcGetPTX(prog, ptx)
    nvrtc.nvrtcDestroyProgram(ctypes.byref(prog))
    return ptx.raw


class _Dim3(ctypes.Structure):
    _fields_ = [("x", ctypes.c_uint), ("y", ctypes.c_uint), ("z", ctypes.c_uint)]


class _AttrValue(ctypes.Union):
    _fields_ = [("clusterDim", _Dim3), ("pad", ctypes.c_char * 64)]


class _Attr(ctypes.Structure):
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", _AttrValue)]


class _Config(ctypes.Structure):
    _fields_ = [("gridDimX", ctypes.c_uint), ("gridDimY", ctypes.c_uint), ("gridDimZ", ctypes.c_uint),
                ("blockDimX", ctypes.c_uint), ("blockDimY", ctypes.c_uint), ("blockDimZ", ctypes.c_uint),
                ("sharedMemBytes", ctypes.c_uint), ("hStream", ctypes.c_void_p), ("attrs", ctypes.POINTER(_Attr)),
                ("numAttrs", ctypes.c_uint)]


CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8
CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION = 4


class ClusterKernel:
    """The compiled kernel, launched with a cluster shape on torch's current stream (driver API)."""

    def __init__(self, ptx: bytes, name: str, cluster: int, smem: int, threads: int):
        self.cu = _lib(["libcuda.so.1"], "libcuda")
        self.mod, self.fn = ctypes.c_void_p(), ctypes.c_void_p()
        self._check(self.cu.cuModuleLoadData(ctypes.byref(self.mod), ptx), "cuModuleLoadData")
        self._check(self.cu.cuModuleGetFunction(ctypes.byref(self.fn), self.mod, name.encode()), "cuModuleGetFunction")
        self._check(self.cu.cuFuncSetAttribute(self.fn, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem),
                    "cuFuncSetAttribute")
        self.cluster, self.smem, self.threads = cluster, smem, threads
        self.attr = _Attr(id=CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION)
        self.attr.value.clusterDim = _Dim3(cluster, 1, 1)

    def _check(self, rc: int, what: str) -> None:
        if rc != 0:
            msg = ctypes.c_char_p()
            self.cu.cuGetErrorString(rc, ctypes.byref(msg))
            raise RuntimeError(f"{what}: CUDA driver error {rc} ({(msg.value or b'?').decode()})")

    def _config(self, clusters: int, stream: int) -> _Config:
        return _Config(clusters * self.cluster, 1, 1, self.threads, 1, 1, self.smem, ctypes.c_void_p(stream),
                       ctypes.pointer(self.attr), 1)

    def max_clusters(self) -> int:
        n = ctypes.c_int()
        cfg = self._config(1, 0)
        self._check(self.cu.cuOccupancyMaxActiveClusters(ctypes.byref(n), self.fn, ctypes.byref(cfg)),
                    "cuOccupancyMaxActiveClusters")
        return n.value

    def launch(self, clusters: int, stream: int, *args) -> None:
        vals = list(args)  # ctypes values (c_void_p, c_int, ...), alive through the call
        ptrs = (ctypes.c_void_p * len(vals))(*[ctypes.cast(ctypes.pointer(v), ctypes.c_void_p) for v in vals])
        cfg = self._config(clusters, stream)
        self._check(self.cu.cuLaunchKernelEx(ctypes.byref(cfg), self.fn, ptrs, None), "cuLaunchKernelEx")


def parse_args(argv=None):
    p = FlagParser(prog="python -m scripts.bench_two_role_chain", description=__doc__.split("\n")[0])
    p.add_argument("--cluster", default="2,4,8", help="CTAs per cluster (one syncer + streamers), comma list, 2..8")
    p.add_argument("--inflight", default="1,2,3", help="bands (20 KB) in flight per streamer, comma list, 1..8")
    p.add_argument("--group", default="1,2", help="bands a consumer warp reduces together, comma list of 1, 2, 4")
    p.add_argument("--slots", type=int, default=8, help="ring slots per streamer (>= every --inflight), 1..9")
    p.add_argument("--layers", type=int, default=20)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)
    args.cluster = _ints("--cluster", args.cluster, 2, 8)
    args.group = _ints("--group", args.group, 1, 4)
    if 3 in args.group:
        raise ValueError(f"--group: got {args.group}; accepted: a comma list of 1, 2, 4")
    if not 1 <= args.slots <= 9:
        raise ValueError(f"--slots: got {args.slots}; accepted: 1..9 (the ring within ~190 KB of shared memory)")
    args.inflight = _ints("--inflight", args.inflight, 1, args.slots)
    for name in ("layers", "repeats"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name}: got {getattr(args, name)}; accepted: an integer >= 1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    from scripts.benchmark_kernels import _timed  # median ms of back-to-back calls, CUDA events

    dev, props = cuda_device(9, "clusters and bulk copies")
    packed, x, ref = chain_weights(args.layers, dev)
    nbytes = packed.numel() * 2
    act = torch.zeros(4, 5120, device=dev, dtype=torch.float32)
    flags = torch.zeros(256, dtype=torch.int64, device=dev)
    arch = f"sm_{props.major}{props.minor}"
    print(json.dumps({"bench": "config", "device": props.name, "torch": torch.__version__, "programs":
                      props.multi_processor_count, "layers": args.layers, "weight_bytes": nbytes,
                      "nvrtc_arch": arch}), flush=True)
    rows = []
    stream = torch.cuda.current_stream().cuda_stream
    epoch = [0]
    configs = [(cs, d, gr) for cs in args.cluster for d in args.inflight for gr in args.group]
    for cs, d, gr in configs:
        ptx = compile_ptx(dict(CLUSTER=cs, NSLOT=args.slots, D=d, GROUP=gr), arch)
        kern = ClusterKernel(ptx, "two_role_chain", cs, smem_bytes(args.slots), (RB + 1) * 32)
        clusters = min(kern.max_clusters(), 256)

        def launch(mode):
            epoch[0] += 4 * args.layers  # the barrier's flags only grow: each launch waits above the last
            kern.launch(clusters, stream, ctypes.c_void_p(packed.data_ptr()), ctypes.c_void_p(act.data_ptr()),
                        ctypes.c_void_p(flags.data_ptr()), ctypes.c_uint64(epoch[0]), ctypes.c_int(args.layers),
                        ctypes.c_int(mode))
        act.zero_()
        act[0, :K] = x
        launch(0)
        torch.cuda.synchronize()
        err = ((act[0, :K] - ref).abs().max() / ref.abs().max()).item()
        t_chain = 1e3 * _timed(lambda: launch(0), args.repeats, dev, inner=10)
        t_stream = 1e3 * _timed(lambda: launch(1), args.repeats, dev, inner=10)
        t_sync = 1e3 * _timed(lambda: launch(2), args.repeats, dev, inner=10)
        row = dict(bench="two_role_chain", cluster=cs, clusters=clusters, streamers=clusters * (cs - 1),
                   syncers=clusters, inflight_kb=d * BAND_BYTES // 1024, group=gr,
                   us_per_layer=round(t_chain / args.layers, 2), tb_s=round(nbytes / t_chain / 1e6, 3),
                   stream_us_per_layer=round(t_stream / args.layers, 2),
                   stream_tb_s=round(nbytes / t_stream / 1e6, 3), sync_us_per_layer=round(t_sync / args.layers, 2),
                   rel_err=err)
        print(json.dumps(row), flush=True)
        rows.append(row)
    print(f"\n{props.name}: {args.layers} layers x 4 GEMVs, {nbytes / 1e6:.0f} MB of weights, ring of {args.slots} "
          "bands per streamer (us per layer)")
    print(f"{'cluster':>8}{'syncers':>8}{'streamers':>10}{'KB':>5}{'group':>6}{'chain':>8}{'TB/s':>7}{'stream':>8}"
          f"{'TB/s':>7}{'sync':>7}{'rel_err':>10}")
    for r in rows:
        print(f"{r['cluster']:>8}{r['syncers']:>8}{r['streamers']:>10}{r['inflight_kb']:>5}{r['group']:>6}"
              f"{r['us_per_layer']:>8.2f}{r['tb_s']:>7.2f}{r['stream_us_per_layer']:>8.2f}{r['stream_tb_s']:>7.2f}"
              f"{r['sync_us_per_layer']:>7.2f}{r['rel_err']:>10.2e}")
    bad = [r for r in rows if not r["rel_err"] < 1e-3]
    if bad:
        print(f"bench_two_role_chain: {len(bad)} run(s) differ from the float32 chain", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    from nanochat.flags import script_main

    script_main("bench_two_role_chain", lambda: parse_args(sys.argv[1:]), lambda: main(sys.argv[1:]))
