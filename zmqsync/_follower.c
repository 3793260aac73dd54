/* zmqsync._native.Follower: a worker's per-version path, from RECEIVE to ACK, in C.
 *
 * The twin of `_reference_follower.ReferenceFollower`, which does the same in Python
 * with the same contract; tests/test_twin.py runs one frame stream through both and
 * compares the state they leave after every frame.
 *
 * Alias mode on the CPU, background apply: a version is one RECEIVE read, one seqlock
 * check, one storage pointer swap and one ACK sent. Copy mode (a `copy` callable given):
 * the pointer swap is a call of `copy(slot)`, the Target's whole-slot copy (one native
 * call of its plan), and the seqlock is read again after it; a torn copy, or a RECEIVE
 * naming the tensors that changed (the caller's pattern admits none), goes to Python. Written in Python, those steps cost
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
 * same Python objects (the `Switch`, and the worker's `WorkerState`, which holds the
 * applied version, the held slot, the Link's sequence and liveness clock and the
 * counters), under the same lock: there is no second copy of any state here.
 *
 * The rules this mirrors, each of which names this file: the Link's sequence rule
 * (`Link.on_receive`), the seqlock read (`Header.read_begin`; the words' offsets are
 * given by `Header` at construction), the switch (`Switch.point_at`) and the apply
 * bookkeeping (`Subscriber._apply_offer`). The WorkerState is written through its
 * slots' member descriptors, found by name at construction: a renamed slot fails there.
 *
 * libzmq's functions are looked up in the library pyzmq has loaded (its path is given),
 * and its sockets are used through their addresses (pyzmq's `Socket.underlying`): the
 * events and acks sockets belong to the agent thread, the only caller of next().
 */
#include "_gate.h"
#include "_libzmq.h"
#include "_msgpack_read.h"
#include <structmember.h>

#include <errno.h>
#include <time.h>

#define ACK_MAX 1024

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
    PyObject *copy;    /* copy mode: copy(slot) -> bool, else NULL (alias mode) */
    PyObject *holders;
    PyObject *swap;    /* torch's storage pointer swap (the switch's `swap`) */
    PyObject *state;   /* the worker's `WorkerState`, written through its slots */
    Py_ssize_t at_version, at_held, at_last_seq, at_last_heard, at_applied, at_native;
    PyObject *lock;    /* the Subscriber's lock, under which both followers record */
    Gate *gate;        /* the waiters': opened once a version's ACK is out */
    PyObject *error;   /* error(errno) -> the exception to raise */
} Follower;

static PyObject *s_model, *s_at, *s_active, *s_swap, *s_acquire, *s_release;

static int intern_names(void)
{
#define NAME(var, text) if (!(var = PyUnicode_InternFromString(text))) return 0;
    NAME(s_model, "model") NAME(s_at, "at") NAME(s_active, "active") NAME(s_swap, "swap")
    NAME(s_acquire, "acquire") NAME(s_release, "release")
#undef NAME
    return 1;
}

/* Where `state`'s slot `name` lives: the offset of a writable object slot of its type
 * (a `__slots__` member), or -1 with a TypeError naming what is missing. */
static Py_ssize_t slot_offset(PyObject *state, const char *name)
{
    PyObject *descr = PyObject_GetAttrString((PyObject *)Py_TYPE(state), name);
    if (descr == NULL || !Py_IS_TYPE(descr, &PyMemberDescr_Type)) {
        Py_XDECREF(descr);
        PyErr_Clear();
        PyErr_Format(PyExc_TypeError,
                     "state: %s has no slot %s, which the native follower writes; "
                     "rename it in _follower.c too", Py_TYPE(state)->tp_name, name);
        return -1;
    }
    PyMemberDef *member = ((PyMemberDescrObject *)descr)->d_member;
    Py_ssize_t offset = member->type == T_OBJECT_EX && !(member->flags & READONLY)
        ? member->offset : -1;
    Py_DECREF(descr);
    if (offset < 0) {
        PyErr_Format(PyExc_TypeError, "state: %s.%s is not a writable slot",
                     Py_TYPE(state)->tp_name, name);
    }
    return offset;
}

/* state.<slot at `offset`> = value (a new reference, stolen); the old value goes */
static void put(PyObject *state, Py_ssize_t offset, PyObject *value)
{
    PyObject **at = (PyObject **)((char *)state + offset);
    PyObject *old = *at;
    *at = value;
    Py_XDECREF(old);
}

/* The fields, once the arguments are checked; `holders` and `swap` (alias mode) are
 * new references, taken over or released here. The pattern is made by the caller. */
