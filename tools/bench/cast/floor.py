"""What a float32 -> bf16 publish can gain at best: the cast's floor next to the copy's.

A bf16 slot halves the bytes written, mapped and copied by workers, but the publisher
still reads every float32 byte of the trainer's tensors: against a float32 publish it
moves 512 + 256 MB instead of 512 + 512 MB for a 512 MB model. Whether that makes the
publish 0.5x or 0.9x depends on what bounds one core here: memory traffic or the cast's
arithmetic. This times, alternating in one run (the host's memory speed drifts), on
``--size`` MB of float32 in shared memory (``/dev/shm``, as slots are):

``memmove f32``      glibc's memmove, one thread (non-temporal stores for big copies)
``torch copy_ f32``  what a float32 publish does for a big tensor
``torch cast bf16``  what a bf16 publish does (torch's copy_ with a dtype change)
``avx2 cast bf16``   a hand-written AVX2 cast (and ``avx512``, where the CPU has
                     AVX-512 F and BW), bit-exact with torch (round to nearest
                     even, NaN -> 0xFFFF as torch's
                     vectorized cast writes it), with non-temporal stores; built here with
                     ``cc``, skipped without one or without AVX2
``... x2``           the same two casts on two threads

and prints each median in ms and over ``torch copy_ f32`` (the float32 publish's copy).

    .venv/bin/python -m tools.bench cast floor --size 512 --threads 1
"""

from __future__ import annotations

import argparse
import ctypes
import os
import shutil
import statistics
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

_AVX2_CAST = r"""
#include <immintrin.h>
#include <stddef.h>
#include <stdint.h>

static uint16_t one_bf16(const float *x)
{
    uint32_t u;
    __builtin_memcpy(&u, x, 4);
    if ((u & 0x7FFFFFFF) > 0x7F800000)
        return 0xFFFF;
    return (uint16_t)((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
}

__attribute__((target("avx2")))
void cast_bf16(const float *src, uint16_t *dst, size_t n)
{
    const __m256i bias = _mm256_set1_epi32(0x7FFF), one = _mm256_set1_epi32(1);
    const __m256i qnan = _mm256_set1_epi32(0xFFFF);
    size_t i = 0;
    for (; i < n && ((uintptr_t)(dst + i) & 31); i++)  /* to a 32-byte boundary */
        dst[i] = one_bf16(src + i);
    for (; i + 16 <= n; i += 16) {
        __m256i a = _mm256_loadu_si256((const __m256i *)(src + i));
        __m256i b = _mm256_loadu_si256((const __m256i *)(src + i + 8));
        __m256i ra = _mm256_srli_epi32(_mm256_add_epi32(a, _mm256_add_epi32(bias,
                         _mm256_and_si256(_mm256_srli_epi32(a, 16), one))), 16);
        __m256i rb = _mm256_srli_epi32(_mm256_add_epi32(b, _mm256_add_epi32(bias,
                         _mm256_and_si256(_mm256_srli_epi32(b, 16), one))), 16);
        __m256 fa = _mm256_castsi256_ps(a), fb = _mm256_castsi256_ps(b);
        ra = _mm256_blendv_epi8(ra, qnan, _mm256_castps_si256(_mm256_cmp_ps(fa, fa, _CMP_UNORD_Q)));
        rb = _mm256_blendv_epi8(rb, qnan, _mm256_castps_si256(_mm256_cmp_ps(fb, fb, _CMP_UNORD_Q)));
        __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(ra, rb), 0xD8);
        _mm256_stream_si256((__m256i *)(dst + i), packed);
    }
    _mm_sfence();
    for (; i < n; i++)
        dst[i] = one_bf16(src + i);
}

__attribute__((target("avx512f,avx512bw")))
void cast_bf16_512(const float *src, uint16_t *dst, size_t n)
{
    const __m512i bias = _mm512_set1_epi32(0x7FFF), one = _mm512_set1_epi32(1);
    const __m512i qnan = _mm512_set1_epi32(0xFFFF);
    size_t i = 0;
    for (; i < n && ((uintptr_t)(dst + i) & 31); i++)
        dst[i] = one_bf16(src + i);
    for (; i + 16 <= n; i += 16) {
        __m512i a = _mm512_loadu_si512((const void *)(src + i));
        __m512i r = _mm512_srli_epi32(_mm512_add_epi32(a, _mm512_add_epi32(bias,
                        _mm512_and_si512(_mm512_srli_epi32(a, 16), one))), 16);
        __m512 f = _mm512_castsi512_ps(a);
        r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(f, f, _CMP_UNORD_Q), qnan);
        _mm256_stream_si256((__m256i *)(dst + i), _mm512_cvtepi32_epi16(r));
    }
    _mm_sfence();
    for (; i < n; i++)
        dst[i] = one_bf16(src + i);
}
"""


