/* The quick check of the fast path: whether a plain JSON value is surely valid, without
 * jsonschema-rs. Built into agent_backend.schema._plain.
 *
 * QuickNode(fields) is one subschema of a common subset of JSON Schema (type, properties,
 * required, additionalProperties, items, enum/const of scalars, numeric bounds, length and
 * count bounds, anyOf, allOf), built by agent_backend/schema/quick.py, which says what the
 * subset is and why each keyword means here what it means to the validator.
 *
 * QuickValid(root, fallback) is called as ``(value)``: True when the root node surely
 * accepts ``value``, else ``fallback(value)`` (the compiled jsonschema-rs validator), which
 * decides. A node answers "surely valid" or "not sure", never "invalid": a keyword outside
 * the subset, a float where an integer is wanted, a number too large to compare without
 * doubt, an enum member that is not a string, an integer, a boolean or null, are all "not
 * sure", and the validator decides. So the quick check can only ever be stricter than the
 * validator; tests/test_schema_quick.py holds it to that on generated schemas and values,
 * the JSON Schema test suite and the BFCL schemas.
 *
 * ``value`` is the fast path's checked copy (plain_copy): exact dict/list/str/int/float/
 * bool/None, exact str keys, so lookups compare strings in C and no Python code runs. Called
 * directly with anything else (a str subclass whose __hash__ or __eq__ changes the dict), it
 * falls back or answers, and never reads what was freed: each item is held while it is read.
 * The recursion follows the schema: a node nests at most QUICK_MAX_HEIGHT levels of nodes
 * (the constructor refuses more; quick.py builds at most MAX_DEPTH), which also bounds the
 * C stack of a check and of a deallocation.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stddef.h>
#include <structmember.h>

/* JSON types as bits (J_: structmember.h has the T_ names). "integer" is J_INT alone: a
 * float that is whole is "not sure". */
#define J_NULL 1u
#define J_BOOL 2u
#define J_INT 4u
#define J_FLOAT 8u
#define J_STR 16u
#define J_ARRAY 32u
#define J_OBJECT 64u

/* Enum flags: which of true, false and null are members. */
#define E_TRUE 1u
#define E_FALSE 2u
#define E_NULL 4u

/* The most levels of nodes one node may hold (the C recursion of a check and a dealloc). */
#define QUICK_MAX_HEIGHT 256

/* 2**53: integers beyond it are compared with a float bound only by the validator. */
#define EXACT_DOUBLE_INT 9007199254740992LL

typedef struct QuickNode {
    PyObject_HEAD
    int height;        /* levels of nodes, this one included */
    int trivial;       /* accepts everything: no keyword to check */
    unsigned types;    /* the JSON types surely accepted (before other keywords) */
    /* object */
    PyObject *names;   /* tuple of property names (exact str) */
    PyObject *nodes;   /* tuple of QuickNode, one per name */
    PyObject *needed;  /* bytes: 1 where that property is required */
    PyObject *others;  /* tuple of required names that are not properties */
    PyObject *known;   /* frozenset of the property names (for additionalProperties) */
    PyObject *extra;   /* None: any other property; False: none; else a QuickNode */
    /* array */
    PyObject *items;   /* None or a QuickNode */
    /* enum / const */
    int has_enum;
    PyObject *enum_strs, *enum_ints; /* frozensets */
    unsigned enum_flags;
    /* numbers: None or an exact int/float each */
    PyObject *minimum, *maximum, *ex_minimum, *ex_maximum;
    /* counts: -1 for none */
    Py_ssize_t min_length, max_length, min_items, max_items, min_props, max_props;
    /* applicators: None or a tuple of QuickNode */
    PyObject *any_of, *all_of;
} QuickNode;

static PyTypeObject QuickNodeType;

static int sure(QuickNode *node, PyObject *value);

/* sure() of an item borrowed from a container, held while it is read. */
static int
sure_item(PyObject *node, PyObject *item)
{
    Py_INCREF(item);
    int result = sure((QuickNode *)node, item);
    Py_DECREF(item);
    return result;
}

