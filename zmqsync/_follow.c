/* zmqsync._native.Follower: a worker's per-version path, from RECEIVE to ACK, in C (and
 * its waiters' Gate, and the publisher's AckReader, below).
 *
 * Alias mode on the CPU, background apply: a version is one RECEIVE read, one seqlock
 * check, one storage pointer swap and one ACK sent. Written in Python, those steps cost
 * a worker ~45 us of CPU per version on a machine where every worker's thread comes to
 * its version with cold caches, more than the raw ZeroMQ round trip they sit in; the
 * sum over the workers on the cores is what a publish waits for.
 *
 * Follower.next() blocks in zmq_msg_recv on the events socket without the GIL, and
 * handles every frame that is the next RECEIVE of the bus, written as the publisher's
 * template writes it, for a version the slot's seqlock says is whole. Everything else
 * goes back to Python unread (the frame's bytes): another message, a gap, a slot that
 * is being rewritten, a slot whose storage is not built yet. So the frames this takes
 * are a subset of what `read_receive` takes, with the same values, and what it does
 * with one is what `Link.on_receive` and `Subscriber._apply_offer` would do, on the
 * same Python objects (the `_Switch`, the subscriber's applied state, the Link's
 * sequence), under the same lock: there is no second copy of any state here.
 *
 * libzmq's functions are looked up in the library pyzmq has loaded (its path is given),
 * and its sockets are used through their addresses (pyzmq's `Socket.underlying`): the
 * events and acks sockets belong to the agent thread, the only caller of next().
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <dlfcn.h>
#include <errno.h>
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

typedef struct {
    unsigned char bytes[64];
} __attribute__((aligned(8))) zmq_msg;

typedef int (*msg_init_fn)(zmq_msg *);
typedef int (*msg_recv_fn)(zmq_msg *, void *, int);
typedef void *(*msg_data_fn)(zmq_msg *);
typedef size_t (*msg_size_fn)(const zmq_msg *);
typedef int (*msg_close_fn)(zmq_msg *);
typedef int (*send_fn)(void *, const void *, size_t, int);
typedef int (*errno_fn)(void);
typedef int (*msg_more_fn)(const zmq_msg *);

/* the libzmq functions used here, from the library pyzmq loaded */
typedef struct {
    msg_init_fn msg_init;
    msg_recv_fn msg_recv;
    msg_data_fn msg_data;
    msg_size_fn msg_size;
    msg_close_fn msg_close;
    msg_more_fn msg_more;
    send_fn send;
    errno_fn errno_;
} Zmq;

#define ZMQ_DONTWAIT 1
#define FIRST_SLOT_WORD 8 /* the header's layout: zmqsync/_buffers/header.py */
#define MAX_SLOTS ((4096 / 8 - FIRST_SLOT_WORD) / 2)
#define PIECES 5 /* a RECEIVE: head, seq, piece, version, piece, slot, piece, changed, tail */
#define ACK_MAX 1024

/* --- msgpack, only the forms a RECEIVE's and an ACK's variable fields take ---------- */

static int read_int(const unsigned char **at, const unsigned char *end, int64_t *out)
{
    const unsigned char *p = *at;
    if (p >= end) {
        return 0;
    }
    unsigned char tag = *p++;
    uint64_t u = 0;
    int n = 0;
    int is_signed = 0;
    if (tag <= 0x7f) {
        *out = tag;
        *at = p;
        return 1;
    }
    if (tag >= 0xe0) {
        *out = (int8_t)tag;
        *at = p;
        return 1;
    }
    switch (tag) {
    case 0xcc: n = 1; break;
    case 0xcd: n = 2; break;
    case 0xce: n = 4; break;
    case 0xcf: n = 8; break;
    case 0xd0: n = 1; is_signed = 1; break;
    case 0xd1: n = 2; is_signed = 1; break;
    case 0xd2: n = 4; is_signed = 1; break;
    case 0xd3: n = 8; is_signed = 1; break;
    default: return 0;
    }
    if (end - p < n) {
        return 0;
    }
    for (int i = 0; i < n; i++) {
        u = u << 8 | p[i];
    }
    if (is_signed) {
        int shift = 64 - 8 * n;
        *out = shift ? (int64_t)(u << shift) >> shift : (int64_t)u;
    } else {
        if (u > (uint64_t)INT64_MAX) {
            return 0; /* past every range the protocol allows */
        }
        *out = (int64_t)u;
    }
    *at = p + n;
    return 1;
}

static int read_bin(const unsigned char **at, const unsigned char *end, Py_ssize_t *len)
{
    const unsigned char *p = *at;
    if (p >= end) {
        return 0;
    }
    unsigned char tag = *p++;
    int n = tag == 0xc4 ? 1 : tag == 0xc5 ? 2 : tag == 0xc6 ? 4 : 0;
    if (!n || end - p < n) {
        return 0;
    }
    uint64_t size = 0;
    for (int i = 0; i < n; i++) {
        size = size << 8 | p[i];
    }
    p += n;
    if ((uint64_t)(end - p) < size) {
        return 0;
    }
    *len = (Py_ssize_t)size;
    *at = p + size;
    return 1;
}