def _build(workdir: str) -> dict[str, Callable[[int, int, int], None]]:
    """The hand-written casts this CPU runs, as ctypes functions ({} without a compiler)."""
    cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    flags = Path("/proc/cpuinfo").read_text().split()
    if cc is None or "avx2" not in flags:
        return {}
    source, lib = Path(workdir, "cast.c"), Path(workdir, "cast.so")
    source.write_text(_AVX2_CAST)
    build = [cc, "-O3", "-shared", "-fPIC", "-o", str(lib), str(source)]
    subprocess.run(build, check=True, timeout=120)
    casts = {}
    names = [("avx2", "cast_bf16")]
    if "avx512f" in flags and "avx512bw" in flags:
        names.append(("avx512", "cast_bf16_512"))
    for label, symbol in names:
        fn = getattr(ctypes.CDLL(str(lib)), symbol)
        fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
        fn.restype = None
        casts[label] = fn
    return casts


def _split(run: Callable[[int, int, int], None], parts: int) -> Callable[[int, int, int], None]:
    """`run(src, dst, n)` over `parts` threads, each on its own range (ctypes frees the GIL)."""

    def go(src: int, dst: int, n: int) -> None:
        step = (n // parts) & ~63
        spans = [(i * step, n - i * step if i == parts - 1 else step) for i in range(parts)]
        threads = [
            threading.Thread(target=run, args=(src + 4 * lo, dst + 2 * lo, count))
            for lo, count in spans[1:]
        ]
        for t in threads:
            t.start()
        run(src, dst, spans[0][1])
        for t in threads:
            t.join()

    return go


def _shm_tensor(workdir: str, name: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A tensor in a /dev/shm file, touched once, as a slot is."""
    path = Path(workdir, name)
    path.touch()
    tensor = torch.from_file(str(path), shared=True, size=numel, dtype=dtype)
    tensor.zero_()
    return tensor


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", type=int, default=512, help="MB of float32")
    parser.add_argument("--repeats", type=int, default=7, help="alternations")
    parser.add_argument("--threads", type=int, default=1, help="torch's intra-op threads")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    numel = args.size * 2**20 // 4
    shm = tempfile.mkdtemp(prefix="zmqsync-cast-", dir="/dev/shm")
    build = tempfile.mkdtemp(prefix="zmqsync-cast-build-")
    try:
        src = torch.randn(numel)
        src[:4] = torch.tensor([float("nan"), float("inf"), -0.0, 1e-40])
        f32 = _shm_tensor(shm, "f32", numel, torch.float32)
        bf16 = _shm_tensor(shm, "bf16", numel, torch.bfloat16)
        casts = _build(build)
        ways: dict[str, Callable[[], object]] = {
            "memmove f32": lambda: ctypes.memmove(f32.data_ptr(), src.data_ptr(), numel * 4),
            "torch copy_ f32": lambda: f32.copy_(src),
            "torch cast bf16": lambda: bf16.copy_(src),
        }
        expected = src.to(torch.bfloat16).view(torch.int16)
        for label, cast in casts.items():
            two = _split(cast, 2)
            ways[f"{label} cast bf16"] = partial(cast, src.data_ptr(), bf16.data_ptr(), numel)
            ways[f"{label} cast bf16 x2"] = partial(two, src.data_ptr(), bf16.data_ptr(), numel)
            bf16.zero_()
            cast(src.data_ptr(), bf16.data_ptr(), numel)
            exact = torch.equal(expected, bf16.view(torch.int16))
            print(f"{label} cast bit-exact with torch's: {exact}")
        samples: dict[str, list[float]] = {way: [] for way in ways}
        for repeat in range(args.repeats + 1):
            order = list(ways)
            order = order[repeat % len(order) :] + order[: repeat % len(order)]
            for way in order:
                started = time.perf_counter()
                ways[way]()
                if repeat:  # the first round pages everything in
                    samples[way].append(time.perf_counter() - started)
        base = statistics.median(samples["torch copy_ f32"])
        load = os.getloadavg()[0]
        print(f"{args.size} MB float32, torch threads {args.threads}, load {load:.1f}")
        print(f"{'way':22s} {'p50 ms':>8s} {'/ copy_ f32':>12s}")
        for way, values in samples.items():
            p50 = statistics.median(values)
            print(f"{way:22s} {p50 * 1e3:8.1f} {p50 / base:12.2f}")
    finally:
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(build, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