/* Whether an int is beyond 2**53 in magnitude (then a float bound is not compared here). */
static int
int_beyond_double(PyObject *value)
{
    int overflow;
    long long n = PyLong_AsLongLongAndOverflow(value, &overflow);
    if (n == -1 && PyErr_Occurred()) {
        PyErr_Clear();
        return 1;
    }
    return overflow != 0 || n > EXACT_DOUBLE_INT || n < -EXACT_DOUBLE_INT;
}

/* 1 if ``value op bound`` holds surely; 0 if not, or if the comparison is left to the
 * validator (an int beyond 2**53 against a float; quick.py keeps int bounds within it). */
static int
holds(PyObject *value, PyObject *bound, int op)
{
    if (bound == Py_None)
        return 1;
    if (Py_TYPE(value) == &PyLong_Type && Py_TYPE(bound) == &PyFloat_Type &&
        int_beyond_double(value))
        return 0;
    int result = PyObject_RichCompareBool(value, bound, op); /* int/float: C only */
    if (result < 0) {
        PyErr_Clear();
        return 0;
    }
    return result;
}

static int
within(Py_ssize_t count, Py_ssize_t low, Py_ssize_t high)
{
    return count >= low && (high < 0 || count <= high);
}

static int
in_set(PyObject *set, PyObject *value)
{
    int found = PySet_Contains(set, value); /* str and int hash and compare in C */
    if (found < 0) {
        PyErr_Clear();
        return 0;
    }
    return found;
}

static int
sure_member(QuickNode *node, PyObject *value, unsigned type)
{
    switch (type) {
    case J_STR:
        return in_set(node->enum_strs, value);
    case J_INT:
        return in_set(node->enum_ints, value);
    case J_BOOL:
        return (node->enum_flags & (value == Py_True ? E_TRUE : E_FALSE)) != 0;
    case J_NULL:
        return (node->enum_flags & E_NULL) != 0;
    default:
        return 0; /* floats and containers: the validator compares them */
    }
}

static int
sure_object(QuickNode *node, PyObject *value)
{
    if (!within(PyDict_GET_SIZE(value), node->min_props, node->max_props))
        return 0;
    Py_ssize_t i, count = PyTuple_GET_SIZE(node->names), found = 0;
    const char *needed = PyBytes_AS_STRING(node->needed);
    for (i = 0; i < count; i++) {
        PyObject *item = PyDict_GetItemWithError(value, PyTuple_GET_ITEM(node->names, i));
        if (item == NULL) {
            if (PyErr_Occurred()) {
                PyErr_Clear();
                return 0;
            }
            if (needed[i])
                return 0;
            continue;
        }
        found++;
        if (!sure_item(PyTuple_GET_ITEM(node->nodes, i), item))
            return 0;
    }
    count = PyTuple_GET_SIZE(node->others);
    for (i = 0; i < count; i++) {
        PyObject *item = PyDict_GetItemWithError(value, PyTuple_GET_ITEM(node->others, i));
        if (item == NULL) {
            PyErr_Clear();
            return 0;
        }
    }
    /* Every property of the value is one of the schema's: nothing else to look at. */
    if (node->extra == Py_None || found == PyDict_GET_SIZE(value))
        return 1;
    Py_ssize_t pos = 0;
    PyObject *key, *item;
    int ok = 1;
    while (ok && PyDict_Next(value, &pos, &key, &item)) {
        Py_INCREF(key);
        Py_INCREF(item);
        if (!in_set(node->known, key))
            ok = node->extra != Py_False && sure((QuickNode *)node->extra, item);
        Py_DECREF(item);
        Py_DECREF(key);
    }
    return ok;
}

static int
sure_array(QuickNode *node, PyObject *value)
{
    Py_ssize_t i, count = PyList_GET_SIZE(value);
    if (!within(count, node->min_items, node->max_items))
        return 0;
    if (node->items != Py_None)
        for (i = 0; i < PyList_GET_SIZE(value); i++)
            if (!sure_item(node->items, PyList_GET_ITEM(value, i)))
                return 0;
    return 1;
}