/* a msgpack str, decoded as msgpack's unpackb(raw=False) does (strict UTF-8); NULL
 * without an error set when `at` holds none, NULL with one when it failed */
static PyObject *read_str(const unsigned char **at, const unsigned char *end)
{
    const unsigned char *p = *at;
    if (p >= end) {
        return NULL;
    }
    unsigned char tag = *p++;
    uint64_t size = 0;
    int n = 0;
    if (tag >= 0xa0 && tag <= 0xbf) {
        size = tag & 0x1f;
    } else {
        n = tag == 0xd9 ? 1 : tag == 0xda ? 2 : tag == 0xdb ? 4 : -1;
        if (n < 0 || end - p < n) {
            return NULL;
        }
        for (int i = 0; i < n; i++) {
            size = size << 8 | p[i];
        }
        p += n;
    }
    if ((uint64_t)(end - p) < size) {
        return NULL;
    }
    PyObject *out = PyUnicode_DecodeUTF8((const char *)p, (Py_ssize_t)size, NULL);
    if (out == NULL && PyErr_ExceptionMatches(PyExc_UnicodeDecodeError)) {
        PyErr_Clear(); /* not valid text: not an ACK we read here */
    }
    *at = p + size;
    return out;
}

static Py_ssize_t pack_int(int64_t v, unsigned char *out)
{
    /* as msgpack's Packer writes an int: the shortest form */
    uint64_t u = (uint64_t)v;
    int n;
    if (v >= 0) {
        if (v <= 0x7f) {
            out[0] = (unsigned char)v;
            return 1;
        }
        if (u <= 0xff) { out[0] = 0xcc; n = 1; }
        else if (u <= 0xffff) { out[0] = 0xcd; n = 2; }
        else if (u <= 0xffffffffu) { out[0] = 0xce; n = 4; }
        else { out[0] = 0xcf; n = 8; }
    } else {
        if (v >= -32) {
            out[0] = (unsigned char)(int8_t)v;
            return 1;
        }
        if (v >= INT8_MIN) { out[0] = 0xd0; n = 1; }
        else if (v >= INT16_MIN) { out[0] = 0xd1; n = 2; }
        else if (v >= INT32_MIN) { out[0] = 0xd2; n = 4; }
        else { out[0] = 0xd3; n = 8; }
    }
    for (int i = 0; i < n; i++) {
        out[1 + i] = (unsigned char)(u >> (8 * (n - 1 - i)));
    }
    return 1 + n;
}

/* The pattern of a RECEIVE of one bus: its fixed pieces and the ranges of its fields. */
typedef struct {
    PyObject *pieces; /* tuple of PIECES bytes */
    int64_t lo[3], hi[3]; /* seq, version, slot */
    Py_ssize_t changed_max;
} Pattern;

static int pattern_from(PyObject *pieces, PyObject *ranges, Pattern *out)
{
    if (!PyTuple_Check(pieces) || PyTuple_GET_SIZE(pieces) != PIECES) {
        PyErr_SetString(PyExc_ValueError, "a RECEIVE pattern has 5 pieces");
        return 0;
    }
    for (Py_ssize_t i = 0; i < PIECES; i++) {
        if (!PyBytes_Check(PyTuple_GET_ITEM(pieces, i))) {
            PyErr_SetString(PyExc_TypeError, "a RECEIVE pattern's pieces are bytes");
            return 0;
        }
    }
    long long v[7];
    if (!PyArg_ParseTuple(ranges, "LLLLLLL", &v[0], &v[1], &v[2], &v[3], &v[4], &v[5], &v[6])) {
        return 0;
    }
    for (int i = 0; i < 3; i++) {
        out->lo[i] = v[2 * i];
        out->hi[i] = v[2 * i + 1];
    }
    out->changed_max = (Py_ssize_t)v[6];
    Py_INCREF(pieces);
    out->pieces = pieces;
    return 1;
}

static int expect(const unsigned char **at, const unsigned char *end, PyObject *piece)
{
    Py_ssize_t n = PyBytes_GET_SIZE(piece);
    if (end - *at < n || memcmp(*at, PyBytes_AS_STRING(piece), (size_t)n) != 0) {
        return 0;
    }
    *at += n;
    return 1;
}

/* seq, version, slot of `data` if it is a RECEIVE written as `pattern` says (else 0) */
static int match(const Pattern *pattern, const unsigned char *data, size_t size, int64_t f[3])
{
    const unsigned char *at = data, *end = data + size;
    PyObject *pieces = pattern->pieces;
    Py_ssize_t changed;
    for (int i = 0; i < 3; i++) {
        if (!expect(&at, end, PyTuple_GET_ITEM(pieces, i)) || !read_int(&at, end, &f[i])
            || f[i] < pattern->lo[i] || f[i] > pattern->hi[i]) {
            return 0;
        }
    }
    return expect(&at, end, PyTuple_GET_ITEM(pieces, 3)) && read_bin(&at, end, &changed)
        && changed <= pattern->changed_max && expect(&at, end, PyTuple_GET_ITEM(pieces, 4))
        && at == end;
}

