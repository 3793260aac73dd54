/* libzmq, as the native types use it: its functions looked up in the library pyzmq has
 * loaded (its path is given), its sockets used through their addresses (pyzmq's
 * `Socket.underlying`), its errors raised as pyzmq raises them.
 */
#ifndef ZMQSYNC_LIBZMQ_H
#define ZMQSYNC_LIBZMQ_H
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#include <dlfcn.h>

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

static inline void *symbol(void *lib, const char *name)
{
    void *found = dlsym(lib, name);
    if (found == NULL) {
        PyErr_Format(PyExc_ImportError, "libzmq has no %s", name);
    }
    return found;
}

/* libzmq's functions from the library at `path`, which pyzmq has loaded (dlopen takes a
 * reference; pyzmq holds the library for the process's life anyway) */
static inline int load_zmq(const char *path, Zmq *out)
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
static inline void raise_zmq(PyObject *error, int err)
{
    PyObject *exc = PyObject_CallFunction(error, "i", err);
    if (exc != NULL) {
        PyErr_SetObject((PyObject *)Py_TYPE(exc), exc);
        Py_DECREF(exc);
    }
}

static inline void *socket_address(PyObject *sock)
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

#endif
