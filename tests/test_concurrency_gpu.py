"""Concurrency: threads on their own streams, first-call compilation racing in threads and in
processes over one fresh kernel cache, inputs on a device that is not the current one."""

import concurrent.futures
import hashlib
import json
import os
import pathlib
import subprocess
import sys
import threading

import numpy as np
import pytest
from reliability_helpers import backward_is_reproducible, check_backward, check_forward, random_inputs, same_bits

pytestmark = pytest.mark.gpu

REPO = pathlib.Path(__file__).resolve().parent.parent
ITERATIONS = 20


# ------------------------------------------------------------------------------------------------
# (a) two threads, each on its own non-blocking stream, forward + backward 20 times at once on
# different inputs and configurations: results bit-identical to single-threaded ones (gradients of
# the plans that add dQ with fp32 reductions in a varying order: within 2 units of the last place)
# ------------------------------------------------------------------------------------------------

# (dtype, batch, seqlen_q, seqlen_k, nheads, nheads_kv, head_dim, causal) per thread
THREAD_CONFIGS = [("bf16", 2, 517, 517, 8, 2, 64, True), ("fp16", 2, 333, 401, 4, 4, 128, False)]


def _thread_inputs(cp, config, seed):
    dtype, b, sq, sk, h, hk, d, _ = config
    return random_inputs(cp, [(b, sq, h, d), (b, sk, hk, d), (b, sk, hk, d), (b, sq, h, d)], dtype, seed)


def _reproducible(config) -> bool:
    dtype, _, _, _, h, hk, d, causal = config
    return backward_is_reproducible(dtype, d, h, hk, causal)


def _matches(xp, result, expected, config) -> bool:
    """out and LSE bit for bit; gradients too, or within 2 ulps of 16-bit floats (2^-7 relative)
    where the plan's dQ reductions run in a varying order. A stream or buffer mix-up is far larger."""
    if _reproducible(config):
        return all(same_bits(xp, a, b) for a, b in zip(result, expected))
    exact = all(same_bits(xp, a, b) for a, b in zip(result[:2], expected[:2]))
    grads = zip(result[2:], expected[2:])
    return exact and all(bool((abs(a.astype(xp.float32) - b.astype(xp.float32)) <=
                               abs(b.astype(xp.float32)) * 2**-7 + 1e-6).all()) for a, b in grads)


def _fwd_bwd(cuflash2, q, k, v, dout, causal):
    out, lse = cuflash2.flash_attn_forward(q, k, v, causal=causal)
    return (out, lse, *cuflash2.flash_attn_backward(dout, q, k, v, out, lse, causal=causal))


def test_threads_on_own_streams_match_single_threaded_results():
    import cupy as cp

    import cuflash2

    inputs = [[_thread_inputs(cp, c, seed=10 * t + i) for i in range(2)] for t, c in enumerate(THREAD_CONFIGS)]
    expected = [[_fwd_bwd(cuflash2, *x, c[-1]) for x in sets] for sets, c in zip(inputs, THREAD_CONFIGS)]
    q, k, v, dout = inputs[0][0]
    check_forward(cp, q, k, v, expected[0][0][0], expected[0][0][1], True)
    check_backward(cp, q, k, v, dout, expected[0][0][2:], True)
    cp.cuda.Device().synchronize()
    barrier = threading.Barrier(len(THREAD_CONFIGS))

    def work(t):
        stream = cp.cuda.Stream(non_blocking=True)
        results = []
        with stream:
            barrier.wait()
            for it in range(ITERATIONS):
                results.append(_fwd_bwd(cuflash2, *inputs[t][it % 2], THREAD_CONFIGS[t][-1]))
            stream.synchronize()
            return [it for it, r in enumerate(results)
                    if not _matches(cp, r, expected[t][it % 2], THREAD_CONFIGS[t])]

    with concurrent.futures.ThreadPoolExecutor(len(THREAD_CONFIGS)) as pool:
        mismatches = list(pool.map(work, range(len(THREAD_CONFIGS))))
    assert mismatches == [[]] * len(THREAD_CONFIGS), f"iterations differing from single-threaded runs: {mismatches}"


