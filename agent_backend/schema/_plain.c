/* agent_backend.schema._plain: the accelerated copy of plain JSON arguments.
 *
 * plain_copy(value, max_depth, max_bytes) -> dict | None
 *
 * Returns a deep copy of ``value`` when it is a plain JSON object: exact
 * dict/list containers with exact str keys, exact str, int within 64 bits
 * (signed, or unsigned as orjson allows), finite float, bool and None; no
 * deeper than ``max_depth`` (the top object is level 1); no larger than
 * ``max_bytes`` as compact JSON (bounded from above, never under-counted).
 * Returns None for anything else: the caller then takes its checked path,
 * which says what is wrong. Never raises for bad input (only MemoryError).
 *
 * No Python code runs while it works, so nothing can change what it checked
 * or reach what it built: the garbage collector is off for the call (a
 * collection runs callbacks and finalizers), and a dict's keys are checked
 * to be exact str before the dict is copied (copying compares colliding
 * keys with __eq__ otherwise). Each container is copied first (PyDict_Copy,
 * PyList_GetSlice), then its copy is checked and its nested containers
 * replaced by their own checked copies. Scalars are immutable and shared
 * with the input. Nesting is bounded by orjson's own limit too (it refuses
 * 254 levels), which also bounds the C recursion.
 *
 * big_float(value) -> bool tells whether parsed JSON holds a float of
 * magnitude >= 2**63 (parse.has_big_float in C).
 *
 * agent_backend/schema/plain.py has the pure-Python equivalent, used when
 * this module is not built; tests/test_schema_plain.py holds both to the
 * same answers.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>

/* orjson refuses to encode 254 levels or more; deeper input takes the checked path. */
#define ORJSON_MAX_DEPTH 253

/* Upper bound of the compact JSON size of a str (quotes included); -1 if it
 * holds a lone surrogate, which is not UTF-8 and orjson refuses. ``room`` is
 * the budget left: a one-byte-per-character string (ASCII or Latin-1, which
 * cannot hold a surrogate) whose worst case (6 bytes a character, \u00XX)
 * fits in it is bounded by that worst case without reading it; only one
 * near the limit is counted exactly. */
static Py_ssize_t
str_bound(PyObject *s, Py_ssize_t room)
{
#if PY_VERSION_HEX < 0x030C0000
    if (PyUnicode_READY(s) < 0) {
        PyErr_Clear();
        return -1;
    }
#endif
    Py_ssize_t n = PyUnicode_GET_LENGTH(s), size = n + 2, i;
    if (PyUnicode_KIND(s) == PyUnicode_1BYTE_KIND && n <= (room - 2) / 6)
        return 6 * n + 2;
    if (PyUnicode_IS_ASCII(s)) {
        const Py_UCS1 *p = PyUnicode_1BYTE_DATA(s);
        for (i = 0; i < n; i++) {
            Py_UCS1 c = p[i];
            if (c < 0x20)
                size += 5; /* \u00XX */
            else if (c == '"' || c == '\\')
                size += 1;
        }
        return size;
    }
    int kind = PyUnicode_KIND(s);
    const void *data = PyUnicode_DATA(s);
    for (i = 0; i < n; i++) {
        Py_UCS4 c = PyUnicode_READ(kind, data, i);
        if (c < 0x20)
            size += 5;
        else if (c == '"' || c == '\\')
            size += 1;
        else if (c < 0x80)
            continue;
        else if (c < 0x800)
            size += 1;
        else if (c >= 0xD800 && c <= 0xDFFF)
            return -1;
        else if (c < 0x10000)
            size += 2;
        else
            size += 3;
    }
    return size;
}

/* Upper bound of a scalar's compact JSON size; -1 if it is not a plain JSON scalar. */
static Py_ssize_t
scalar_bound(PyObject *v, Py_ssize_t room)
{
    PyTypeObject *t = Py_TYPE(v);
    if (t == &PyUnicode_Type)
        return str_bound(v, room);
    if (t == &PyLong_Type) {
        int overflow;
        (void)PyLong_AsLongLongAndOverflow(v, &overflow);
        if (overflow < 0)
            return -1;
        if (overflow > 0) {
            unsigned long long u = PyLong_AsUnsignedLongLong(v);
            if (u == (unsigned long long)-1 && PyErr_Occurred()) {
                PyErr_Clear();
                return -1;
            }
        }
        return 20; /* "-9223372036854775808", "18446744073709551615" */
    }
    if (t == &PyFloat_Type)
        return isfinite(PyFloat_AS_DOUBLE(v)) ? 24 : -1; /* shortest round-trip repr */
    if (v == Py_True || v == Py_False || v == Py_None)
        return 5;
    return -1;
}

/* The JSON size left to fill; ``exact``: count every string (see str_bound). */
typedef struct {
    Py_ssize_t left;
    int exact;
} Budget;

/* The checked copy of a dict or list at nesting level ``depth`` (1 for the top).
 * NULL without an exception: not plain, or over a bound. NULL with one: out of memory. */