static int follower_setup(Follower *self, PyObject *events, PyObject *acks,
                          PyObject *ack_head, PyObject *ack_tail, void *words,
                          long long first_slot_word, long long slots, PyObject *holders,
                          PyObject *swap, PyObject *switch_, PyObject *state,
                          const Py_ssize_t at[6], PyObject *lock, PyObject *gate,
                          PyObject *error, PyObject *copy)
{
    self->words = (const volatile uint64_t *)words + first_slot_word; /* slot 0's words */
    self->slots = slots;
    self->holders = holders;
    self->sockets = PyTuple_Pack(2, events, acks);
    self->ack_head = Py_NewRef(ack_head);
    self->ack_tail = Py_NewRef(ack_tail);
    self->switch_ = Py_NewRef(switch_);
    self->copy = copy != NULL ? Py_NewRef(copy) : NULL;
    self->swap = swap;
    self->state = Py_NewRef(state);
    self->at_version = at[0];
    self->at_held = at[1];
    self->at_last_seq = at[2];
    self->at_last_heard = at[3];
    self->at_applied = at[4];
    self->at_native = at[5];
    self->lock = Py_NewRef(lock);
    self->gate = (Gate *)Py_NewRef(gate);
    self->error = Py_NewRef(error);
    return self->sockets == NULL ? -1 : 0;
}

