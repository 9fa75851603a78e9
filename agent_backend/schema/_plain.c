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
 * DictPrepare and CachedPrepare are the hot path of prepare (a valid plain dict:
 * copy, validate, return) as callables without a Python frame; see below.
 *
 * agent_backend/schema/plain.py has the pure-Python equivalent, used when
 * this module is not built; tests/test_schema_plain.py holds both to the
 * same answers.
 *
 * The repair nodes (NumericFix, ObjectFix, ArrayFix) are in _repair.c, and the quick
 * check of the fast path (QuickNode, QuickValid) in _quick.c, both built into this module.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stddef.h>

/* orjson refuses to encode 254 levels or more; deeper input takes the checked path. */
#define ORJSON_MAX_DEPTH 253

/* Nested containers of one dict whose keys the copy keeps from its first pass. */
#define NESTED_KEPT 16

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
        /* Most ints are one digit (below 2**30): within 64 bits without a conversion. */
#if PY_VERSION_HEX >= 0x030C0000
        if (PyUnstable_Long_IsCompact((PyLongObject *)v))
            return 20;
#else
        if (Py_ABS(Py_SIZE(v)) <= 1)
            return 20;
#endif
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
        Py_ssize_t pos = 0, nested = 0;
        PyObject *key, *value, *copied;
        /* The keys and values of the nested containers, found by the pass over the input,
         * when there are at most NESTED_KEPT: the copy's are then replaced without a second
         * pass (see below). */
        PyObject *kept[NESTED_KEPT][2];
        /* One pass over the input checks the keys (exact str first: PyDict_Copy may compare
         * other keys with their __eq__) and the scalar values; the nested containers are
         * then replaced in the copy by their own checked copies. No Python code runs in
         * between, so the copy holds what was checked, and the keys and values kept are
         * the copy's too (borrowed: the input and the copy hold them). */
        while (PyDict_Next(v, &pos, &key, &value)) {
            Py_ssize_t size = -1;
            if (PyUnicode_CheckExact(key))
                size = str_bound(key, budget->exact ? 0 : budget->left);
            if (size < 0) {
                Py_LeaveRecursiveCall();
                return NULL;
            }
            budget->left -= size + 2; /* ':' and ',' */
            PyTypeObject *t = Py_TYPE(value);
            if (t == &PyDict_Type || t == &PyList_Type) {
                if (nested < NESTED_KEPT) {
                    kept[nested][0] = key;
                    kept[nested][1] = value;
                }
                nested++;
                continue;
            }
            size = scalar_bound(value, budget->exact ? 0 : budget->left);
            budget->left -= size;
            if (size < 0 || budget->left < 0) {
                Py_LeaveRecursiveCall();
                return NULL;
            }
        }
        out = PyDict_Copy(v);
        if (nested <= NESTED_KEPT) {
            Py_ssize_t i;
            for (i = 0; out != NULL && ok == 1 && i < nested; i++) {
                ok = check_item(kept[i][1], depth, max_depth, budget, &copied);
                if (copied != NULL) {
                    /* Same key, new value: the key set does not change. */
                    if (PyDict_SetItem(out, kept[i][0], copied) < 0)
                        ok = -1;
                    Py_DECREF(copied);
                }
            }
            nested = 0;
        }
        /* More nested containers than kept: they are found by a pass over the copy. */
        pos = 0;
        while (out != NULL && nested > 0 && ok == 1 && PyDict_Next(out, &pos, &key, &value)) {
            PyTypeObject *t = Py_TYPE(value);
            if (t != &PyDict_Type && t != &PyList_Type)
                continue;
            nested--;
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

/* Bounds as plain_copy takes them, from Python ints: 1 if read, 0 if they admit
 * nothing (the copy is then never made), -1 on error. */
static int
read_bounds(PyObject *depth_arg, PyObject *bytes_arg, long long *max_depth, long long *max_bytes)
{
    int overflow;
    *max_depth = PyLong_AsLongLongAndOverflow(depth_arg, &overflow);
    if (*max_depth == -1 && PyErr_Occurred())
        return -1;
    if (overflow > 0 || *max_depth > ORJSON_MAX_DEPTH)
        *max_depth = ORJSON_MAX_DEPTH;
    if (overflow < 0 || *max_depth < 1)
        return 0;
    *max_bytes = PyLong_AsLongLongAndOverflow(bytes_arg, &overflow);
    if (*max_bytes == -1 && PyErr_Occurred())
        return -1;
    if (overflow > 0 || *max_bytes > PY_SSIZE_T_MAX / 2)
        *max_bytes = PY_SSIZE_T_MAX / 2; /* no bound in practice; room below it for the sums */
    /* Less than "{}" fits nothing; the check also keeps the budget from wrapping around. */
    return overflow >= 0 && *max_bytes >= 2;
}

/* The checked copy of ``value`` within bounds already read (see read_bounds); NULL without
 * an exception: not a plain JSON object within them. NULL with one: out of memory. */
static PyObject *
checked_copy(PyObject *value, long long max_depth, long long max_bytes)
{
    if (Py_TYPE(value) != &PyDict_Type)
        return NULL;
    Budget budget = {(Py_ssize_t)max_bytes, 0};
    int collecting = PyGC_Disable(); /* a collection would run Python code (see the top) */
    PyObject *out = copy_container(value, 1, (int)max_depth, &budget);
    if (out == NULL && !PyErr_Occurred() && budget.left < 0) {
        /* Over the bound by the worst case of some strings: counted exactly, it may fit. */
        budget.left = (Py_ssize_t)max_bytes;
        budget.exact = 1;
        out = copy_container(value, 1, (int)max_depth, &budget);
    }
    if (collecting)
        PyGC_Enable();
    return out;
}

static PyObject *
plain_copy(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "plain_copy(value, max_depth, max_bytes) takes 3 arguments");
        return NULL;
    }
    long long max_depth = 0, max_bytes = 0;
    int bounds = read_bounds(args[1], args[2], &max_depth, &max_bytes);
    if (bounds < 0)
        return NULL;
    PyObject *out = bounds ? checked_copy(args[0], max_depth, max_bytes) : NULL;
    if (out == NULL && !PyErr_Occurred())
        Py_RETURN_NONE;
    return out;
}

