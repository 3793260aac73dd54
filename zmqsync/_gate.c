/* zmqsync._native.Gate: a thread in `Subscriber.wait_for_version` sleeps on a futex; the
 * follower that applied a version (the native one without the GIL) opens it.
 */
#include "_gate.h"

#include <time.h>

static PyObject *gate_open_py(Gate *self, PyObject *arg)
{
    long long version = PyLong_AsLongLong(arg);
    if (version == -1 && PyErr_Occurred()) {
        return NULL;
    }
    gate_open(self, version);
    Py_RETURN_NONE;
}

static PyObject *gate_wait(Gate *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "wait(version, timeout)");
        return NULL;
    }
    int overflow = 0; /* a version past every int64 is never reached: wait it out */
    long long want = PyLong_AsLongLongAndOverflow(args[0], &overflow);
    double timeout = args[1] == Py_None ? -1.0 : PyFloat_AsDouble(args[1]);
    if (PyErr_Occurred()) {
        return NULL;
    }
    if (overflow) {
        want = overflow > 0 ? INT64_MAX : INT64_MIN;
    }
    int reached = 0;
    Py_BEGIN_ALLOW_THREADS
    struct timespec start, now;
    clock_gettime(CLOCK_MONOTONIC, &start);
    uint32_t kicks = __atomic_load_n(&self->kicks, __ATOMIC_SEQ_CST);
    __atomic_add_fetch(&self->sleepers, 1, __ATOMIC_SEQ_CST);
    for (;;) {
        uint32_t turn = __atomic_load_n(&self->turn, __ATOMIC_SEQ_CST);
        if (__atomic_load_n(&self->version, __ATOMIC_SEQ_CST) >= want) {
            reached = 1;
            break;
        }
        if (__atomic_load_n(&self->kicks, __ATOMIC_SEQ_CST) != kicks) {
            break;
        }
        struct timespec wait, *until = NULL;
        if (timeout >= 0) {
            clock_gettime(CLOCK_MONOTONIC, &now);
            double left = timeout - ((double)(now.tv_sec - start.tv_sec)
                                     + (double)(now.tv_nsec - start.tv_nsec) * 1e-9);
            if (left <= 0) {
                break;
            }
            wait.tv_sec = (time_t)left;
            wait.tv_nsec = (long)((left - (double)wait.tv_sec) * 1e9);
            until = &wait;
        }
        syscall(SYS_futex, &self->turn, FUTEX_WAIT_PRIVATE, turn, until, NULL, 0);
    }
    __atomic_sub_fetch(&self->sleepers, 1, __ATOMIC_SEQ_CST);
    Py_END_ALLOW_THREADS
    return PyBool_FromLong(reached);
}

static PyObject *gate_kick(Gate *self, PyObject *unused)
{
    __atomic_add_fetch(&self->kicks, 1, __ATOMIC_SEQ_CST);
    __atomic_add_fetch(&self->turn, 1, __ATOMIC_SEQ_CST);
    syscall(SYS_futex, &self->turn, FUTEX_WAKE_PRIVATE, INT32_MAX, NULL, NULL, 0);
    Py_RETURN_NONE;
}

static PyObject *gate_version(Gate *self, PyObject *unused)
{
    return PyLong_FromLongLong(__atomic_load_n(&self->version, __ATOMIC_SEQ_CST));
}

static int gate_init(Gate *self, PyObject *args, PyObject *kwds)
{
    long long version = -1;
    static char *kw[] = {"version", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|L:Gate", kw, &version)) {
        return -1;
    }
    self->version = version;
    return 0;
}

static PyMethodDef gate_methods[] = {
    {"open", (PyCFunction)gate_open_py, METH_O,
     "open(version, /)\n--\n\n`version` is applied: wake the threads waiting."},
    {"wait", (PyCFunction)(void (*)(void))gate_wait, METH_FASTCALL,
     "wait(version, timeout, /)\n--\n\nSleep without the GIL until a version >= `version`"
     " is opened, `timeout` seconds pass (None: no limit) or a kick(); whether it was"
     " opened."},
    {"kick", (PyCFunction)gate_kick, METH_NOARGS,
     "kick()\n--\n\nWake every thread waiting, to look at something else (a close)."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef gate_getset[] = {
    {"version", (getter)gate_version, NULL, "the version opened last", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

PyTypeObject GateType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "zmqsync._native.Gate",
    .tp_basicsize = sizeof(Gate),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Gate(version=-1)\n--\n\nThreads waiting for a version, on a futex.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)gate_init,
    .tp_methods = gate_methods,
    .tp_getset = gate_getset,
};

int zs_add_gate(PyObject *module)
{
    if (PyType_Ready(&GateType) < 0) {
        return -1;
    }
    return PyModule_AddObjectRef(module, "Gate", (PyObject *)&GateType);
}