static int
sure(QuickNode *node, PyObject *value)
{
    if (node->trivial)
        return 1;
    PyTypeObject *t = Py_TYPE(value);
    unsigned type;
    if (t == &PyUnicode_Type)
        type = J_STR;
    else if (t == &PyLong_Type)
        type = J_INT;
    else if (t == &PyDict_Type)
        type = J_OBJECT;
    else if (t == &PyList_Type)
        type = J_ARRAY;
    else if (t == &PyFloat_Type)
        type = J_FLOAT;
    else if (t == &PyBool_Type)
        type = J_BOOL;
    else if (value == Py_None)
        type = J_NULL;
    else
        return 0;
    if (!(node->types & type))
        return 0;
    if (node->has_enum && !sure_member(node, value, type))
        return 0;
    switch (type) {
    case J_STR:
        if (!within(PyUnicode_GET_LENGTH(value), node->min_length, node->max_length))
            return 0;
        break;
    case J_INT:
    case J_FLOAT:
        if (!holds(value, node->minimum, Py_GE) || !holds(value, node->maximum, Py_LE) ||
            !holds(value, node->ex_minimum, Py_GT) || !holds(value, node->ex_maximum, Py_LT))
            return 0;
        break;
    case J_OBJECT:
        if (!sure_object(node, value))
            return 0;
        break;
    case J_ARRAY:
        if (!sure_array(node, value))
            return 0;
        break;
    default:
        break;
    }
    Py_ssize_t i;
    if (node->all_of != Py_None)
        for (i = 0; i < PyTuple_GET_SIZE(node->all_of); i++)
            if (!sure((QuickNode *)PyTuple_GET_ITEM(node->all_of, i), value))
                return 0;
    if (node->any_of != Py_None) {
        for (i = 0; i < PyTuple_GET_SIZE(node->any_of); i++)
            if (sure((QuickNode *)PyTuple_GET_ITEM(node->any_of, i), value))
                return 1;
        return 0;
    }
    return 1;
}

/* -- QuickNode construction ---------------------------------------------------------------- */

/* Checks that ``tuple`` (or None) holds nodes only; ``*height`` becomes at least theirs. */
static int
node_tuple(PyObject *tuple, const char *what, int *height)
{
    if (tuple == Py_None)
        return 0;
    Py_ssize_t i;
    for (i = 0; i < PyTuple_GET_SIZE(tuple); i++) {
        PyObject *item = PyTuple_GET_ITEM(tuple, i);
        if (Py_TYPE(item) != &QuickNodeType) {
            PyErr_Format(PyExc_TypeError, "QuickNode: %s holds a non-node", what);
            return -1;
        }
        if (((QuickNode *)item)->height > *height)
            *height = ((QuickNode *)item)->height;
    }
    return 0;
}

static int
bound_ok(PyObject *bound)
{
    return bound == Py_None || Py_TYPE(bound) == &PyLong_Type ||
           Py_TYPE(bound) == &PyFloat_Type;
}

