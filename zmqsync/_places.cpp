/* zmqsync._places_native: whether a module's tensors are at the addresses the flat
 * layout put them, in one pass (the contract and its Python twin: _places.py).
 *
 * Each tensor is looked up in its owner's dict (a module's _parameters or _buffers) and
 * its data pointer read through `data_ptr`: the function torch exports, as an address,
 * for the C++ its compiler generates to read a tensor's data pointer without torch's
 * headers (torch._C._dynamo.guards._torchinductor_pyobject_tensor_data_ptr). It throws
 * a C++ exception for what has no data pointer (not a tensor, a sparse tensor, a tensor
 * without storage): caught here, it means "not there", as any other surprise does, and
 * the caller then reads and checks in Python, which decides.
 *
 * `still_at` is the same check without the lookups, for a caller that remembers what
 * they found: while every owner dict keeps the version tag it had then (CPython changes
 * a dict's tag whenever the dict changes: PEP 509), they would find the same objects.
 * On a publish of 2,000 tensors the lookups were most of the check's cold cost (after
 * the copies: ~80 of ~135 us). Where this Python's dicts have no such tag `versions`
 * gives None and the caller always looks up.
 *
 * C++ only for that catch: nothing else here needs it, and nothing of torch is
 * included.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <cstdint>
#include <cstring>

namespace {

using DataPtr = void *(*)(PyObject *);

/* The data pointer of `obj`, or false when it has none, after a check that ran Python
 * code (an isinstance hook) and failed, or when something was thrown. */
bool data_ptr_of(DataPtr data_ptr, PyObject *obj, std::uint64_t *found)
{
    try {
        *found = static_cast<std::uint64_t>(reinterpret_cast<std::uintptr_t>(data_ptr(obj)));
    } catch (...) {
        return false;
    }
    if (PyErr_Occurred()) {
        PyErr_Clear();
        return false;
    }
    return true;
}

/* torch's function from its address (a Python int), or null with an error set. */
DataPtr bound(PyObject *address, const char *who)
{
    auto data_ptr = reinterpret_cast<DataPtr>(PyLong_AsVoidPtr(address));
    if (data_ptr == nullptr && !PyErr_Occurred())
        PyErr_Format(PyExc_ValueError, "%s: data_ptr is 0", who);
    return data_ptr;
}

/* Whether `tensor` has a data pointer and it is the i-th native uint64 of `wanted`. */
bool is_at(DataPtr data_ptr, PyObject *tensor, const char *wanted, Py_ssize_t i)
{
    Py_INCREF(tensor); /* borrowed from a container that Python code could change */
    std::uint64_t found = 0, want = 0;
    const bool has = data_ptr_of(data_ptr, tensor, &found);
    Py_DECREF(tensor);
    std::memcpy(&want, wanted + 8 * i, 8);
    return has && found == want;
}

const char at_doc[] =
    "at(data_ptr, owners, names, addresses) -> bool\n\n"
    "Whether owners[i][names[i]] is a tensor whose data pointer is the i-th native uint64\n"
    "of `addresses`, for every i (`data_ptr`: the address of torch's function; `owners`:\n"
    "a list of dicts, `names`: a list as long, `addresses`: bytes). False for anything\n"
    "else: a missing or non-tensor entry, lengths that differ, a tensor without a data\n"
    "pointer.";

PyObject *at(PyObject *, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 4 || !PyLong_CheckExact(args[0]) || !PyList_CheckExact(args[1])
        || !PyList_CheckExact(args[2]) || !PyBytes_CheckExact(args[3])) {
        PyErr_SetString(PyExc_TypeError,
                        "at(data_ptr: int, owners: list, names: list, addresses: bytes)");
        return nullptr;
    }
    PyObject *owners = args[1], *names = args[2], *addresses = args[3];
    const DataPtr data_ptr = bound(args[0], "at");
    if (data_ptr == nullptr)
        return nullptr;
    const Py_ssize_t n = PyList_GET_SIZE(owners);
    if (PyList_GET_SIZE(names) != n || PyBytes_GET_SIZE(addresses) != n * 8)
        Py_RETURN_FALSE;
    const char *wanted = PyBytes_AS_STRING(addresses);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *owner = PyList_GET_ITEM(owners, i);
        if (!PyDict_Check(owner))
            Py_RETURN_FALSE;
        PyObject *tensor = PyDict_GetItemWithError(owner, PyList_GET_ITEM(names, i));
        if (tensor == nullptr) {
            PyErr_Clear();
            Py_RETURN_FALSE;
        }
        if (!is_at(data_ptr, tensor, wanted, i))
            Py_RETURN_FALSE;
    }
    Py_RETURN_TRUE;
}

/* CPython 3.11 changes ma_version_tag on every change of a dict (PEP 509); 3.12
 * deprecates the field and later versions repurpose it, so only 3.11 reads it. */
