/* zmqsync._native: copy many byte ranges in one call, on one thread or a few (the
 * worker's per-version path, Follower, is in _follower.c; the publisher's bf16 casts,
 * which run their plans on the same threads, in _cast.c).
 *
 * A version of a model with thousands of tensors is thousands of small copies. Done one
 * by one from Python (a memoryview assignment each), the interpreter's ~130 ns per copy
 * costs more than the bytes: a worker spent 1.6 ms of CPU per version of a 2,000-tensor
 * 4 MB model, 1.1 ms with this loop. The plan is built once per slot; this only walks it.
 *
 * A big plan can be shared with helper threads started for the call. They take 512 KiB
 * chunks from a counter, so a helper the scheduler does not run (the other cores busy)
 * costs nothing but its start: the calling thread takes the chunks it left. Nothing
 * spins: with another process keeping the other core busy, a 64 MiB copy took 7.2 ms
 * here, 7.4 ms on one thread and 9.6 ms by torch's copy_, whose OpenMP threads wait
 * for each other. Starting the helpers costs ~45 us, hence only for big plans.
 * The call returns once every chunk is copied; a helper that is still on its way out
 * touches only the job record, which the last one out frees.
 *
 * Optional: when it is not built (no compiler), zmqsync copies from Python instead.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <immintrin.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "_plan.h"

#define CHUNK_BYTES ((uint64_t)512 * 1024)

typedef struct {
    const char *words; /* the plan: (destination, source, unit count) uint64 triples */
    size_t triples;
    zs_span_fn span;   /* what one piece of a triple takes */
    uint64_t chunk;    /* units per chunk */
    uint64_t *ends;    /* units of the plan up to the end of each triple */
    uint64_t total;    /* units in the plan */
    size_t chunks;     /* `chunk`-unit pieces of the plan, in plan order */
    size_t next;       /* the next chunk to take (atomic) */
    size_t done;       /* chunks copied (under mu) */
    int refs;          /* threads still using this record (under mu) */
    pthread_mutex_t mu;
    pthread_cond_t all_done;
} Job;

static void triple_at(const char *words, size_t i, uint64_t triple[3])
{
    memcpy(triple, words + i * 3 * sizeof(uint64_t), 3 * sizeof(uint64_t)); /* any alignment */
}

/* Run every triple of the plan, whole, in order. */
static void run_all(const char *words, size_t triples, zs_span_fn span)
{
    for (size_t i = 0; i < triples; i++) {
        uint64_t t[3];
        triple_at(words, i, t);
        span(t[0], t[1], 0, t[2]);
    }
}

static void copy_bytes(uint64_t dst, uint64_t src, uint64_t at, uint64_t n)
{
    memmove((char *)(uintptr_t)dst + at, (const char *)(uintptr_t)src + at, (size_t)n);
}

/* The same with non-temporal stores: past the caches, without reading the destination
 * first, as glibc's memcpy writes one copy past its threshold (181.5 MiB here), which a
 * 512 KiB piece never is. AVX2 when the CPU has it (asked at run time), else memmove. */
__attribute__((target("avx2"))) static void stream_avx2(char *d, const char *s, size_t n)
{
    size_t i = (32 - ((uintptr_t)d & 31)) & 31; /* to the destination's 32-byte boundary */
    if (i > n) {
        i = n;
    }
    memmove(d, s, i);
    for (; i + 128 <= n; i += 128) {
        const __m256i a = _mm256_loadu_si256((const __m256i *)(s + i));
        const __m256i b = _mm256_loadu_si256((const __m256i *)(s + i + 32));
        const __m256i c = _mm256_loadu_si256((const __m256i *)(s + i + 64));
        const __m256i e = _mm256_loadu_si256((const __m256i *)(s + i + 96));
        _mm256_stream_si256((__m256i *)(d + i), a);
        _mm256_stream_si256((__m256i *)(d + i + 32), b);
        _mm256_stream_si256((__m256i *)(d + i + 64), c);
        _mm256_stream_si256((__m256i *)(d + i + 96), e);
    }
    memmove(d + i, s + i, n - i);
    _mm_sfence(); /* the streamed bytes are ordered before what follows */
}