static PyObject *copy_container(PyObject *v, int depth, int max_depth, Budget *budget);

/* Check ``item``; a container comes back in ``*copied`` as its checked copy (a new reference).
 * 1: plain; 0: not (no exception); -1: error (exception set). */
static int
check_item(PyObject *item, int depth, int max_depth, Budget *budget, PyObject **copied)
{
    PyTypeObject *t = Py_TYPE(item);
    *copied = NULL;
    if (t == &PyDict_Type || t == &PyList_Type) {
        Py_INCREF(item); /* borrowed from a copy only we hold; held anyway while we recurse */
        *copied = copy_container(item, depth + 1, max_depth, budget);
        Py_DECREF(item);
        if (*copied == NULL)
            return PyErr_Occurred() ? -1 : 0;
        return 1;
    }
    Py_ssize_t size = scalar_bound(item, budget->exact ? 0 : budget->left);
    if (size < 0)
        return 0;
    budget->left -= size;
    return budget->left >= 0;
}

static PyObject *
copy_container(PyObject *v, int depth, int max_depth, Budget *budget)
{
    if (depth > max_depth)
        return NULL;
    if (Py_EnterRecursiveCall(" while copying tool arguments")) {
        PyErr_Clear(); /* deeper than the C stack allows: the checked path decides */
        return NULL;
    }
    PyObject *out;
    int ok = 1;
    budget->left -= 2;
    if (Py_TYPE(v) == &PyDict_Type) {
        Py_ssize_t pos = 0;
        PyObject *key, *value, *copied;
        /* Exact str keys first: PyDict_Copy may compare other keys with their __eq__. */
        while (PyDict_Next(v, &pos, &key, &value)) {
            if (!PyUnicode_CheckExact(key)) {
                Py_LeaveRecursiveCall();
                return NULL;
            }
        }
        out = PyDict_Copy(v);
        pos = 0;
        while (out != NULL && ok == 1 && PyDict_Next(out, &pos, &key, &value)) {
            Py_ssize_t size = str_bound(key, budget->exact ? 0 : budget->left);
            if (size < 0) {
                ok = 0;
                break;
            }
            budget->left -= size + 2; /* ':' and ',' */
            ok = check_item(value, depth, max_depth, budget, &copied);
            if (copied != NULL) {
                /* Same key, new value: the key set does not change, so iteration stays valid. */
                if (PyDict_SetItem(out, key, copied) < 0)
                    ok = -1;
                Py_DECREF(copied);
            }
        }
    }
    else {
        out = PyList_GetSlice(v, 0, PyList_GET_SIZE(v));
        Py_ssize_t i;
        PyObject *copied;
        for (i = 0; out != NULL && ok == 1 && i < PyList_GET_SIZE(out); i++) {
            budget->left -= 1; /* ',' */
            ok = check_item(PyList_GET_ITEM(out, i), depth, max_depth, budget, &copied);
            if (copied != NULL && PyList_SetItem(out, i, copied) < 0) /* steals copied */
                ok = -1;
        }
    }
    Py_LeaveRecursiveCall();
    if (out != NULL && (ok != 1 || budget->left < 0)) {
        Py_DECREF(out);
        out = NULL;
    }
    return out;
}

static PyObject *
plain_copy(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "plain_copy(value, max_depth, max_bytes) takes 3 arguments");
        return NULL;
    }
    int overflow;
    long long max_depth = PyLong_AsLongLongAndOverflow(args[1], &overflow);
    if (max_depth == -1 && PyErr_Occurred())
        return NULL;
    if (overflow > 0 || max_depth > ORJSON_MAX_DEPTH)
        max_depth = ORJSON_MAX_DEPTH;
    long long max_bytes = PyLong_AsLongLongAndOverflow(args[2], &overflow);
    if (max_bytes == -1 && PyErr_Occurred())
        return NULL;
    if (overflow > 0 || max_bytes > PY_SSIZE_T_MAX / 2)
        max_bytes = PY_SSIZE_T_MAX / 2; /* no bound in practice; room below it for the sums */
    /* Less than "{}" fits nothing; the check also keeps the budget from wrapping around. */
    if (Py_TYPE(args[0]) != &PyDict_Type || max_depth < 1 || overflow < 0 || max_bytes < 2)
        Py_RETURN_NONE;
    Budget budget = {(Py_ssize_t)max_bytes, 0};
    int collecting = PyGC_Disable(); /* a collection would run Python code (see the top) */
    PyObject *out = copy_container(args[0], 1, (int)max_depth, &budget);
    if (out == NULL && !PyErr_Occurred() && budget.left < 0) {
        /* Over the bound by the worst case of some strings: counted exactly, it may fit. */
        budget.left = (Py_ssize_t)max_bytes;
        budget.exact = 1;
        out = copy_container(args[0], 1, (int)max_depth, &budget);
    }
    if (collecting)
        PyGC_Enable();
    if (out == NULL && !PyErr_Occurred())
        Py_RETURN_NONE;
    return out;
}