const char zs_match_receive_doc[] =
"match_receive(pieces, ranges, frame, /)\n--\n\n"
"(seq, version, slot) of `frame` if it is a RECEIVE made of `pieces` (head, then the\n"
"bytes after seq, version and slot, then after changed) with fields in `ranges`\n"
"(seq lo, hi, version lo, hi, slot lo, hi, changed max); else None. What Follower\n"
"matches frames with.";

PyObject *zs_match_receive(PyObject *self, PyObject *args)
{
    PyObject *pieces, *ranges;
    Py_buffer frame;
    if (!PyArg_ParseTuple(args, "OOy*:match_receive", &pieces, &ranges, &frame)) {
        return NULL;
    }
    Pattern pattern;
    int64_t f[3];
    PyObject *out = NULL;
    if (pattern_from(pieces, ranges, &pattern)) {
        if (match(&pattern, frame.buf, (size_t)frame.len, f)) {
            out = Py_BuildValue("(LLL)", (long long)f[0], (long long)f[1], (long long)f[2]);
        } else {
            out = Py_NewRef(Py_None);
        }
        Py_DECREF(pattern.pieces);
    }
    PyBuffer_Release(&frame);
    return out;
}

const char zs_pack_int_doc[] =
"pack_int(value, /)\n--\n\n"
"`value` as msgpack's Packer writes it (what Follower writes into an ACK).";

PyObject *zs_pack_int(PyObject *self, PyObject *arg)
{
    long long v = PyLong_AsLongLong(arg);
    if (v == -1 && PyErr_Occurred()) {
        return NULL;
    }
    unsigned char out[9];
    return PyBytes_FromStringAndSize((const char *)out, pack_int(v, out));
}

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

static void gate_open(Gate *gate, int64_t version)
{
    __atomic_store_n(&gate->version, version, __ATOMIC_SEQ_CST);
    if (__atomic_load_n(&gate->sleepers, __ATOMIC_SEQ_CST) > 0) {
        __atomic_add_fetch(&gate->turn, 1, __ATOMIC_SEQ_CST);
        syscall(SYS_futex, &gate->turn, FUTEX_WAKE_PRIVATE, INT32_MAX, NULL, NULL, 0);
    }
}

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

