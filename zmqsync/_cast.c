/* zmqsync._native.cast_bf16: the publisher's float32 -> bf16 cast into a bf16 slot.
 *
 * A bf16 publish reads every float32 byte of the trainer's tensors and writes half as
 * many: against a float32 publish it moves 3/4 of the bytes, and what is left to win is
 * in how the cast writes. torch's cast (copy_ with a dtype change) ran at 0.91-0.97x of
 * a float32 publish here; these casts, with non-temporal stores for big plans, at
 * 0.74-0.80x of torch's float32 copy (python -m tools.bench cast floor).
 *
 * Bit for bit what torch's CPU cast writes (the Python reference, held to it by
 * tests/test_cast.py): round to nearest, ties to even, on the bits (subnormals are kept,
 * never flushed; a value that rounds past the largest bf16 becomes an infinity), and
 * every NaN, whatever its sign and payload, becomes 0xFFFF as torch's vectorized cast
 * writes it. AVX512_BF16's vcvtneps2bf16 is not used: it flushes subnormal inputs.
 *
 * Which instructions run is chosen per call from what this CPU has
 * (__builtin_cpu_supports), never from the build machine's flags: AVX-512 F+BW, else
 * AVX2, else one value at a time. Plans run through _native.c's runner (zs_run_plan),
 * shared among threads as the byte copies are.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "_plan.h"

#define CAST_CHUNK ((uint64_t)128 * 1024) /* floats: 512 KiB read, 256 KiB written */

enum { ISA_SCALAR, ISA_AVX2, ISA_AVX512, ISA_COUNT };
static const char *const isa_names[ISA_COUNT] = {"scalar", "avx2", "avx512"};

static uint16_t one_bf16(const float *x)
{
    uint32_t u;
    memcpy(&u, x, 4);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) {
        return 0xFFFF;
    }
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

static void cast_scalar(const float *src, uint16_t *dst, size_t n, int stream)
{
    (void)stream;
    for (size_t i = 0; i < n; i++) {
        dst[i] = one_bf16(src + i);
    }
}

/* The first values one at a time, until dst is 32-byte aligned (streaming stores need
 * it); returns how many. */
static size_t to_boundary(const float *src, uint16_t *dst, size_t n)
{
    size_t i = 0;
    for (; i < n && ((uintptr_t)(dst + i) & 31u); i++) {
        dst[i] = one_bf16(src + i);
    }
    return i;
}

__attribute__((target("avx2"))) static __m256i round8(__m256i a)
{
    const __m256i bias = _mm256_set1_epi32(0x7FFF), one = _mm256_set1_epi32(1);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(a, 16), one);
    const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(a, _mm256_add_epi32(bias, lsb)), 16);
    const __m256 f = _mm256_castsi256_ps(a);
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(f, f, _CMP_UNORD_Q));
    return _mm256_blendv_epi8(r, _mm256_set1_epi32(0xFFFF), nan);
}

__attribute__((target("avx2"))) static void cast_avx2(const float *src, uint16_t *dst,
                                                       size_t n, int stream)
{
    size_t i = stream ? to_boundary(src, dst, n) : 0;
    for (; i + 16 <= n; i += 16) {
        const __m256i a = round8(_mm256_loadu_si256((const __m256i *)(src + i)));
        const __m256i b = round8(_mm256_loadu_si256((const __m256i *)(src + i + 8)));
        const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(a, b), 0xD8);
        if (stream) {
            _mm256_stream_si256((__m256i *)(dst + i), packed);
        } else {
            _mm256_storeu_si256((__m256i *)(dst + i), packed);
        }
    }
    if (stream) {
        _mm_sfence();
    }
    for (; i < n; i++) {
        dst[i] = one_bf16(src + i);
    }
}

__attribute__((target("avx512f,avx512bw"))) static void cast_avx512(const float *src,
                                                                     uint16_t *dst, size_t n,
                                                                     int stream)
{
    const __m512i bias = _mm512_set1_epi32(0x7FFF), one = _mm512_set1_epi32(1);
    const __m512i qnan = _mm512_set1_epi32(0xFFFF);
    size_t i = stream ? to_boundary(src, dst, n) : 0;
    for (; i + 16 <= n; i += 16) {
        const __m512i a = _mm512_loadu_si512((const void *)(src + i));
        const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(a, 16), one);
        __m512i r = _mm512_srli_epi32(_mm512_add_epi32(a, _mm512_add_epi32(bias, lsb)), 16);
        const __m512 f = _mm512_castsi512_ps(a);
        r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(f, f, _CMP_UNORD_Q), qnan);
        const __m256i packed = _mm512_cvtepi32_epi16(r);
        if (stream) {
            _mm256_stream_si256((__m256i *)(dst + i), packed);
        } else {
            _mm256_storeu_si256((__m256i *)(dst + i), packed);
        }
    }
    if (stream) {
        _mm_sfence();
    }
    for (; i < n; i++) {
        dst[i] = one_bf16(src + i);
    }
}