# Decoding steps from two threads at once, each on its own stream: the fast path of a known call
# signature (the KV-cache replay) shares its recordings between threads and packs arguments per thread. Each
# thread's 20 steps (split-KV in one, unsplit in the other) must equal its single-threaded outputs.
DECODE_CONFIGS = [(1, 3000, 0), (4, 700, 1)]  # (batch, cache length, num_splits) per thread


def test_decode_threads_on_own_streams_match_single_threaded_results():
    import cupy as cp

    import cuflash2

    def inputs(config, seed):
        batch, length, _ = config
        q, k_cache, v_cache = random_inputs(cp, [(batch, 1, 32, 128), (batch, length, 8, 128),
                                                 (batch, length, 8, 128)], "bf16", seed)
        lengths = cp.asarray(np.arange(batch, dtype=np.int32) * 7 + length - 30)
        return q, k_cache, v_cache, lengths

    def step(q, k_cache, v_cache, lengths, splits):
        return cuflash2.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths, num_splits=splits,
                                               return_softmax_lse=True)

    data = [[inputs(c, 100 * t + i) for i in range(2)] for t, c in enumerate(DECODE_CONFIGS)]
    expected = [[step(*x, c[-1]) for x in sets] for sets, c in zip(data, DECODE_CONFIGS)]
    cp.cuda.Device().synchronize()
    barrier = threading.Barrier(len(DECODE_CONFIGS))

    def work(t):
        stream = cp.cuda.Stream(non_blocking=True)
        with stream:
            barrier.wait()
            results = [step(*data[t][it % 2], DECODE_CONFIGS[t][-1]) for it in range(ITERATIONS)]
            stream.synchronize()
        return [it for it, r in enumerate(results)
                if not all(same_bits(cp, a, b) for a, b in zip(r, expected[t][it % 2]))]

    with concurrent.futures.ThreadPoolExecutor(len(DECODE_CONFIGS)) as pool:
        mismatches = list(pool.map(work, range(len(DECODE_CONFIGS))))
    assert mismatches == [[]] * len(DECODE_CONFIGS), f"steps differing from single-threaded runs: {mismatches}"


def _torch_matches(torch, result, expected, config) -> bool:
    """As _matches, for (out, dq, dk, dv) torch tensors."""
    if _reproducible(config):
        return all(torch.equal(a, b) for a, b in zip(result, expected))
    return torch.equal(result[0], expected[0]) and all(
        bool(((a.float() - b.float()).abs() <= b.float().abs() * 2**-7 + 1e-6).all())
        for a, b in zip(result[1:], expected[1:]))


def test_torch_threads_on_own_streams_match_single_threaded_results():
    torch = pytest.importorskip("torch")
    import cuflash2

    def make(config, seed):
        dtype, b, sq, sk, h, hk, d, _ = config
        gen = torch.Generator(device="cuda").manual_seed(seed)
        tdtype = torch.bfloat16 if dtype == "bf16" else torch.float16
        shapes = [(b, sq, h, d), (b, sk, hk, d), (b, sk, hk, d), (b, sq, h, d)]
        return [torch.randn(s, device="cuda", dtype=tdtype, generator=gen, requires_grad=i < 3)
                for i, s in enumerate(shapes)]

    def run(q, k, v, dout, causal):
        out = cuflash2.flash_attn_func(q, k, v, causal=causal)
        return (out.detach(), *torch.autograd.grad(out, (q, k, v), dout))

    inputs = [make(c, 100 + t) for t, c in enumerate(THREAD_CONFIGS)]
    expected = [run(*x, c[-1]) for x, c in zip(inputs, THREAD_CONFIGS)]
    torch.cuda.synchronize()
    barrier = threading.Barrier(len(THREAD_CONFIGS))

    def work(t):
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            barrier.wait()
            results = [run(*inputs[t], THREAD_CONFIGS[t][-1]) for _ in range(ITERATIONS)]
        stream.synchronize()
        return [it for it, r in enumerate(results) if not _torch_matches(torch, r, expected[t], THREAD_CONFIGS[t])]

    with concurrent.futures.ThreadPoolExecutor(len(THREAD_CONFIGS)) as pool:
        mismatches = list(pool.map(work, range(len(THREAD_CONFIGS))))
    assert mismatches == [[]] * len(THREAD_CONFIGS), f"iterations differing from single-threaded runs: {mismatches}"


