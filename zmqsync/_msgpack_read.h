/* The msgpack forms a RECEIVE's and an ACK's variable fields take, read (and an int
 * written) the way msgpack's Packer writes them, for the native Follower and AckReader.
 *
 * Only frames written as the protocol's templates write them (`_protocol.template`) are
 * read here; anything else is left to `_protocol.read_receive` / `read_ack` / `decode`,
 * and tests/test_follow.py holds these readers to those.
 */
#ifndef ZMQSYNC_MSGPACK_READ_H
#define ZMQSYNC_MSGPACK_READ_H
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define PIECES 5 /* a RECEIVE: head, seq, piece, version, piece, slot, piece, changed, tail */

/* --- msgpack, only the forms a RECEIVE's and an ACK's variable fields take ---------- */

static inline int read_int(const unsigned char **at, const unsigned char *end, int64_t *out)
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

static inline int read_bin(const unsigned char **at, const unsigned char *end, Py_ssize_t *len)
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
static inline PyObject *read_str(const unsigned char **at, const unsigned char *end)
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

static inline Py_ssize_t pack_int(int64_t v, unsigned char *out)
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

static inline int pattern_from(PyObject *pieces, PyObject *ranges, Pattern *out)
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

static inline int expect(const unsigned char **at, const unsigned char *end, PyObject *piece)
{
    Py_ssize_t n = PyBytes_GET_SIZE(piece);
    if (end - *at < n || memcmp(*at, PyBytes_AS_STRING(piece), (size_t)n) != 0) {
        return 0;
    }
    *at += n;
    return 1;
}

/* seq, version, slot of `data` if it is a RECEIVE written as `pattern` says (else 0) */
static inline int match(const Pattern *pattern, const unsigned char *data, size_t size, int64_t f[3])
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

#endif
