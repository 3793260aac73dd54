/* zmqsync._native.AckReader: the publisher's ACKs, read in batches.
 *
 * The publisher's side of the native code; it shares the msgpack reader
 * (_msgpack_read.h) and libzmq access (_libzmq.h) with the worker's Follower, nothing
 * else. Imported by the publisher from `_ack_reader` (the Python module).
 */
#include "_libzmq.h"
#include "_msgpack_read.h"

#define ACK_MAX 1024

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

int zs_add_ack_reader(PyObject *module)
{
    if (PyType_Ready(&AckReaderType) < 0) {
        return -1;
    }
    return PyModule_AddObjectRef(module, "AckReader", (PyObject *)&AckReaderType);
}