static PyTypeObject GateType = {
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

/* --- the follower -------------------------------------------------------------------- */

typedef struct {
    PyObject_HEAD
    Zmq zmq;
    void *events_sock, *acks_sock;
    PyObject *sockets; /* the pyzmq sockets, kept open while this uses them */
    /* the frames */
    Pattern pattern;
    PyObject *ack_head, *ack_tail; /* an ACK: head + version + tail */
    /* the buffers */
    const volatile uint64_t *words; /* the segment's header; mapped while `holders` live */
    int64_t slots;
    /* the state this updates, all owned by Python objects */
    PyObject *switch_; /* `_apply.Switch`: .model, .holders (list per slot), .at, .active */
    PyObject *holders;
    PyObject *swap;    /* torch's storage pointer swap (the switch's `swap`) */
    PyObject *owner;   /* a weak reference to the Subscriber */
    PyObject *lock;    /* its lock */
    PyObject *counters; /* its counters dict */
    PyObject *link;    /* its Link: .last_seq, .last_heard */
    Gate *gate;        /* the waiters': opened once a version's ACK is out */
    PyObject *error;   /* error(errno) -> the exception to raise */
} Follower;

static PyObject *s_model, *s_at, *s_active, *s_version, *s_held, *s_applied, *s_native, *s_last_seq,
    *s_last_heard, *s_swap, *s_acquire, *s_release;

static int intern_names(void)
{
#define NAME(var, text) if (!(var = PyUnicode_InternFromString(text))) return 0;
    NAME(s_model, "model") NAME(s_at, "at") NAME(s_active, "active") NAME(s_version, "_version")
    NAME(s_held, "_held") NAME(s_applied, "applied") NAME(s_native, "native")
    NAME(s_last_seq, "last_seq")
    NAME(s_last_heard, "last_heard") NAME(s_swap, "swap") NAME(s_acquire, "acquire")
    NAME(s_release, "release")
#undef NAME
    return 1;
}

static void *symbol(void *lib, const char *name)
{
    void *found = dlsym(lib, name);
    if (found == NULL) {
        PyErr_Format(PyExc_ImportError, "libzmq has no %s", name);
    }
    return found;
}

/* libzmq's functions from the library at `path`, which pyzmq has loaded (dlopen takes a
 * reference; pyzmq holds the library for the process's life anyway) */
static int load_zmq(const char *path, Zmq *out)
{
    void *lib = dlopen(path, RTLD_NOW | RTLD_NOLOAD);
    if (lib == NULL) {
        PyErr_Format(PyExc_ImportError, "libzmq is not loaded from %s", path);
        return 0;
    }
    return (out->msg_init = (msg_init_fn)symbol(lib, "zmq_msg_init"))
        && (out->msg_recv = (msg_recv_fn)symbol(lib, "zmq_msg_recv"))
        && (out->msg_data = (msg_data_fn)symbol(lib, "zmq_msg_data"))
        && (out->msg_size = (msg_size_fn)symbol(lib, "zmq_msg_size"))
        && (out->msg_close = (msg_close_fn)symbol(lib, "zmq_msg_close"))
        && (out->msg_more = (msg_more_fn)symbol(lib, "zmq_msg_more"))
        && (out->send = (send_fn)symbol(lib, "zmq_send"))
        && (out->errno_ = (errno_fn)symbol(lib, "zmq_errno"));
}

/* raise what `error(err)` returns: the exception pyzmq would raise */
static void raise_zmq(PyObject *error, int err)
{
    PyObject *exc = PyObject_CallFunction(error, "i", err);
    if (exc != NULL) {
        PyErr_SetObject((PyObject *)Py_TYPE(exc), exc);
        Py_DECREF(exc);
    }
}

static void *socket_address(PyObject *sock)
{
    PyObject *addr = PyObject_GetAttrString(sock, "underlying");
    if (addr == NULL) {
        return NULL;
    }
    void *out = PyLong_AsVoidPtr(addr);
    Py_DECREF(addr);
    if (out == NULL && !PyErr_Occurred()) {
        PyErr_SetString(PyExc_ValueError, "the socket is closed");
    }
    return out;
}

static int follower_init(Follower *self, PyObject *args, PyObject *kwds)
{
    static char *kw[] = {"libzmq", "events", "acks", "pieces", "ranges", "ack_head",
                         "ack_tail", "header", "slots", "switch", "owner", "lock",
                         "counters", "link", "gate", "error", NULL};
    const char *libzmq;
    PyObject *events, *acks, *pieces, *ranges, *ack_head, *ack_tail, *header;
    long long slots;
    PyObject *switch_, *owner, *lock, *counters, *link, *gate, *error;
    if (self->sockets != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "Follower is set up once");
        return -1;
    }
    if (!PyArg_ParseTupleAndKeywords(
            args, kwds, "sOOOOSSOLOOOO!OO!O:Follower", kw, &libzmq, &events, &acks,
            &pieces, &ranges, &ack_head, &ack_tail, &header, &slots, &switch_, &owner, &lock,
            &PyDict_Type, &counters, &link, &GateType, &gate, &error)) {
        return -1;
    }
    if (!PyWeakref_CheckRef(owner)) {
        PyErr_SetString(PyExc_TypeError, "owner: a weak reference");
        return -1;
    }
    if (slots < 1 || slots > MAX_SLOTS) { /* their seqlock words fit in the header page */
        PyErr_Format(PyExc_ValueError, "slots: 1 to %d", MAX_SLOTS);
        return -1;
    }
    if (PyBytes_GET_SIZE(ack_head) + PyBytes_GET_SIZE(ack_tail) + 9 > ACK_MAX) {
        PyErr_SetString(PyExc_ValueError, "an ACK this long is not one");
        return -1;
    }
    if (!load_zmq(libzmq, &self->zmq)) {
        return -1;
    }
    if (!(self->events_sock = socket_address(events)) || !(self->acks_sock = socket_address(acks))) {
        return -1;
    }
    void *words = PyLong_AsVoidPtr(header);
    if (words == NULL) {
        if (!PyErr_Occurred()) {
            PyErr_SetString(PyExc_ValueError, "header: the address of a mapped header");
        }
        return -1;
    }
    PyObject *holders = PyObject_GetAttrString(switch_, "holders");
    if (holders == NULL) {
        return -1;
    }
    PyObject *swap = PyObject_GetAttr(switch_, s_swap);
    if (swap == NULL || !PyCallable_Check(swap)) {
        Py_DECREF(holders);
        Py_XDECREF(swap);
        if (!PyErr_Occurred()) {
            PyErr_SetString(PyExc_TypeError, "switch.swap: torch's storage pointer swap");
        }
        return -1;
    }
    if (!PyList_CheckExact(holders) || PyList_GET_SIZE(holders) != slots) {
        Py_DECREF(holders);
        Py_DECREF(swap);
        PyErr_SetString(PyExc_ValueError, "switch.holders: a list with one entry per slot");
        return -1;
    }
    if (!pattern_from(pieces, ranges, &self->pattern)) {
        Py_DECREF(holders);
        Py_DECREF(swap);
        return -1;
    }
    self->words = (const volatile uint64_t *)words;
    self->slots = slots;
    self->holders = holders;
    self->sockets = PyTuple_Pack(2, events, acks);
    self->ack_head = Py_NewRef(ack_head);
    self->ack_tail = Py_NewRef(ack_tail);
    self->switch_ = Py_NewRef(switch_);
    self->swap = swap;
    self->owner = Py_NewRef(owner);
    self->lock = Py_NewRef(lock);
    self->counters = Py_NewRef(counters);
    self->link = Py_NewRef(link);
    self->gate = (Gate *)Py_NewRef(gate);
    self->error = Py_NewRef(error);
    return self->sockets == NULL ? -1 : 0;
}

static int follower_traverse(Follower *self, visitproc visit, void *arg)
{
    Py_VISIT(self->sockets);
    Py_VISIT(self->pattern.pieces);
    Py_VISIT(self->switch_);
    Py_VISIT(self->holders);
    Py_VISIT(self->swap);
    Py_VISIT(self->owner);
    Py_VISIT(self->lock);
    Py_VISIT(self->counters);
    Py_VISIT(self->link);
    Py_VISIT(self->gate);
    Py_VISIT(self->error);
    return 0;
}