# ------------------------------------------------------------------------------------------------
# (b) and (c): first calls racing to compile, in threads of one process and in several processes,
# over one fresh CuPy kernel cache. Both run in child processes: CuPy 14 fixes its cache directory
# when cupy.cuda.compiler is imported, and CuPy memoizes modules in-process, so only a fresh
# interpreter with CUPY_CACHE_DIR set truly compiles for the first time.
# ------------------------------------------------------------------------------------------------

CHILD = r'''
import hashlib, json, sys, threading
import numpy as np
import cupy as cp
from cupy.cuda import compiler as cupy_compiler

compiles = None  # NVRTC compilations of cuflash2 kernels in this process (None: cannot count)
if hasattr(cupy_compiler, "_compile_using_nvrtc_no_warning"):
    compiles = []
    _original = cupy_compiler._compile_using_nvrtc_no_warning

    def _counting(*args, **kwargs):
        for arg in list(args) + list(kwargs.values()):
            if isinstance(arg, (list, tuple)) and any("flash_" in str(n) for n in arg):
                compiles.append(sorted(map(str, arg)))
        return _original(*args, **kwargs)

    cupy_compiler._compile_using_nvrtc_no_warning = _counting

import cuflash2

threads, head_dim, causal = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "1"
rng = np.random.default_rng(1234)
q, k, v = (cp.asarray(rng.standard_normal(s, dtype=np.float32).astype(np.float16))
           for s in ((2, 333, 4, head_dim), (2, 401, 2, head_dim), (2, 401, 2, head_dim)))
cp.cuda.Device().synchronize()
barrier = threading.Barrier(threads)
results, errors = [None] * threads, []

def work(i):
    try:
        barrier.wait()
        out, _ = cuflash2.flash_attn_forward(q, k, v, causal=causal)
        results[i] = cp.asnumpy(out)
    except BaseException as exc:
        errors.append(f"{type(exc).__name__}: {exc}")

workers = [threading.Thread(target=work, args=(i,)) for i in range(threads)]
for w in workers:
    w.start()
for w in workers:
    w.join()
# (no other GPU work here: CuPy's own kernels would be compiled into the fresh cache too)
report = {"errors": errors, "compiles": None if compiles is None else len(compiles),
          "checksums": [hashlib.sha256(r.tobytes()).hexdigest() if r is not None else None for r in results]}
print("RESULT " + json.dumps(report), flush=True)
'''

# Small and quick to compile (a fresh cache compiles it whatever the rest of the suite did).
CHILD_HEAD_DIM, CHILD_CAUSAL = 32, True