static PyObject *
quick_node_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    if (kwds != NULL && PyDict_GET_SIZE(kwds) != 0) {
        PyErr_SetString(PyExc_TypeError, "QuickNode() takes no keyword arguments");
        return NULL;
    }
    int trivial, has_enum;
    unsigned int types, enum_flags;
    PyObject *names, *nodes, *needed, *others, *known, *extra, *items, *enum_strs, *enum_ints;
    PyObject *minimum, *maximum, *ex_minimum, *ex_maximum, *any_of, *all_of;
    Py_ssize_t min_length, max_length, min_items, max_items, min_props, max_props;
    if (!PyArg_ParseTuple(args, "pIO!O!O!O!O!OOpO!O!IOOOOnnnnnnOO:QuickNode", &trivial, &types,
                          &PyTuple_Type, &names, &PyTuple_Type, &nodes, &PyBytes_Type, &needed,
                          &PyTuple_Type, &others, &PyFrozenSet_Type, &known, &extra, &items,
                          &has_enum, &PyFrozenSet_Type, &enum_strs, &PyFrozenSet_Type,
                          &enum_ints, &enum_flags, &minimum, &maximum, &ex_minimum, &ex_maximum,
                          &min_length, &max_length, &min_items, &max_items, &min_props,
                          &max_props, &any_of, &all_of))
        return NULL;
    Py_ssize_t i, count = PyTuple_GET_SIZE(names);
    int bad = PyTuple_GET_SIZE(nodes) != count || PyBytes_GET_SIZE(needed) != count;
    for (i = 0; !bad && i < count; i++)
        bad = !PyUnicode_CheckExact(PyTuple_GET_ITEM(names, i));
    for (i = 0; !bad && i < PyTuple_GET_SIZE(others); i++)
        bad = !PyUnicode_CheckExact(PyTuple_GET_ITEM(others, i));
    bad = bad || !(extra == Py_None || extra == Py_False || Py_TYPE(extra) == &QuickNodeType);
    bad = bad || !(items == Py_None || Py_TYPE(items) == &QuickNodeType);
    bad = bad || !bound_ok(minimum) || !bound_ok(maximum) || !bound_ok(ex_minimum) ||
          !bound_ok(ex_maximum);
    bad = bad || !(any_of == Py_None || PyTuple_CheckExact(any_of));
    bad = bad || !(all_of == Py_None || PyTuple_CheckExact(all_of));
    if (bad) {
        PyErr_SetString(PyExc_TypeError, "QuickNode: fields of the wrong shape (see quick.py)");
        return NULL;
    }
    int below = 0;
    if (node_tuple(nodes, "nodes", &below) < 0 || node_tuple(any_of, "any_of", &below) < 0 ||
        node_tuple(all_of, "all_of", &below) < 0)
        return NULL;
    PyObject *single[2] = {extra, items};
    for (i = 0; i < 2; i++)
        if (Py_TYPE(single[i]) == &QuickNodeType && ((QuickNode *)single[i])->height > below)
            below = ((QuickNode *)single[i])->height;
    if (below >= QUICK_MAX_HEIGHT) {
        PyErr_SetString(PyExc_ValueError, "QuickNode: nodes nested too deeply");
        return NULL;
    }
    QuickNode *self = (QuickNode *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    self->height = below + 1;
    self->trivial = trivial;
    self->types = types;
    self->names = Py_NewRef(names);
    self->nodes = Py_NewRef(nodes);
    self->needed = Py_NewRef(needed);
    self->others = Py_NewRef(others);
    self->known = Py_NewRef(known);
    self->extra = Py_NewRef(extra);
    self->items = Py_NewRef(items);
    self->has_enum = has_enum;
    self->enum_strs = Py_NewRef(enum_strs);
    self->enum_ints = Py_NewRef(enum_ints);
    self->enum_flags = enum_flags;
    self->minimum = Py_NewRef(minimum);
    self->maximum = Py_NewRef(maximum);
    self->ex_minimum = Py_NewRef(ex_minimum);
    self->ex_maximum = Py_NewRef(ex_maximum);
    self->min_length = min_length;
    self->max_length = max_length;
    self->min_items = min_items;
    self->max_items = max_items;
    self->min_props = min_props;
    self->max_props = max_props;
    self->any_of = Py_NewRef(any_of);
    self->all_of = Py_NewRef(all_of);
    return (PyObject *)self;
}

#define NODE_FIELDS(X)                                                                         \
    X(names) X(nodes) X(needed) X(others) X(known) X(extra) X(items) X(enum_strs)              \
    X(enum_ints) X(minimum) X(maximum) X(ex_minimum) X(ex_maximum) X(any_of) X(all_of)

static int
quick_node_traverse(PyObject *op, visitproc visit, void *arg)
{
    QuickNode *self = (QuickNode *)op;
#define VISIT(field) Py_VISIT(self->field);
    NODE_FIELDS(VISIT)
#undef VISIT
    return 0;
}

static int
quick_node_clear(PyObject *op)
{
    QuickNode *self = (QuickNode *)op;
#define CLEAR(field) Py_CLEAR(self->field);
    NODE_FIELDS(CLEAR)
#undef CLEAR
    return 0;
}

static void
quick_dealloc(PyObject *op)
{
    PyObject_GC_UnTrack(op);
    Py_TYPE(op)->tp_clear(op);
    Py_TYPE(op)->tp_free(op);
}