static int follower_clear(Follower *self)
{
    Py_CLEAR(self->sockets);
    Py_CLEAR(self->pattern.pieces);
    Py_CLEAR(self->ack_head);
    Py_CLEAR(self->ack_tail);
    Py_CLEAR(self->switch_);
    Py_CLEAR(self->holders);
    Py_CLEAR(self->swap);
    Py_CLEAR(self->owner);
    Py_CLEAR(self->lock);
    Py_CLEAR(self->counters);
    Py_CLEAR(self->link);
    Py_CLEAR(self->gate);
    Py_CLEAR(self->error);
    return 0;
}

static void follower_dealloc(Follower *self)
{
    PyObject_GC_UnTrack(self);
    follower_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static double monotonic(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts); /* time.monotonic()'s clock on Linux */
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static int64_t int_attr(PyObject *obj, PyObject *name, int *ok)
{
    PyObject *value = PyObject_GetAttr(obj, name);
    if (value == NULL) {
        *ok = 0;
        return 0;
    }
    int overflow = 0; /* clamped: nobody waits for a version past them all (1 << 63) */
    long long out = PyLong_AsLongLongAndOverflow(value, &overflow);
    Py_DECREF(value);
    if (out == -1 && PyErr_Occurred()) {
        *ok = 0;
    }
    return overflow > 0 ? INT64_MAX : overflow < 0 ? INT64_MIN : out;
}

static int set_int(PyObject *obj, PyObject *name, int64_t value)
{
    PyObject *v = PyLong_FromLongLong(value);
    if (v == NULL) {
        return -1;
    }
    int rc = PyObject_SetAttr(obj, name, v);
    Py_DECREF(v);
    return rc;
}

/* Point the model at `slot` as `_Switch.point_at` does. 1: done, 0: Python must (the
 * slot's storage is not built, or the switch was retired), -1: an error is set. */
static int point_at(Follower *self, int64_t slot)
{
    int ok = 1;
    PyObject *active = PyObject_GetAttr(self->switch_, s_active);
    if (active == NULL) {
        return -1;
    }
    int live = active == Py_True;
    Py_DECREF(active);
    int64_t at = int_attr(self->switch_, s_at, &ok);
    if (!ok) {
        return -1;
    }
    if (!live || at < 0 || at >= self->slots) {
        return 0;
    }
    if (slot == at) {
        return 1;
    }
    if (PyList_GET_SIZE(self->holders) != self->slots) {
        return 0;
    }
    PyObject *holder = PyList_GET_ITEM(self->holders, slot);
    if (holder == Py_None) {
        return 0;
    }
    PyObject *model = PyObject_GetAttr(self->switch_, s_model);
    if (model == NULL) {
        return -1;
    }
    Py_INCREF(holder);
    PyObject *r = PyObject_CallFunctionObjArgs(self->swap, model, holder, NULL);
    Py_DECREF(model);
    if (r == NULL) {
        Py_DECREF(holder);
        return -1;
    }
    Py_DECREF(r);
    /* the holder now holds the old slot's bytes */
    PyList_SetItem(self->holders, at, holder); /* steals `holder` */
    PyList_SetItem(self->holders, slot, Py_NewRef(Py_None));
    return set_int(self->switch_, s_at, slot) < 0 ? -1 : 1;
}

/* counters[key] += 1 */
static int bump(PyObject *counters, PyObject *key)
{
    PyObject *count = PyDict_GetItemWithError(counters, key);
    if (count == NULL && PyErr_Occurred()) {
        return -1;
    }
    long long n = count != NULL ? PyLong_AsLongLong(count) : 0;
    if (n == -1 && PyErr_Occurred()) {
        return -1;
    }
    PyObject *next = PyLong_FromLongLong(n + 1);
    if (next == NULL) {
        return -1;
    }
    int rc = PyDict_SetItem(counters, key, next);
    Py_DECREF(next);
    return rc;
}

/* Record `version` as applied, as `Subscriber._apply_offer` does (and count it as the
 * native path's), and the Link's sequence as `Link.on_receive` does. */
static int record(Follower *self, PyObject *owner, int64_t seq, int64_t version,
                  int64_t slot, uint64_t counter, double now)
{
    PyObject *r = PyObject_CallMethodNoArgs(self->lock, s_acquire);
    if (r == NULL) {
        return -1;
    }
    Py_DECREF(r);
    int rc = -1;
    PyObject *held = Py_BuildValue("(LK)", (long long)slot, (unsigned long long)counter);
    PyObject *heard = PyFloat_FromDouble(now);
    if (held != NULL && heard != NULL && PyObject_SetAttr(owner, s_held, held) == 0
        && set_int(owner, s_version, version) == 0 && bump(self->counters, s_applied) == 0
        && bump(self->counters, s_native) == 0 && set_int(self->link, s_last_seq, seq) == 0
        && PyObject_SetAttr(self->link, s_last_heard, heard) == 0) {
        rc = 0;
    }
    Py_XDECREF(held);
    Py_XDECREF(heard);
    PyObject *type, *value, *trace;
    PyErr_Fetch(&type, &value, &trace); /* released whatever failed */
    r = PyObject_CallMethodNoArgs(self->lock, s_release);
    Py_XDECREF(r);
    if (type != NULL) {
        PyErr_Clear(); /* the first failure is the one to report */
        PyErr_Restore(type, value, trace);
        return -1;
    }
    return r == NULL ? -1 : rc;
}

static int send_ack(Follower *self, int64_t version)
{
    unsigned char frame[ACK_MAX];
    Py_ssize_t head = PyBytes_GET_SIZE(self->ack_head), tail = PyBytes_GET_SIZE(self->ack_tail);
    memcpy(frame, PyBytes_AS_STRING(self->ack_head), (size_t)head);
    Py_ssize_t n = head + pack_int(version, frame + head);
    memcpy(frame + n, PyBytes_AS_STRING(self->ack_tail), (size_t)tail);
    return self->zmq.send(self->acks_sock, frame, (size_t)(n + tail), ZMQ_DONTWAIT) >= 0;
}

PyDoc_STRVAR(next_doc,
"next(last_seq, version, next_tick, /)\n--\n\n"
"Receive on the events socket until there is something for Python; say what.\n\n"
"Versions that follow `last_seq` and `version` and need nothing but a switch are\n"
"applied, recorded and acked here, then the gate is opened. Returns None when the\n"
"socket's receive timed out, the version last applied here when the clock reached\n"
"`next_tick`, a tuple (version,) when its ACK could not be queued (Python sends it\n"
"again), or a frame's bytes for Python to handle.");

static PyObject *follower_next(Follower *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "next(last_seq, version, next_tick)");
        return NULL;
    }
    if (self->sockets == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "Follower is not set up");
        return NULL;
    }
    int64_t last_seq = PyLong_AsLongLong(args[0]);
    int64_t version = PyLong_AsLongLong(args[1]);
    double next_tick = PyFloat_AsDouble(args[2]);
    if (PyErr_Occurred()) {
        return NULL;
    }
    zmq_msg msg;
    int acking = 0; /* the version applied last still needs its ACK and the gate opened */
    for (;;) {
        int rc = 0, err = 0, acked = 1;
        self->zmq.msg_init(&msg);
        Py_BEGIN_ALLOW_THREADS
        /* ACK and open the gate without the GIL: a thread the gate wakes takes it at
         * once, instead of waking again when this thread lets it go */
        if (acking) {
            acked = send_ack(self, version);
            if (acked) {
                gate_open(self->gate, version);
            }
        }
        if (acked) {
            rc = self->zmq.msg_recv(&msg, self->events_sock, 0);
            if (rc < 0) {
                err = self->zmq.errno_();
            }
        }
        Py_END_ALLOW_THREADS
        acking = 0;
        if (!acked) {
            self->zmq.msg_close(&msg);
            return Py_BuildValue("(L)", (long long)version);
        }
        if (rc < 0) {
            self->zmq.msg_close(&msg);
            if (err == EAGAIN) {
                Py_RETURN_NONE;
            }
            if (err == EINTR) {
                if (PyErr_CheckSignals() < 0) {
                    return NULL;
                }
                continue;
            }
            raise_zmq(self->error, err);
            return NULL;
        }
        const unsigned char *data = self->zmq.msg_data(&msg);
        size_t size = self->zmq.msg_size(&msg);
        int64_t f[3];
        uint64_t counter = 0;
        int fast = match(&self->pattern, data, size, f) && f[0] == last_seq + 1
            && f[1] > version && f[2] < self->slots;
        if (fast) {
            /* the slot's seqlock: even, and holding this version (Header.read_begin) */
            size_t i = FIRST_SLOT_WORD + 2 * (size_t)f[2];
            counter = __atomic_load_n(&self->words[i], __ATOMIC_ACQUIRE);
            fast = !(counter & 1)
                && __atomic_load_n(&self->words[i + 1], __ATOMIC_ACQUIRE) == (uint64_t)f[1];
        }
        int switched = fast ? point_at(self, f[2]) : 0;
        if (switched <= 0) {
            PyObject *out = switched < 0
                ? NULL : PyBytes_FromStringAndSize((const char *)data, (Py_ssize_t)size);
            self->zmq.msg_close(&msg);
            return out;
        }
        self->zmq.msg_close(&msg);
        double now = monotonic();
        PyObject *owner = PyWeakref_GetObject(self->owner);
        if (owner == NULL) {
            return NULL;
        }
        if (owner == Py_None) {
            PyErr_SetString(PyExc_ReferenceError, "the subscriber is gone");
            return NULL;
        }
        Py_INCREF(owner);
        rc = record(self, owner, f[0], f[1], f[2], counter, now);
        Py_DECREF(owner);
        if (rc < 0) {
            return NULL;
        }
        last_seq = f[0];
        version = f[1];
        if (now < next_tick) {
            acking = 1; /* on the way back into the receive */
            continue;
        }
        if (!send_ack(self, version)) {
            return Py_BuildValue("(L)", (long long)version);
        }
        gate_open(self->gate, version);
        return PyLong_FromLongLong(version);
    }
}