/* -- The hot path of prepare, as callables without a Python frame ------------------------
 *
 * DictPrepare(is_valid, max_depth, max_bytes, slow, invalid) is a schema's prepare:
 * called as ``(arguments, tool=None, inject_defaults=False)``. For a dict (not injecting
 * defaults) it makes the checked copy and returns it if ``is_valid(copy)``; an invalid copy
 * goes to ``invalid(arguments, tool, copy)`` (the full pipeline, which repairs it). Every
 * other call, and a dict that is not plain, goes to ``slow`` exactly as it came, so ``slow``
 * (the same function written in Python) answers, and reports the caller's mistakes.
 *
 * CachedPrepare(cache, slow) is prepare_arguments: called as ``(schema, arguments, *,
 * tool=None, inject_defaults=False)``, it finds ``cache[id(schema)]``, an entry
 * ``(schema, prepare, ...)`` of this very schema, and runs its DictPrepare as above;
 * anything else (a schema not compiled yet, another call shape) goes to ``slow``.
 *
 * is_valid runs on the copy, which only this call holds, once it is complete and the
 * garbage collector is back on. Both types have a ``__dict__`` (Python sets __wrapped__,
 * __doc__ and the names, so inspect and help show the Python function they stand for). */

static PyObject *str_tool, *str_inject_defaults;

int _repair_add_types(PyObject *module); /* _repair.c */
int _quick_add_types(PyObject *module);  /* _quick.c */

static int
same_name(PyObject *name, PyObject *interned)
{
    return name == interned || PyUnicode_Compare(name, interned) == 0;
}

/* Reads ``(arguments, tool=None, inject_defaults=False)`` from a vectorcall whose
 * ``nargs`` (1 to 3) positionals start with ``arguments``: 1 if the fast path may take it
 * (``inject_defaults`` absent or False), 0 if the call goes to the Python function as is. */
static int
read_call(PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames, PyObject **tool)
{
    PyObject *inject = nargs >= 3 ? args[2] : NULL;
    *tool = nargs >= 2 ? args[1] : Py_None;
    if (nargs < 1 || nargs > 3)
        return 0;
    if (kwnames != NULL) {
        Py_ssize_t i, n = PyTuple_GET_SIZE(kwnames);
        for (i = 0; i < n; i++) {
            PyObject *name = PyTuple_GET_ITEM(kwnames, i);
            if (nargs < 2 && same_name(name, str_tool))
                *tool = args[nargs + i];
            else if (nargs < 3 && same_name(name, str_inject_defaults))
                inject = args[nargs + i];
            else
                return 0; /* a name given twice or unknown: the Python function says so */
        }
    }
    return inject == NULL || inject == Py_False;
}

typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    PyObject *is_valid, *slow, *invalid, *dict;
    long long max_depth, max_bytes;
    int copies; /* 0: the bounds admit no copy */
} DictPrepare;