static int has_avx2(void)
{
    static int avx2 = -1; /* what this CPU has does not change; racing writers agree */
    if (avx2 < 0) {
        __builtin_cpu_init();
        avx2 = __builtin_cpu_supports("avx2") ? 1 : 0;
    }
    return avx2;
}

static void stream_bytes(uint64_t dst, uint64_t src, uint64_t at, uint64_t n)
{
    char *d = (char *)(uintptr_t)dst + at;
    const char *s = (const char *)(uintptr_t)src + at;
    if (has_avx2()) {
        stream_avx2(d, s, (size_t)n);
    } else {
        memmove(d, s, (size_t)n);
    }
}

/* Run the plan's units [lo, hi), counted along the plan in order. A binary search finds
 * the first triple: a plan of many small tensors is walked once per piece otherwise. */
static void run_span(const Job *job, uint64_t lo, uint64_t hi)
{
    size_t first = 0, last = job->triples;
    while (first < last) { /* the first triple that ends after lo */
        const size_t mid = first + (last - first) / 2;
        if (job->ends[mid] <= lo) {
            first = mid + 1;
        } else {
            last = mid;
        }
    }
    for (size_t i = first; i < job->triples; i++) {
        uint64_t t[3];
        triple_at(job->words, i, t);
        const uint64_t end = job->ends[i], start = end - t[2];
        if (start >= hi) {
            return;
        }
        const uint64_t from = start > lo ? start : lo, to = end < hi ? end : hi;
        job->span(t[0], t[1], from - start, to - from);
    }
}

static void take_chunks(Job *job)
{
    for (;;) {
        const size_t k = __atomic_fetch_add(&job->next, 1, __ATOMIC_RELAXED);
        if (k >= job->chunks) {
            return;
        }
        const uint64_t lo = (uint64_t)k * job->chunk;
        const uint64_t hi = lo + job->chunk < job->total ? lo + job->chunk : job->total;
        run_span(job, lo, hi);
        pthread_mutex_lock(&job->mu); /* also orders the bytes before the caller's return */
        if (++job->done == job->chunks) {
            pthread_cond_signal(&job->all_done);
        }
        pthread_mutex_unlock(&job->mu);
    }
}

static void release(Job *job)
{
    pthread_mutex_lock(&job->mu);
    const int left = --job->refs;
    pthread_mutex_unlock(&job->mu);
    if (left == 0) {
        pthread_cond_destroy(&job->all_done);
        pthread_mutex_destroy(&job->mu);
        free(job->ends);
        free(job);
    }
}

static void *helper(void *arg)
{
    take_chunks((Job *)arg);
    release((Job *)arg);
    return NULL;
}

/* Run the plan on `threads` threads (this one and threads - 1 helpers); a plan of one
 * chunk or less on this thread alone. */
int zs_plan_view(PyObject *plan, int threads, const char *who, Py_buffer *view,
                 size_t *triples) {
    if (threads < 1 || threads > ZS_MAX_THREADS) {
        PyErr_Format(PyExc_ValueError, "%s: threads must be 1 to %d, not %d", who,
                     ZS_MAX_THREADS, threads);
        return -1;
    }
    if (PyObject_GetBuffer(plan, view, PyBUF_SIMPLE) < 0) {
        return -1;
    }
    if (view->len % (3 * (Py_ssize_t)sizeof(uint64_t)) != 0) {
        PyBuffer_Release(view);
        PyErr_Format(PyExc_ValueError, "%s: the plan must hold whole uint64 triples", who);
        return -1;
    }
    *triples = (size_t)view->len / (3 * sizeof(uint64_t));
    return 0;
}