static PyMethodDef follower_methods[] = {
    {"next", (PyCFunction)(void (*)(void))follower_next, METH_FASTCALL, next_doc},
    {NULL, NULL, 0, NULL},
};

PyDoc_STRVAR(follower_doc,
"Follower(*, libzmq, events, acks, pieces, ranges, ack_head, ack_tail, header, slots,\n"
"         switch, owner, lock, counters, link, gate, error)\n--\n\n"
"A worker's per-version path in C (see `Follower.next`). Built by the Subscriber for\n"
"one mapping, one pair of sockets and one session; dropped with any of them.");

static PyTypeObject FollowerType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "zmqsync._native.Follower",
    .tp_basicsize = sizeof(Follower),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = follower_doc,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)follower_init,
    .tp_dealloc = (destructor)follower_dealloc,
    .tp_traverse = (traverseproc)follower_traverse,
    .tp_clear = (inquiry)follower_clear,
    .tp_methods = follower_methods,
};

/* --- the publisher's side: ACKs read in batches ---------------------------------------- */

/* A publishing thread collects one ACK per worker per version. Read from Python (a recv,
 * `read_ack`, the loop around them) each cost it ~14 us of CPU on a cold thread, as many
 * times as there are workers. AckReader.read() takes every ACK already queued in one
 * call: an ACK written as the workers' template writes it, with a worker id and a
 * session that passed the protocol's checks before (its `passed` sets), becomes a tuple
 * (worker_id, session, version), which is what `read_ack` returns for it; any other
 * frame comes back as (bytes, False) for the Python way.
 *
 * A read returns whole messages: a multipart message (never ours) is read to its last
 * part here and comes back once, as (its first frame, True). A read that stopped inside
 * one would leave its rest to whichever reader comes next, the agent's Python drain
 * included, and a "still inside a message" state kept between reads then took the
 * next honest frame for a part and dropped it. libzmq delivers a message's parts
 * together, so once the first is read the rest are queued: reading them never waits. */