#if PY_VERSION_HEX >= 0x030B0000 && PY_VERSION_HEX < 0x030C0000
#define ZMQSYNC_DICT_VERSIONS 1
#endif

const char versions_doc[] =
    "versions(dicts) -> bytes | None\n\n"
    "The version tag of each dict of the list `dicts`, as native uint64s; None where this\n"
    "Python's dicts have none, or an item is not a dict.";

PyObject *versions(PyObject *, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 1 || !PyList_CheckExact(args[0])) {
        PyErr_SetString(PyExc_TypeError, "versions(dicts: list)");
        return nullptr;
    }
#ifdef ZMQSYNC_DICT_VERSIONS
    PyObject *dicts = args[0];
    const Py_ssize_t n = PyList_GET_SIZE(dicts);
    for (Py_ssize_t i = 0; i < n; i++)
        if (!PyDict_CheckExact(PyList_GET_ITEM(dicts, i)))
            Py_RETURN_NONE;
    PyObject *out = PyBytes_FromStringAndSize(nullptr, 8 * n);
    if (out == nullptr)
        return nullptr;
    char *at = PyBytes_AS_STRING(out);
    for (Py_ssize_t i = 0; i < n; i++) {
        const std::uint64_t tag =
            reinterpret_cast<PyDictObject *>(PyList_GET_ITEM(dicts, i))->ma_version_tag;
        std::memcpy(at + 8 * i, &tag, 8);
    }
    return out;
#else
    Py_RETURN_NONE;
#endif
}

/* Whether every dict of `dicts` has the version tag `tags` holds for it. */
bool unchanged(PyObject *dicts, PyObject *tags)
{
#ifdef ZMQSYNC_DICT_VERSIONS
    const Py_ssize_t n = PyList_GET_SIZE(dicts);
    if (PyBytes_GET_SIZE(tags) != n * 8)
        return false;
    const char *want = PyBytes_AS_STRING(tags);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *dict = PyList_GET_ITEM(dicts, i);
        std::uint64_t tag = 0;
        std::memcpy(&tag, want + 8 * i, 8);
        if (!PyDict_CheckExact(dict)
            || reinterpret_cast<PyDictObject *>(dict)->ma_version_tag != tag)
            return false;
    }
    return true;
#else
    (void)dicts;
    (void)tags;
    return false;
#endif
}

const char still_at_doc[] =
    "still_at(data_ptr, dicts, tags, objects, addresses) -> bool\n\n"
    "True only if every dict of `dicts` still has its tag in `tags` (from `versions`) and\n"
    "objects[i] is a tensor whose data pointer is the i-th native uint64 of `addresses`,\n"
    "for every i; before and after the pass, as torch's function may run Python code.\n"
    "False for anything else, and where dicts have no version tags.";

PyObject *still_at(PyObject *, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 5 || !PyLong_CheckExact(args[0]) || !PyList_CheckExact(args[1])
        || !PyBytes_CheckExact(args[2]) || !PyList_CheckExact(args[3])
        || !PyBytes_CheckExact(args[4])) {
        PyErr_SetString(PyExc_TypeError, "still_at(data_ptr: int, dicts: list, tags: bytes, "
                                         "objects: list, addresses: bytes)");
        return nullptr;
    }
    PyObject *dicts = args[1], *tags = args[2], *objects = args[3], *addresses = args[4];
    const DataPtr data_ptr = bound(args[0], "still_at");
    if (data_ptr == nullptr)
        return nullptr;
    const Py_ssize_t n = PyList_GET_SIZE(objects);
    if (PyBytes_GET_SIZE(addresses) != n * 8 || !unchanged(dicts, tags))
        Py_RETURN_FALSE;
    const char *wanted = PyBytes_AS_STRING(addresses);
    for (Py_ssize_t i = 0; i < n && i < PyList_GET_SIZE(objects); i++)
        if (!is_at(data_ptr, PyList_GET_ITEM(objects, i), wanted, i))
            Py_RETURN_FALSE;
    if (PyList_GET_SIZE(objects) != n || !unchanged(dicts, tags))
        Py_RETURN_FALSE;
    Py_RETURN_TRUE;
}

PyMethodDef methods[] = {
    {"at", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(at)), METH_FASTCALL,
     at_doc},
    {"versions", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(versions)),
     METH_FASTCALL, versions_doc},
    {"still_at", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(still_at)),
     METH_FASTCALL, still_at_doc},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "zmqsync._places_native",
    "Whether a module's tensors are at given addresses, in one pass (see _places.py).", -1,
    methods, nullptr, nullptr, nullptr, nullptr,
};

} // namespace

PyMODINIT_FUNC PyInit__places_native(void) { return PyModule_Create(&module); }