static PyTypeObject DictPrepareType;

/* The fast path of a call already read; ``args``/``nargsf``/``kwnames`` are the call as it
 * came (``arguments`` first), passed on to ``slow`` unchanged when the fast path declines. */
static PyObject *
dict_prepare_run(DictPrepare *self, PyObject *arguments, PyObject *tool, PyObject *const *args,
                 size_t nargsf, PyObject *kwnames)
{
    PyObject *copied = NULL;
    if (self->copies && Py_TYPE(arguments) == &PyDict_Type) {
        copied = checked_copy(arguments, self->max_depth, self->max_bytes);
        if (copied == NULL && PyErr_Occurred())
            return NULL;
    }
    if (copied == NULL)
        return PyObject_Vectorcall(self->slow, args, nargsf, kwnames);
    PyObject *verdict = PyObject_CallOneArg(self->is_valid, copied);
    if (verdict == NULL) {
        Py_DECREF(copied);
        return NULL;
    }
    int ok = verdict == Py_True ? 1 : verdict == Py_False ? 0 : PyObject_IsTrue(verdict);
    Py_DECREF(verdict);
    if (ok == 1)
        return copied;
    if (ok < 0) {
        Py_DECREF(copied);
        return NULL;
    }
    PyObject *invalid_args[3] = {arguments, tool, copied};
    PyObject *out = PyObject_Vectorcall(self->invalid, invalid_args, 3, NULL);
    Py_DECREF(copied);
    return out;
}

static PyObject *
dict_prepare_call(PyObject *op, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    DictPrepare *self = (DictPrepare *)op;
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    PyObject *tool;
    if (read_call(args, nargs, kwnames, &tool))
        return dict_prepare_run(self, args[0], tool, args, nargsf, kwnames);
    return PyObject_Vectorcall(self->slow, args, nargsf, kwnames);
}

static PyObject *
dict_prepare_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    PyObject *is_valid, *depth_arg, *bytes_arg, *slow, *invalid;
    if (kwds != NULL && PyDict_GET_SIZE(kwds) != 0) {
        PyErr_SetString(PyExc_TypeError, "DictPrepare() takes no keyword arguments");
        return NULL;
    }
    if (!PyArg_UnpackTuple(args, "DictPrepare", 5, 5, &is_valid, &depth_arg, &bytes_arg, &slow,
                           &invalid))
        return NULL;
    if (!PyCallable_Check(is_valid) || !PyCallable_Check(slow) || !PyCallable_Check(invalid)) {
        PyErr_SetString(PyExc_TypeError, "DictPrepare(is_valid, max_depth, max_bytes, slow, "
                                         "invalid): is_valid, slow and invalid must be callable");
        return NULL;
    }
    if (!PyLong_Check(depth_arg) || !PyLong_Check(bytes_arg)) {
        PyErr_SetString(PyExc_TypeError, "DictPrepare: max_depth and max_bytes must be int");
        return NULL;
    }
    long long max_depth = 0, max_bytes = 0;
    int copies = read_bounds(depth_arg, bytes_arg, &max_depth, &max_bytes);
    if (copies < 0)
        return NULL;
    DictPrepare *self = (DictPrepare *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    self->vectorcall = dict_prepare_call;
    self->is_valid = Py_NewRef(is_valid);
    self->slow = Py_NewRef(slow);
    self->invalid = Py_NewRef(invalid);
    self->dict = NULL;
    self->max_depth = max_depth;
    self->max_bytes = max_bytes;
    self->copies = copies;
    return (PyObject *)self;
}

static int
dict_prepare_traverse(PyObject *op, visitproc visit, void *arg)
{
    DictPrepare *self = (DictPrepare *)op;
    Py_VISIT(self->is_valid);
    Py_VISIT(self->slow);
    Py_VISIT(self->invalid);
    Py_VISIT(self->dict);
    return 0;
}

static int
dict_prepare_clear(PyObject *op)
{
    DictPrepare *self = (DictPrepare *)op;
    Py_CLEAR(self->is_valid);
    Py_CLEAR(self->slow);
    Py_CLEAR(self->invalid);
    Py_CLEAR(self->dict);
    return 0;
}

static void
prepare_dealloc(PyObject *op)
{
    PyObject_GC_UnTrack(op);
    Py_TYPE(op)->tp_clear(op);
    Py_TYPE(op)->tp_free(op);
}

