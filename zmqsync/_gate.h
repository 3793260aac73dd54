/* zmqsync._native.Gate: threads waiting for a version, on a futex (see _gate.c). */
#ifndef ZMQSYNC_GATE_H
#define ZMQSYNC_GATE_H
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

/* --- the gate: a thread waiting for a version, woken without Python ------------------ */

/* A thread in `wait_for_version` used to sleep on the Subscriber's Condition: its wake-up
 * took the agent back into Python for a notify_all, and the woken thread's way through
 * Condition.wait and back cost it ~40 us of CPU per version, on a host where every
 * worker pays it before the last ACK is in. A Gate is one word the waiters sleep on with
 * a futex, without the GIL; whoever applied a version opens it. */
typedef struct {
    PyObject_HEAD
    int64_t version;  /* the version applied last (atomic) */
    uint32_t turn;    /* bumped by every open() that finds sleepers: the futex word */
    int32_t sleepers; /* threads in wait() (atomic) */
    uint32_t kicks;   /* bumped by kick(): a waiter returns to look again (atomic) */
} Gate;

static inline void gate_open(Gate *gate, int64_t version)
{
    __atomic_store_n(&gate->version, version, __ATOMIC_SEQ_CST);
    if (__atomic_load_n(&gate->sleepers, __ATOMIC_SEQ_CST) > 0) {
        __atomic_add_fetch(&gate->turn, 1, __ATOMIC_SEQ_CST);
        syscall(SYS_futex, &gate->turn, FUTEX_WAKE_PRIVATE, INT32_MAX, NULL, NULL, 0);
    }
}

extern PyTypeObject GateType;
int zs_add_gate(PyObject *module);

#endif