static int follower_init(Follower *self, PyObject *args, PyObject *kwds)
{
    static char *kw[] = {"libzmq", "events", "acks", "pieces", "ranges", "ack_head",
                         "ack_tail", "header", "header_words", "first_slot_word", "slots",
                         "switch", "state", "lock", "gate", "error", "copy", NULL};
    const char *libzmq;
    PyObject *events, *acks, *pieces, *ranges, *ack_head, *ack_tail, *header;
    long long header_words, first_slot_word, slots;
    PyObject *switch_, *state, *lock, *gate, *error, *copy = Py_None;
    if (self->sockets != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "Follower is set up once");
        return -1;
    }
    if (!PyArg_ParseTupleAndKeywords(
            args, kwds, "sOOOOSSOLLLOOOO!O|O:Follower", kw, &libzmq, &events, &acks,
            &pieces, &ranges, &ack_head, &ack_tail, &header, &header_words, &first_slot_word,
            &slots, &switch_, &state, &lock, &GateType, &gate, &error, &copy)) {
        return -1;
    }
    if (copy != Py_None && !PyCallable_Check(copy)) {
        PyErr_SetString(PyExc_TypeError, "copy: copy(slot) -> bool, or None (alias mode)");
        return -1;
    }
    /* the header's layout is Header's (zmqsync/_buffers/header.py): a slot's seqlock
     * counter and version at first_slot_word + 2 * slot, all within header_words */
    if (first_slot_word < 0 || header_words <= first_slot_word) {
        PyErr_SetString(PyExc_ValueError, "first_slot_word: inside the header");
        return -1;
    }
    long long max_slots = (header_words - first_slot_word) / 2;
    if (slots < 1 || slots > max_slots) { /* their seqlock words fit in the header page */
        PyErr_Format(PyExc_ValueError, "slots: 1 to %lld", max_slots);
        return -1;
    }
    Py_ssize_t at[6];
    const char *names[6] = {"version", "held", "last_seq", "last_heard", "applied", "native"};
    for (int i = 0; i < 6; i++) {
        if ((at[i] = slot_offset(state, names[i])) < 0) {
            return -1;
        }
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
    if (!pattern_from(pieces, ranges, &self->pattern)) { /* released by dealloc */
        return -1;
    }
    if (copy != Py_None) { /* copy mode: no switch to check */
        return follower_setup(self, events, acks, ack_head, ack_tail, words,
                              first_slot_word, slots, NULL, NULL, switch_, state, at, lock,
                              gate, error, copy);
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
    /* what point_at reads and writes on every version: renamed in Python, the
     * construction fails here, not the first version */
    static const char *const used[] = {"model", "at", "active"};
    for (size_t i = 0; i < sizeof used / sizeof used[0]; i++) {
        PyObject *value = PyObject_GetAttrString(switch_, used[i]);
        if (value == NULL) {
            Py_DECREF(holders);
            Py_DECREF(swap);
            PyErr_Format(PyExc_TypeError,
                         "switch: %s has no attribute %s, which the native follower uses; "
                         "rename it in _follower.c too", Py_TYPE(switch_)->tp_name, used[i]);
            return -1;
        }
        Py_DECREF(value);
    }
    if (!PyList_CheckExact(holders) || PyList_GET_SIZE(holders) != slots) {
        Py_DECREF(holders);
        Py_DECREF(swap);
        PyErr_SetString(PyExc_ValueError, "switch.holders: a list with one entry per slot");
        return -1;
    }
    return follower_setup(self, events, acks, ack_head, ack_tail, words, first_slot_word,
                          slots, holders, swap, switch_, state, at, lock, gate, error, NULL);
}

static int follower_traverse(Follower *self, visitproc visit, void *arg)
{
    Py_VISIT(self->sockets);
    Py_VISIT(self->pattern.pieces);
    Py_VISIT(self->switch_);
    Py_VISIT(self->copy);
    Py_VISIT(self->holders);
    Py_VISIT(self->swap);
    Py_VISIT(self->state);
    Py_VISIT(self->lock);
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
    Py_CLEAR(self->copy);
    Py_CLEAR(self->holders);
    Py_CLEAR(self->swap);
    Py_CLEAR(self->state);
    Py_CLEAR(self->lock);
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

/* the int in the state's slot at `offset`, plus one (-1 with an error set: not an int) */
static PyObject *plus_one(PyObject *state, Py_ssize_t offset)
{
    PyObject *count = *(PyObject **)((char *)state + offset);
    long long n = count != NULL ? PyLong_AsLongLong(count) : 0;
    if (n == -1 && PyErr_Occurred()) {
        return NULL;
    }
    return PyLong_FromLongLong(n + 1);
}

/* Record `version` as applied in the WorkerState, as `Subscriber._apply_offer` does (and
 * count it as the native path's), and the Link's sequence as `Link.on_receive` does. */
static int record(Follower *self, int64_t seq, int64_t version, int64_t slot,
                  uint64_t counter, double now)
{
    PyObject *r = PyObject_CallMethodNoArgs(self->lock, s_acquire);
    if (r == NULL) {
        return -1;
    }
    Py_DECREF(r);
    PyObject *state = self->state;
    PyObject *held = self->copy != NULL /* a copy holds no slot */
        ? Py_NewRef(Py_None) : Py_BuildValue("(LK)", (long long)slot, (unsigned long long)counter);
    PyObject *heard = PyFloat_FromDouble(now);
    PyObject *v = PyLong_FromLongLong(version), *s = PyLong_FromLongLong(seq);
    PyObject *applied = plus_one(state, self->at_applied);
    PyObject *native = plus_one(state, self->at_native);
    int rc = -1;
    if (held != NULL && heard != NULL && v != NULL && s != NULL && applied != NULL
        && native != NULL) {
        put(state, self->at_held, held); /* each steals its value */
        put(state, self->at_version, v);
        put(state, self->at_applied, applied);
        put(state, self->at_native, native);
        put(state, self->at_last_seq, s);
        put(state, self->at_last_heard, heard);
        rc = 0;
    } else {
        Py_XDECREF(held);
        Py_XDECREF(heard);
        Py_XDECREF(v);
        Py_XDECREF(s);
        Py_XDECREF(applied);
        Py_XDECREF(native);
    }
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

/* Copy mode: copy `slot` into the model as `Subscriber._apply_offer` does (the Target's
 * whole-slot copy), then check the seqlock again (Header.read_valid). 1: a whole
 * version was copied, 0: Python must (the copier declined, or the slot was rewritten
 * meanwhile), -1: an error is set. */
static int copy_slot(Follower *self, int64_t slot, uint64_t counter)
{
    PyObject *slot_number = PyLong_FromLongLong(slot);
    if (slot_number == NULL) {
        return -1;
    }
    PyObject *r = PyObject_CallOneArg(self->copy, slot_number);
    Py_DECREF(slot_number);
    if (r == NULL) {
        return -1;
    }
    int copied = PyObject_IsTrue(r);
    Py_DECREF(r);
    if (copied <= 0) {
        return copied;
    }
    return __atomic_load_n(&self->words[2 * (size_t)slot], __ATOMIC_ACQUIRE) == counter;
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
            size_t i = 2 * (size_t)f[2]; /* `words` starts at slot 0's (Header's offset) */
            counter = __atomic_load_n(&self->words[i], __ATOMIC_ACQUIRE);
            fast = !(counter & 1)
                && __atomic_load_n(&self->words[i + 1], __ATOMIC_ACQUIRE) == (uint64_t)f[1];
        }
        int switched = !fast ? 0
            : self->copy != NULL ? copy_slot(self, f[2], counter) : point_at(self, f[2]);
        if (switched <= 0) {
            PyObject *out = switched < 0
                ? NULL : PyBytes_FromStringAndSize((const char *)data, (Py_ssize_t)size);
            self->zmq.msg_close(&msg);
            return out;
        }
        self->zmq.msg_close(&msg);
        double now = monotonic();
        rc = record(self, f[0], f[1], f[2], counter, now);
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
"Follower(*, libzmq, events, acks, pieces, ranges, ack_head, ack_tail, header,\n"
"         header_words, first_slot_word, slots, switch, state, lock, gate, error,\n"
"         copy=None)\n--\n\n"
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

int zs_add_follower(PyObject *module)
{
    if (!intern_names() || PyType_Ready(&FollowerType) < 0) {
        return -1;
    }
    return PyModule_AddObjectRef(module, "Follower", (PyObject *)&FollowerType);
}