typedef struct {
    PyObject_HEAD
    Zmq zmq;
    void *sock;
    PyObject *socket;   /* the pyzmq socket, kept open while this uses it */
    PyObject *pieces;   /* head, after worker_id, after session, tail */
    int64_t lo, hi;     /* the version's range */
    PyObject *ids, *sessions; /* the strings that passed the protocol's checks */
    PyObject *error;
} AckReader;

static int reader_init(AckReader *self, PyObject *args, PyObject *kwds)
{
    static char *kw[] = {"libzmq", "socket", "pieces", "versions", "ids", "sessions",
                         "error", NULL};
    const char *libzmq;
    PyObject *sock, *pieces, *ids, *sessions, *error;
    long long lo, hi;
    if (self->socket != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "AckReader is set up once");
        return -1;
    }
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "sOO!(LL)O!O!O:AckReader", kw, &libzmq, &sock,
                                     &PyTuple_Type, &pieces, &lo, &hi, &PySet_Type, &ids,
                                     &PySet_Type, &sessions, &error)) {
        return -1;
    }
    if (PyTuple_GET_SIZE(pieces) != 4) {
        PyErr_SetString(PyExc_ValueError, "an ACK pattern has 4 pieces");
        return -1;
    }
    for (Py_ssize_t i = 0; i < 4; i++) {
        if (!PyBytes_Check(PyTuple_GET_ITEM(pieces, i))) {
            PyErr_SetString(PyExc_TypeError, "an ACK pattern's pieces are bytes");
            return -1;
        }
    }
    if (!load_zmq(libzmq, &self->zmq) || !(self->sock = socket_address(sock))) {
        return -1;
    }
    self->lo = lo;
    self->hi = hi;
    self->socket = Py_NewRef(sock);
    self->pieces = Py_NewRef(pieces);
    self->ids = Py_NewRef(ids);
    self->sessions = Py_NewRef(sessions);
    self->error = Py_NewRef(error);
    return 0;
}

static int reader_traverse(AckReader *self, visitproc visit, void *arg)
{
    Py_VISIT(self->socket);
    Py_VISIT(self->pieces);
    Py_VISIT(self->ids);
    Py_VISIT(self->sessions);
    Py_VISIT(self->error);
    return 0;
}

static int reader_clear(AckReader *self)
{
    Py_CLEAR(self->socket);
    Py_CLEAR(self->pieces);
    Py_CLEAR(self->ids);
    Py_CLEAR(self->sessions);
    Py_CLEAR(self->error);
    return 0;
}