typedef void (*cast_fn)(const float *, uint16_t *, size_t, int);
static const cast_fn casts[ISA_COUNT] = {cast_scalar, cast_avx2, cast_avx512};

/* The span functions zs_run_plan calls: one per (isa, stream); `at` and `n` in values. */
#define SPAN(isa, stream)                                                                  \
    static void span_##isa##_##stream(uint64_t dst, uint64_t src, uint64_t at, uint64_t n) \
    {                                                                                      \
        casts[isa]((const float *)(uintptr_t)src + at, (uint16_t *)(uintptr_t)dst + at,   \
                   (size_t)n, stream);                                                     \
    }
SPAN(ISA_SCALAR, 0)
SPAN(ISA_SCALAR, 1)
SPAN(ISA_AVX2, 0)
SPAN(ISA_AVX2, 1)
SPAN(ISA_AVX512, 0)
SPAN(ISA_AVX512, 1)
static const zs_span_fn spans[ISA_COUNT][2] = {
    {span_ISA_SCALAR_0, span_ISA_SCALAR_1},
    {span_ISA_AVX2_0, span_ISA_AVX2_1},
    {span_ISA_AVX512_0, span_ISA_AVX512_1},
};

static int runs(int isa)
{
    __builtin_cpu_init();
    switch (isa) {
    case ISA_AVX512:
        return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");
    case ISA_AVX2:
        return __builtin_cpu_supports("avx2");
    default:
        return 1;
    }
}

static int best_isa(void)
{
    static int best = -1; /* what this CPU has does not change; racing writers agree */
    if (best < 0) {
        best = runs(ISA_AVX512) ? ISA_AVX512 : runs(ISA_AVX2) ? ISA_AVX2 : ISA_SCALAR;
    }
    return best;
}

const char zs_cast_isas_doc[] =
    "cast_isas()\n--\n\n"
    "The instruction sets cast_bf16 can run on this CPU, best first; cast_bf16 takes the\n"
    "first unless told otherwise.";

PyObject *zs_cast_isas(PyObject *self, PyObject *unused)
{
    (void)self;
    (void)unused;
    PyObject *names = PyList_New(0);
    for (int isa = ISA_COUNT - 1; names != NULL && isa >= 0; isa--) {
        if (!runs(isa)) {
            continue;
        }
        PyObject *name = PyUnicode_FromString(isa_names[isa]);
        if (name == NULL || PyList_Append(names, name) < 0) {
            Py_XDECREF(name);
            Py_DECREF(names);
            return NULL;
        }
        Py_DECREF(name);
    }
    if (names == NULL) {
        return NULL;
    }
    PyObject *out = PyList_AsTuple(names);
    Py_DECREF(names);
    return out;
}

const char zs_cast_bf16_doc[] =
    "cast_bf16(plan, threads=1, stream=False, isa=None, /)\n--\n\n"
    "Cast float32 values to bf16 as `plan` says: a buffer of native uint64 triples\n"
    "(destination address, source address, number of values), bit for bit as torch's\n"
    "CPU cast. With `threads` > 1 the values are shared out in pieces among this thread\n"
    "and threads - 1 helpers started for the call. `stream`: non-temporal stores (for\n"
    "plans much bigger than the caches). `isa`: 'avx512', 'avx2' or 'scalar' instead of\n"
    "the best this CPU runs (cast_isas). The caller vouches for every address and that no\n"
    "two ranges overlap. Runs without the GIL.";

static int isa_of(PyObject *name)
{
    if (name == Py_None) {
        return best_isa();
    }
    for (int isa = 0; isa < ISA_COUNT; isa++) {
        if (PyUnicode_Check(name) && PyUnicode_CompareWithASCIIString(name, isa_names[isa]) == 0) {
            if (!runs(isa)) {
                PyErr_Format(PyExc_ValueError, "cast_bf16: this CPU does not run %s", isa_names[isa]);
                return -1;
            }
            return isa;
        }
    }
    PyErr_Format(PyExc_ValueError, "cast_bf16: isa must be 'avx512', 'avx2', 'scalar' or None, not %R",
                 name);
    return -1;
}

PyObject *zs_cast_bf16(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *plan, *name = Py_None;
    int threads = 1, stream = 0;
    if (!PyArg_ParseTuple(args, "O|ipO:cast_bf16", &plan, &threads, &stream, &name)) {
        return NULL;
    }
    const int isa = isa_of(name);
    if (isa < 0) {
        return NULL;
    }
    Py_buffer view;
    size_t triples;
    if (zs_plan_view(plan, threads, "cast_bf16", &view, &triples) < 0) {
        return NULL;
    }
    const char *words = (const char *)view.buf;
    const zs_span_fn span = spans[isa][stream ? 1 : 0];
    Py_BEGIN_ALLOW_THREADS
    zs_run_plan(words, triples, threads, span, CAST_CHUNK);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&view);
    Py_RETURN_NONE;
}