def _child_env(cache_dir):
    env = dict(os.environ)
    env["CUPY_CACHE_DIR"] = str(cache_dir)
    env.pop("CUPY_CACHE_IN_MEMORY", None)
    import cuflash2  # the children import the cuflash2 this process imported (installed, or a checkout's)

    here = str(pathlib.Path(cuflash2.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join([here] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    return env


def _start_child(script, cache_dir, threads):
    return subprocess.Popen([sys.executable, str(script), str(threads), str(CHILD_HEAD_DIM), str(int(CHILD_CAUSAL))],
                            cwd=REPO, env=_child_env(cache_dir), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def _finish_child(proc, timeout=300):
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise
    assert proc.returncode == 0, f"child exited {proc.returncode}:\n{stderr[-4000:]}"
    lines = [line for line in stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, f"child printed no result:\n{stdout[-2000:]}\n{stderr[-2000:]}"
    report = json.loads(lines[-1][len("RESULT "):])
    assert report["errors"] == [], report["errors"]
    assert None not in report["checksums"]
    return report


def _expected_checksum():
    """The same forward in this process (kernels from the usual cache), checked against the fp32
    reference: the children's results must equal it bit for bit."""
    import cupy as cp

    import cuflash2

    rng = np.random.default_rng(1234)
    q, k, v = (cp.asarray(rng.standard_normal(s, dtype=np.float32).astype(np.float16))
               for s in ((2, 333, 4, CHILD_HEAD_DIM), (2, 401, 2, CHILD_HEAD_DIM), (2, 401, 2, CHILD_HEAD_DIM)))
    out, lse = cuflash2.flash_attn_forward(q, k, v, causal=CHILD_CAUSAL)
    check_forward(cp, q, k, v, out, lse, CHILD_CAUSAL)
    return hashlib.sha256(cp.asnumpy(out).tobytes()).hexdigest()


def _cubins(cache_dir):
    return [p for p in pathlib.Path(cache_dir).iterdir() if p.is_file() and p.suffix == ".cubin"]


def test_first_call_compiles_once_when_threads_race(tmp_path):
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    cache = tmp_path / "kernel_cache"
    report = _finish_child(_start_child(script, cache, threads=4))
    assert len(set(report["checksums"])) == 1, "threads got different results"
    assert report["checksums"][0] == _expected_checksum(), "a first-call compile under contention computes differently"
    if report["compiles"] is not None:
        assert report["compiles"] == 1, f"{report['compiles']} NVRTC compilations for one kernel"
    assert _cubins(cache), "nothing was written to the fresh kernel cache"


def test_processes_share_a_fresh_kernel_cache(tmp_path):
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    cache = tmp_path / "kernel_cache"
    racing = [_start_child(script, cache, threads=1) for _ in range(3)]
    reports = [_finish_child(p) for p in racing]
    checksums = {c for r in reports for c in r["checksums"]}
    if None not in (r["compiles"] for r in reports):
        assert sum(r["compiles"] for r in reports) >= 1, "nothing was compiled: the cache was not fresh"
    assert checksums == {_expected_checksum()}, "processes racing on one cache got different results"
    files = _cubins(cache)
    assert files and all(p.stat().st_size > 0 for p in files), "cache files missing or empty"
    # a later process finds every kernel in the cache, intact: no compilation, same result
    later = _finish_child(_start_child(script, cache, threads=1))
    assert later["checksums"][0] in checksums
    if later["compiles"] is not None:
        assert later["compiles"] == 0, "the kernel cache written by racing processes was not reused"


def test_get_kernel_from_many_threads_returns_one_kernel():
    """cuflash2's in-process table: threads asking at once for a kernel not loaded yet all get the
    same object (the entry is removed first and repopulated by the race)."""
    import cupy as cp

    from cuflash2.runtime import compiler
    from cuflash2.families.mma_sync import launches as launch
    from cuflash2.runtime import launcher
    from cuflash2.families.mma_sync import forward_config

    device = cp.cuda.Device().id
    config = forward_config(96, "fp16", True, launch.device_arch(device))
    compiler._loaded.pop((device, config), None)
    barrier = threading.Barrier(8)

    def work(_):
        barrier.wait()
        return compiler.get_kernel(config, device)

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        kernels = list(pool.map(work, range(8)))
    assert all(kernel is kernels[0] for kernel in kernels)
    assert compiler._loaded[(device, config)] is kernels[0]


# ------------------------------------------------------------------------------------------------
# (d) inputs on a device that is not the current one
# ------------------------------------------------------------------------------------------------

def test_inputs_on_a_non_current_device():
    import cupy as cp

    import cuflash2

    if cp.cuda.runtime.getDeviceCount() < 2:
        pytest.skip("needs two GPUs")
    with cp.cuda.Device(1):
        q, k, v, dout = random_inputs(cp, [(2, 257, 4, 64), (2, 301, 2, 64), (2, 301, 2, 64), (2, 257, 4, 64)],
                                      "bf16", 5)
    with cp.cuda.Device(0):
        out, lse = cuflash2.flash_attn_forward(q, k, v, causal=True)
        grads = cuflash2.flash_attn_backward(dout, q, k, v, out, lse, causal=True)
        assert cp.cuda.Device().id == 0, "the call changed the current device"
    for name, x in (("out", out), ("lse", lse), ("dq", grads[0]), ("dk", grads[1]), ("dv", grads[2])):
        assert x.device.id == 1, f"{name} is on device {x.device.id}, not on the inputs' device 1"
    with cp.cuda.Device(1):
        cp.cuda.Device().synchronize()
        check_forward(cp, q, k, v, out, lse, True)
        check_backward(cp, q, k, v, dout, grads, True)