/* valid_copy(cache, schema, value) -> dict | None
 *
 * prepare_arguments' hot path in one call: ``cache[id(schema)]`` is an entry
 * ``(schema, prepare, is_valid, max_depth, max_bytes)`` for this very schema,
 * ``value`` is a dict, its checked copy (as plain_copy makes it) exists and
 * ``is_valid(copy)`` is true: then the copy; else None (the caller takes its
 * full path, which copies, checks and validates again and says what is wrong).
 * is_valid runs on the copy, which only this call holds, after the copy is
 * complete and the garbage collector back on. */
static PyObject *
valid_copy(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "valid_copy(cache, schema, value) takes 3 arguments");
        return NULL;
    }
    PyObject *cache = args[0], *schema = args[1], *value = args[2];
    if (Py_TYPE(value) != &PyDict_Type || !PyDict_CheckExact(cache))
        Py_RETURN_NONE;
    PyObject *key = PyLong_FromVoidPtr(schema); /* id(schema) */
    if (key == NULL)
        return NULL;
    PyObject *entry = PyDict_GetItemWithError(cache, key); /* borrowed */
    Py_DECREF(key);
    if (entry == NULL) {
        if (PyErr_Occurred())
            return NULL;
        Py_RETURN_NONE;
    }
    if (!PyTuple_CheckExact(entry) || PyTuple_GET_SIZE(entry) != 5 ||
        PyTuple_GET_ITEM(entry, 0) != schema)
        Py_RETURN_NONE;
    Py_INCREF(entry); /* held while is_valid runs: a concurrent eviction cannot free it */
    PyObject *is_valid = PyTuple_GET_ITEM(entry, 2);
    PyObject *bounds[2] = {PyTuple_GET_ITEM(entry, 3), PyTuple_GET_ITEM(entry, 4)};
    PyObject *copy_args[3] = {value, bounds[0], bounds[1]};
    PyObject *copied = plain_copy(NULL, copy_args, 3);
    if (copied == NULL || copied == Py_None) {
        Py_DECREF(entry);
        return copied;
    }
    PyObject *verdict = PyObject_CallOneArg(is_valid, copied);
    Py_DECREF(entry);
    if (verdict == NULL) {
        Py_DECREF(copied);
        return NULL;
    }
    int ok = PyObject_IsTrue(verdict);
    Py_DECREF(verdict);
    if (ok == 1)
        return copied;
    Py_DECREF(copied);
    if (ok < 0)
        return NULL;
    Py_RETURN_NONE;
}

/* big_float(value) -> bool
 *
 * Whether a value parsed from JSON holds a float of magnitude >= 2**63 anywhere
 * in its dicts and lists: where orjson may have read an integer beyond 64 bits
 * as a float, so the text must be read again exactly. Only exact dict, list and
 * float are looked at (parsed JSON holds nothing else). Deeper than the C stack
 * allows answers true: the caller then re-reads, which is only slower. */
static int
holds_big_float(PyObject *v)
{
    PyTypeObject *t = Py_TYPE(v);
    if (t == &PyFloat_Type)
        return fabs(PyFloat_AS_DOUBLE(v)) >= 9223372036854775808.0;
    if (t != &PyDict_Type && t != &PyList_Type)
        return 0;
    if (Py_EnterRecursiveCall(" while reading tool arguments")) {
        PyErr_Clear();
        return 1;
    }
    int found = 0;
    if (t == &PyDict_Type) {
        Py_ssize_t pos = 0;
        PyObject *key, *value;
        while (!found && PyDict_Next(v, &pos, &key, &value))
            found = holds_big_float(value);
    }
    else {
        Py_ssize_t i;
        for (i = 0; !found && i < PyList_GET_SIZE(v); i++)
            found = holds_big_float(PyList_GET_ITEM(v, i));
    }
    Py_LeaveRecursiveCall();
    return found;
}

static PyObject *
big_float(PyObject *Py_UNUSED(module), PyObject *value)
{
    return PyBool_FromLong(holds_big_float(value));
}

static PyMethodDef plain_methods[] = {
    {"plain_copy", (PyCFunction)(void (*)(void))plain_copy, METH_FASTCALL,
     "plain_copy(value, max_depth, max_bytes) -> dict | None\n\n"
     "A deep copy of a plain JSON object within the bounds, or None."},
    {"valid_copy", (PyCFunction)(void (*)(void))valid_copy, METH_FASTCALL,
     "valid_copy(cache, schema, value) -> dict | None\n\n"
     "prepare_arguments' hot path: the checked copy of value when cache[id(schema)]\n"
     "is schema's entry and its is_valid accepts the copy; else None."},
    {"big_float", (PyCFunction)big_float, METH_O,
     "big_float(value) -> bool\n\n"
     "Whether parsed JSON holds a float of magnitude >= 2**63 anywhere."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef plain_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "agent_backend.schema._plain",
    .m_doc = "The accelerated copy of plain JSON arguments (see agent_backend/schema/plain.py).",
    .m_size = 0,
    .m_methods = plain_methods,
};

PyMODINIT_FUNC
PyInit__plain(void)
{
    return PyModule_Create(&plain_module);
}