/* node.accepts(value) -> bool: whether the node surely accepts a plain JSON value. */
static PyObject *
quick_node_accepts(PyObject *op, PyObject *value)
{
    return PyBool_FromLong(sure((QuickNode *)op, value));
}

static PyMethodDef quick_node_methods[] = {
    {"accepts", quick_node_accepts, METH_O,
     "accepts(value) -> bool\n\nWhether this node surely accepts a plain JSON value."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject QuickNodeType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "agent_backend.schema._plain.QuickNode",
    .tp_doc = "QuickNode(...)\n\nOne subschema of the quick check (built by quick.py).",
    .tp_basicsize = sizeof(QuickNode),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_new = quick_node_new,
    .tp_dealloc = quick_dealloc,
    .tp_traverse = quick_node_traverse,
    .tp_clear = quick_node_clear,
    .tp_methods = quick_node_methods,
};

/* -- QuickValid ---------------------------------------------------------------------------- */

typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    PyObject *root, *fallback;
} QuickValid;

static PyObject *
quick_valid_call(PyObject *op, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    QuickValid *self = (QuickValid *)op;
    if (PyVectorcall_NARGS(nargsf) == 1 && kwnames == NULL &&
        sure((QuickNode *)self->root, args[0]))
        Py_RETURN_TRUE;
    return PyObject_Vectorcall(self->fallback, args, nargsf, kwnames);
}

static PyObject *
quick_valid_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    PyObject *root, *fallback;
    if (kwds != NULL && PyDict_GET_SIZE(kwds) != 0) {
        PyErr_SetString(PyExc_TypeError, "QuickValid() takes no keyword arguments");
        return NULL;
    }
    if (!PyArg_ParseTuple(args, "O!O:QuickValid", &QuickNodeType, &root, &fallback))
        return NULL;
    if (!PyCallable_Check(fallback)) {
        PyErr_SetString(PyExc_TypeError, "QuickValid: fallback must be callable");
        return NULL;
    }
    QuickValid *self = (QuickValid *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    self->vectorcall = quick_valid_call;
    self->root = Py_NewRef(root);
    self->fallback = Py_NewRef(fallback);
    return (PyObject *)self;
}

static int
quick_valid_traverse(PyObject *op, visitproc visit, void *arg)
{
    QuickValid *self = (QuickValid *)op;
    Py_VISIT(self->root);
    Py_VISIT(self->fallback);
    return 0;
}

static int
quick_valid_clear(PyObject *op)
{
    QuickValid *self = (QuickValid *)op;
    Py_CLEAR(self->root);
    Py_CLEAR(self->fallback);
    return 0;
}

static PyMemberDef quick_valid_members[] = {
    {"root", T_OBJECT_EX, offsetof(QuickValid, root), READONLY, "The root QuickNode."},
    {"fallback", T_OBJECT_EX, offsetof(QuickValid, fallback), READONLY,
     "The validator that decides otherwise."},
    {NULL, 0, 0, 0, NULL},
};

static PyTypeObject QuickValidType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "agent_backend.schema._plain.QuickValid",
    .tp_doc = "QuickValid(root, fallback)\n\n"
              "Called as (value): True when root surely accepts the plain JSON value,\n"
              "else fallback(value).",
    .tp_basicsize = sizeof(QuickValid),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_new = quick_valid_new,
    .tp_dealloc = quick_dealloc,
    .tp_traverse = quick_valid_traverse,
    .tp_clear = quick_valid_clear,
    .tp_call = PyVectorcall_Call,
    .tp_vectorcall_offset = offsetof(QuickValid, vectorcall),
    .tp_members = quick_valid_members,
};

int
_quick_add_types(PyObject *module)
{
    if (PyType_Ready(&QuickNodeType) < 0 || PyType_Ready(&QuickValidType) < 0)
        return -1;
    if (PyModule_AddObjectRef(module, "QuickNode", (PyObject *)&QuickNodeType) < 0 ||
        PyModule_AddObjectRef(module, "QuickValid", (PyObject *)&QuickValidType) < 0)
        return -1;
    return 0;
}