/* ``<qualname (what it is)>`` from the names Python gave it. */
static PyObject *
prepare_repr(PyObject *op)
{
    PyObject *name = PyObject_GetAttrString(op, "__qualname__");
    if (name == NULL || !PyUnicode_Check(name)) {
        PyErr_Clear();
        Py_XDECREF(name);
        return PyUnicode_FromFormat("<%s object at %p>", Py_TYPE(op)->tp_name, op);
    }
    PyObject *out = PyUnicode_FromFormat("<%U, the C fast path (%s)>", name, Py_TYPE(op)->tp_name);
    Py_DECREF(name);
    return out;
}

static PyGetSetDef prepare_getset[] = {
    {"__dict__", PyObject_GenericGetDict, PyObject_GenericSetDict, NULL, NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject DictPrepareType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "agent_backend.schema._plain.DictPrepare",
    .tp_doc = "DictPrepare(is_valid, max_depth, max_bytes, slow, invalid)\n\n"
              "A schema's prepare(arguments, tool=None, inject_defaults=False): a valid plain\n"
              "dict is copied and checked here; everything else goes to slow (or invalid).",
    .tp_basicsize = sizeof(DictPrepare),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_new = dict_prepare_new,
    .tp_dealloc = prepare_dealloc,
    .tp_traverse = dict_prepare_traverse,
    .tp_clear = dict_prepare_clear,
    .tp_repr = prepare_repr,
    .tp_call = PyVectorcall_Call,
    .tp_vectorcall_offset = offsetof(DictPrepare, vectorcall),
    .tp_dictoffset = offsetof(DictPrepare, dict),
    .tp_getset = prepare_getset,
};

typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    PyObject *cache, *slow, *dict;
    /* The entry found last, held: a run of calls for one schema (a tool called in a loop)
     * skips the dict lookup. Holding it holds its schema, so no other object can take the
     * address compared; an entry evicted from the cache is still that schema's prepare. */
    PyObject *last;
} CachedPrepare;

static PyObject *
cached_prepare_call(PyObject *op, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    CachedPrepare *self = (CachedPrepare *)op;
    PyObject *tool;
    if (PyVectorcall_NARGS(nargsf) == 2 && read_call(args + 1, 1, kwnames, &tool)) {
        PyObject *schema = args[0], *entry = self->last;
        if (entry == NULL || PyTuple_GET_ITEM(entry, 0) != schema) {
            PyObject *key = PyLong_FromVoidPtr(schema); /* id(schema) */
            if (key == NULL)
                return NULL;
            entry = PyDict_GetItemWithError(self->cache, key); /* borrowed */
            Py_DECREF(key);
            if (entry == NULL && PyErr_Occurred())
                return NULL;
            if (entry == NULL || !PyTuple_CheckExact(entry) || PyTuple_GET_SIZE(entry) < 2 ||
                PyTuple_GET_ITEM(entry, 0) != schema ||
                !Py_IS_TYPE(PyTuple_GET_ITEM(entry, 1), &DictPrepareType))
                entry = NULL;
            else
                Py_XSETREF(self->last, Py_NewRef(entry));
        }
        if (entry != NULL) {
            /* Held while it runs: neither an eviction nor a newer ``last`` can free it. */
            PyObject *prepare = Py_NewRef(PyTuple_GET_ITEM(entry, 1));
            PyObject *out = dict_prepare_run((DictPrepare *)prepare, args[1], tool, args + 1, 1,
                                             kwnames);
            Py_DECREF(prepare);
            return out;
        }
    }
    return PyObject_Vectorcall(self->slow, args, nargsf, kwnames);
}

static PyObject *
cached_prepare_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    PyObject *cache, *slow;
    if (kwds != NULL && PyDict_GET_SIZE(kwds) != 0) {
        PyErr_SetString(PyExc_TypeError, "CachedPrepare() takes no keyword arguments");
        return NULL;
    }
    if (!PyArg_UnpackTuple(args, "CachedPrepare", 2, 2, &cache, &slow))
        return NULL;
    if (!PyDict_CheckExact(cache) || !PyCallable_Check(slow)) {
        PyErr_SetString(PyExc_TypeError,
                        "CachedPrepare(cache, slow): cache must be a dict, slow callable");
        return NULL;
    }
    CachedPrepare *self = (CachedPrepare *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    self->vectorcall = cached_prepare_call;
    self->cache = Py_NewRef(cache);
    self->slow = Py_NewRef(slow);
    self->dict = NULL;
    self->last = NULL;
    return (PyObject *)self;
}