void zs_run_plan(const char *words, size_t triples, int threads, zs_span_fn span,
                 uint64_t chunk)
{
    if (threads <= 1) {
        run_all(words, triples, span);
        return;
    }
    uint64_t *ends = triples ? malloc(triples * sizeof(uint64_t)) : NULL;
    uint64_t total = 0;
    for (size_t i = 0; ends != NULL && i < triples; i++) {
        uint64_t t[3];
        triple_at(words, i, t);
        total += t[2];
        ends[i] = total;
    }
    Job *job = total > chunk ? calloc(1, sizeof(Job)) : NULL;
    if (job == NULL || pthread_mutex_init(&job->mu, NULL) != 0) {
        free(ends); /* too small to share, or no memory for the shared record */
        free(job);
        run_all(words, triples, span);
        return;
    }
    job->ends = ends;
    job->span = span;
    job->chunk = chunk;
    pthread_cond_init(&job->all_done, NULL);
    job->words = words;
    job->triples = triples;
    job->total = total;
    job->chunks = (size_t)((total + chunk - 1) / chunk);
    job->refs = 1;
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    for (int i = 1; i < threads; i++) {
        pthread_t thread;
        pthread_mutex_lock(&job->mu);
        job->refs++;
        pthread_mutex_unlock(&job->mu);
        if (pthread_create(&thread, &attr, helper, job) != 0) {
            release(job); /* no helper: this thread takes its chunks */
            break;
        }
    }
    pthread_attr_destroy(&attr);
    take_chunks(job);
    pthread_mutex_lock(&job->mu);
    while (job->done < job->chunks) {
        pthread_cond_wait(&job->all_done, &job->mu);
    }
    pthread_mutex_unlock(&job->mu);
    release(job);
}

PyDoc_STRVAR(copy_many_doc,
"copy_many(plan, threads=1, stream=False, /)\n--\n\n"
"Copy bytes as `plan` says: a buffer of native uint64 triples (destination address,\n"
"source address, byte count). With `threads` > 1 the bytes are shared out in 512 KiB\n"
"chunks among this thread and threads - 1 helpers started for the call. The caller\n"
"vouches for every address (they come from tensors it checked) and that no two ranges\n"
"overlap. `stream`: write with non-temporal stores (AVX2, if the CPU has it), for a\n"
"plan far bigger than the caches. Runs without the GIL; returns when every byte is\n"
"copied.");

static PyObject *copy_many(PyObject *self, PyObject *args)
{
    PyObject *plan;
    int threads = 1, stream = 0;
    if (!PyArg_ParseTuple(args, "O|ip:copy_many", &plan, &threads, &stream)) {
        return NULL;
    }
    Py_buffer view;
    size_t triples;
    if (zs_plan_view(plan, threads, "copy_many", &view, &triples) < 0) {
        return NULL;
    }
    const char *words = (const char *)view.buf;
    Py_BEGIN_ALLOW_THREADS
    zs_run_plan(words, triples, threads, stream ? stream_bytes : copy_bytes, CHUNK_BYTES);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&view);
    Py_RETURN_NONE;
}

/* _follower.c: a worker's per-version path; _gate.c: its waiters; _ack_reader.c: the
 * publisher's ACKs */
PyObject *zs_match_receive(PyObject *self, PyObject *args);
PyObject *zs_pack_int(PyObject *self, PyObject *arg);
extern const char zs_match_receive_doc[], zs_pack_int_doc[];
int zs_add_follower(PyObject *module);
int zs_add_gate(PyObject *module);
int zs_add_ack_reader(PyObject *module);
/* _cast.c: the publisher's float32 -> bf16 casts */
PyObject *zs_cast_bf16(PyObject *self, PyObject *args);
PyObject *zs_cast_isas(PyObject *self, PyObject *unused);
extern const char zs_cast_bf16_doc[], zs_cast_isas_doc[];

static PyMethodDef methods[] = {
    {"copy_many", copy_many, METH_VARARGS, copy_many_doc},
    {"cast_bf16", zs_cast_bf16, METH_VARARGS, zs_cast_bf16_doc},
    {"cast_isas", zs_cast_isas, METH_NOARGS, zs_cast_isas_doc},
    {"match_receive", zs_match_receive, METH_VARARGS, zs_match_receive_doc},
    {"pack_int", zs_pack_int, METH_O, zs_pack_int_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "zmqsync._native",
    "Copy many byte ranges in one call; a worker's per-version path (Follower).", -1, methods,
};

PyMODINIT_FUNC PyInit__native(void)
{
    PyObject *m = PyModule_Create(&module);
    if (m != NULL
        && (zs_add_gate(m) < 0 || zs_add_follower(m) < 0 || zs_add_ack_reader(m) < 0)) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