static void reader_dealloc(AckReader *self)
{
    PyObject_GC_UnTrack(self);
    reader_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* (worker_id, session, version) of an ACK written as `pieces` say, with a worker id and
 * a session in the passed sets; NULL without an error set for anything else */
static PyObject *match_ack(AckReader *self, const unsigned char *data, size_t size)
{
    const unsigned char *at = data, *end = data + size;
    PyObject *pieces = self->pieces;
    int64_t version;
    if (!expect(&at, end, PyTuple_GET_ITEM(pieces, 0))) {
        return NULL;
    }
    PyObject *worker = read_str(&at, end);
    if (worker == NULL) {
        return NULL;
    }
    PyObject *session = NULL;
    if (expect(&at, end, PyTuple_GET_ITEM(pieces, 1)) && (session = read_str(&at, end)) != NULL
        && expect(&at, end, PyTuple_GET_ITEM(pieces, 2)) && read_int(&at, end, &version)
        && version >= self->lo && version <= self->hi
        && expect(&at, end, PyTuple_GET_ITEM(pieces, 3)) && at == end
        && PySet_Contains(self->ids, worker) == 1 && PySet_Contains(self->sessions, session) == 1) {
        PyObject *out = Py_BuildValue("(OOL)", worker, session, (long long)version);
        Py_DECREF(worker);
        Py_DECREF(session);
        return out;
    }
    Py_DECREF(worker);
    Py_XDECREF(session);
    if (PyErr_Occurred() && !PyErr_ExceptionMatches(PyExc_MemoryError)) {
        PyErr_Clear(); /* a set lookup of a str does not fail; if it did: the Python way */
    }
    return NULL;
}

/* Read and drop the rest of a multipart message whose first part was just read; 0, or
 * the errno of a failed receive. The socket is this thread's while it reads (`_io`). */
static int drop_rest(AckReader *self)
{
    int more = 1, err = 0;
    zmq_msg part;
    Py_BEGIN_ALLOW_THREADS
    while (more) {
        self->zmq.msg_init(&part);
        if (self->zmq.msg_recv(&part, self->sock, ZMQ_DONTWAIT) < 0) {
            err = self->zmq.errno_();
            self->zmq.msg_close(&part);
            if (err == EINTR) {
                err = 0;
                continue;
            }
            break;
        }
        more = self->zmq.msg_more(&part);
        self->zmq.msg_close(&part);
    }
    Py_END_ALLOW_THREADS
    return err == EAGAIN ? 0 : err; /* EAGAIN: nothing more after all (not expected) */
}

PyDoc_STRVAR(read_doc,
"read(most, /)\n--\n\n"
"At most `most` messages from the socket: the first as its receive allows (blocking up\n"
"to its RCVTIMEO), then only those already queued. A list of (worker_id, session,\n"
"version) for each ACK read here, (bytes, False) for any other one-frame message, and\n"
"(first frame, True) for a multipart message, read whole and dropped; empty if none came.");

static PyObject *reader_read(AckReader *self, PyObject *arg)
{
    Py_ssize_t most = PyLong_AsSsize_t(arg);
    if (most == -1 && PyErr_Occurred()) {
        return NULL;
    }
    if (self->socket == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "AckReader is not set up");
        return NULL;
    }
    PyObject *out = PyList_New(0);
    if (out == NULL) {
        return NULL;
    }
    zmq_msg msg;
    for (Py_ssize_t got = 0; got < most; got++) {
        int rc, err = 0;
        int flags = got ? ZMQ_DONTWAIT : 0;
        self->zmq.msg_init(&msg);
        if (got) {
            rc = self->zmq.msg_recv(&msg, self->sock, flags); /* queued: no wait */
        } else {
            Py_BEGIN_ALLOW_THREADS
            rc = self->zmq.msg_recv(&msg, self->sock, flags);
            Py_END_ALLOW_THREADS
        }
        if (rc < 0) {
            err = self->zmq.errno_();
            self->zmq.msg_close(&msg);
            if (err == EAGAIN || err == EINTR) {
                break;
            }
            raise_zmq(self->error, err);
            Py_DECREF(out);
            return NULL;
        }
        const unsigned char *data = self->zmq.msg_data(&msg);
        size_t size = self->zmq.msg_size(&msg);
        int more = self->zmq.msg_more(&msg);
        PyObject *item = more ? NULL : match_ack(self, data, size);
        if (item == NULL && !PyErr_Occurred()) {
            item = Py_BuildValue("(y#O)", (const char *)data, (Py_ssize_t)size,
                                 more ? Py_True : Py_False);
        }
        self->zmq.msg_close(&msg);
        if (item != NULL && more && (err = drop_rest(self)) != 0) {
            Py_DECREF(item);
            raise_zmq(self->error, err);
            item = NULL;
        }
        if (item == NULL || PyList_Append(out, item) < 0) {
            Py_XDECREF(item);
            Py_DECREF(out);
            return NULL;
        }
        Py_DECREF(item);
    }
    return out;
}

static PyMethodDef reader_methods[] = {
    {"read", (PyCFunction)reader_read, METH_O, read_doc},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject AckReaderType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "zmqsync._native.AckReader",
    .tp_basicsize = sizeof(AckReader),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "AckReader(*, libzmq, socket, pieces, versions, ids, sessions, error)\n--\n\n"
              "A publisher's acks socket, read in batches (see `AckReader.read`).",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)reader_init,
    .tp_dealloc = (destructor)reader_dealloc,
    .tp_traverse = (traverseproc)reader_traverse,
    .tp_clear = (inquiry)reader_clear,
    .tp_methods = reader_methods,
};

int zs_add_follower(PyObject *module)
{
    if (!intern_names() || PyType_Ready(&FollowerType) < 0 || PyType_Ready(&GateType) < 0
        || PyType_Ready(&AckReaderType) < 0) {
        return -1;
    }
    if (PyModule_AddObjectRef(module, "AckReader", (PyObject *)&AckReaderType) < 0) {
        return -1;
    }
    if (PyModule_AddObjectRef(module, "Gate", (PyObject *)&GateType) < 0) {
        return -1;
    }
    return PyModule_AddObjectRef(module, "Follower", (PyObject *)&FollowerType);
}