static int
cached_prepare_traverse(PyObject *op, visitproc visit, void *arg)
{
    CachedPrepare *self = (CachedPrepare *)op;
    Py_VISIT(self->cache);
    Py_VISIT(self->slow);
    Py_VISIT(self->dict);
    Py_VISIT(self->last);
    return 0;
}

static int
cached_prepare_clear(PyObject *op)
{
    CachedPrepare *self = (CachedPrepare *)op;
    Py_CLEAR(self->cache);
    Py_CLEAR(self->slow);
    Py_CLEAR(self->dict);
    Py_CLEAR(self->last);
    return 0;
}

/* Pickled by reference, as the module-level function it stands for. */
static PyObject *
cached_prepare_reduce(PyObject *op, PyObject *Py_UNUSED(ignored))
{
    return PyObject_GetAttrString(op, "__qualname__");
}

static PyMethodDef cached_prepare_methods[] = {
    {"__reduce__", cached_prepare_reduce, METH_NOARGS, NULL},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject CachedPrepareType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "agent_backend.schema._plain.CachedPrepare",
    .tp_doc = "CachedPrepare(cache, slow)\n\n"
              "prepare_arguments(schema, arguments, *, tool=None, inject_defaults=False) for a\n"
              "schema in cache: its DictPrepare runs here; everything else goes to slow.",
    .tp_basicsize = sizeof(CachedPrepare),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_new = cached_prepare_new,
    .tp_dealloc = prepare_dealloc,
    .tp_traverse = cached_prepare_traverse,
    .tp_clear = cached_prepare_clear,
    .tp_repr = prepare_repr,
    .tp_call = PyVectorcall_Call,
    .tp_vectorcall_offset = offsetof(CachedPrepare, vectorcall),
    .tp_dictoffset = offsetof(CachedPrepare, dict),
    .tp_getset = prepare_getset,
    .tp_methods = cached_prepare_methods,
};

/* big_float(value) -> bool
 *
 * Whether a value parsed from JSON holds a float of magnitude >= 2**63 anywhere
 * in its dicts and lists: where orjson may have read an integer beyond 64 bits
 * as a float, so the text must be read again exactly. Only exact dict, list and
 * float are looked at (parsed JSON holds nothing else). Deeper than the C stack
 * allows answers true: the caller then re-reads, which is only slower. Shared with
 * _repair.c (JsonParse). */
int
_plain_holds_big_float(PyObject *v)
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
            found = _plain_holds_big_float(value);
    }
    else {
        Py_ssize_t i;
        for (i = 0; !found && i < PyList_GET_SIZE(v); i++)
            found = _plain_holds_big_float(PyList_GET_ITEM(v, i));
    }
    Py_LeaveRecursiveCall();
    return found;
}

static PyObject *
big_float(PyObject *Py_UNUSED(module), PyObject *value)
{
    return PyBool_FromLong(_plain_holds_big_float(value));
}

static PyMethodDef plain_methods[] = {
    {"plain_copy", (PyCFunction)(void (*)(void))plain_copy, METH_FASTCALL,
     "plain_copy(value, max_depth, max_bytes) -> dict | None\n\n"
     "A deep copy of a plain JSON object within the bounds, or None."},
    {"big_float", (PyCFunction)big_float, METH_O,
     "big_float(value) -> bool\n\n"
     "Whether parsed JSON holds a float of magnitude >= 2**63 anywhere."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef plain_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "agent_backend.schema._plain",
    .m_doc = "The schema layer's C accelerator: the copy of plain JSON arguments, the hot path\n"
             "of prepare (agent_backend/schema/plain.py) and the common repair nodes\n"
             "(agent_backend/schema/coerce_nodes.py).",
    .m_size = 0,
    .m_methods = plain_methods,
};

PyMODINIT_FUNC
PyInit__plain(void)
{
    str_tool = PyUnicode_InternFromString("tool");
    str_inject_defaults = PyUnicode_InternFromString("inject_defaults");
    if (str_tool == NULL || str_inject_defaults == NULL)
        return NULL;
    if (PyType_Ready(&DictPrepareType) < 0 || PyType_Ready(&CachedPrepareType) < 0)
        return NULL;
    PyObject *module = PyModule_Create(&plain_module);
    if (module == NULL)
        return NULL;
    if (PyModule_AddObjectRef(module, "DictPrepare", (PyObject *)&DictPrepareType) < 0 ||
        PyModule_AddObjectRef(module, "CachedPrepare", (PyObject *)&CachedPrepareType) < 0 ||
        _repair_add_types(module) < 0 || _quick_add_types(module) < 0) {
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
