/* A plan of (destination, source, unit count) uint64 triples, run on one thread or shared
 * among a few (_native.c): what the byte copies and the bf16 casts (_cast.c) both walk. */
#ifndef ZMQSYNC_PLAN_H
#define ZMQSYNC_PLAN_H

#include <stddef.h>
#include <stdint.h>

#define ZS_MAX_THREADS 64

/* Do units [at, at + n) of one triple whose destination and source start at dst, src. */
typedef void (*zs_span_fn)(uint64_t dst, uint64_t src, uint64_t at, uint64_t n);

/* Run every triple of the plan (`triples` of them at `words`, any alignment) through
 * `span`; with threads > 1 and more than `chunk` units, pieces of `chunk` units are
 * shared among this thread and threads - 1 helpers started for the call. Call without
 * the GIL; returns when every unit is done. */
void zs_run_plan(const char *words, size_t triples, int threads, zs_span_fn span,
                 uint64_t chunk);

/* The checks every caller of a plan makes on its Python arguments (`who` names it in
 * the errors): threads in [1, ZS_MAX_THREADS], `plan` a buffer of whole uint64 triples.
 * On success `view` holds the buffer (release it) and `*triples` their count; on failure
 * a Python error is set and -1 returned (nothing to release). Needs Python.h first. */
int zs_plan_view(PyObject *plan, int threads, const char *who, Py_buffer *view,
                 size_t *triples);

#endif
