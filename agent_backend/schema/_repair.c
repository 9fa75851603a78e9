/* The repair nodes of agent_backend/schema/coerce_nodes.py in C (part of the _plain module).
 *
 * Repair compiles each schema node into a function fix(value, depth, check) (coerce.py).
 * The most common shapes run here, without a Python frame per node and value:
 *
 *   NumericFix(allowed, as_number, max_text, slow)
 *       an ``integer`` or ``number`` leaf given a numeric string;
 *   ScalarFix(allowed, rules, slow)
 *       any other scalar leaf given a string (each rule tried on the stripped text);
 *   ObjectFix(node, fixes, parse, generic, accepts_of, check_children, slow)
 *       an object node whose only repairing keyword is ``properties``;
 *   ArrayFix(node, each, parse, generic, accepts_of, check_items, slow)
 *       an array node with one ``items`` schema for every item;
 *   NullLeftOut(fix, slow)
 *       an optional property whose schema refuses null: null leaves it out;
 *   TypedFix(allowed, rules, openers, wrap, parse, slow)
 *       a ``type`` that names a container, given a string (JSON text, or a lone value);
 *   MemberFix(strings, numbers, flags, null_ok, rules, slow)
 *       an ``enum`` or ``const`` of scalars given a string that spells a member;
 *   JsonParse(loads, max_depth, slow)
 *       the parser of JSON-encoded containers every node above uses.
 *
 * Each stands for the Python function ``slow`` built from the same arguments
 * (coerce_nodes.py), and gives its answers: what C does not handle exactly (a
 * numeric string outside the common ASCII forms, a value of another type, an
 * unexpected call shape) goes to ``slow`` as it came, and every rule, parser and
 * validator is the same Python callable the Python function calls.
 * tests/test_schema_repair_c.py holds both to the same results.
 *
 * accepts_of(node) gives the node's validator's is_valid; it is asked once, on
 * the first check, and held (a validator compiled only for nodes that need one).
 * Input is never mutated: a container is copied on its first changed child.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stddef.h>

int _repair_add_types(PyObject *module);
int _plain_holds_big_float(PyObject *v); /* _plain.c */

static PyObject *str_strip, *str_open_brace, *str_open_bracket, *leave_out, *fail;

/* The call fix(value, depth, check) as the nodes make it: 1 if so, 0 for any other shape. */
static int
is_node_call(size_t nargsf, PyObject *kwnames)
{
    return PyVectorcall_NARGS(nargsf) == 3 && kwnames == NULL;
}

/* text.strip() (an exact str): text itself when neither end is whitespace, as str.strip
 * answers then, without the method call. */
static PyObject *
stripped(PyObject *text)
{
    Py_ssize_t n = PyUnicode_GET_LENGTH(text);
    if (n == 0 || (!Py_UNICODE_ISSPACE(PyUnicode_READ_CHAR(text, 0)) &&
                   !Py_UNICODE_ISSPACE(PyUnicode_READ_CHAR(text, n - 1))))
        return Py_NewRef(text);
    return PyObject_CallMethodNoArgs(text, str_strip);
}

/* depth + 1 for the children (depth is a small int in practice: cached objects). */
static PyObject *
next_depth(PyObject *depth)
{
    Py_ssize_t level = PyLong_AsSsize_t(depth);
    if (level == -1 && PyErr_Occurred())
        return NULL;
    return PyLong_FromSsize_t(level + 1);
}

static int
in_types(PyObject *allowed, PyTypeObject *kind)
{
    Py_ssize_t i;
    for (i = 0; i < PyTuple_GET_SIZE(allowed); i++)
        if (PyTuple_GET_ITEM(allowed, i) == (PyObject *)kind)
            return 1;
    return 0;
}

static int
all_digits(const Py_UCS1 *p, Py_ssize_t n)
{
    Py_ssize_t i;
    if (n == 0)
        return 0;
    for (i = 0; i < n; i++)
        if (p[i] < '0' || p[i] > '9')
            return 0;
    return 1;
}

/* -- NumericFix ------------------------------------------------------------------------ */

/* Fewer integer digits than this keep a float finite (coerce_nodes._FINITE_DIGITS). */
#define FINITE_DIGITS 300

/* NumericFix and ScalarFix: a scalar leaf. ``rules`` is ScalarFix's (NULL in a NumericFix),
 * ``max_text`` and ``as_number`` NumericFix's. */
typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    PyObject *allowed, *rules, *slow, *dict;
    Py_ssize_t max_text;
    int as_number;
} LeafFix;

typedef LeafFix NumericFix;
typedef LeafFix ScalarFix;

/* ASCII text, stripped, as an int or a float, or NULL without an error if it is not one of
 * the common forms: then the Python function decides. The forms are the numeric rules' own
 * shortcuts (coerce_rules.to_integer, to_number): an optional sign, digits, and for a number
 * one dot between digits; digits alone are an int for a number too. */
static PyObject *
common_number(NumericFix *self, const Py_UCS1 *p, Py_ssize_t n)
{
    char buffer[512];
    if (n > self->max_text || n >= (Py_ssize_t)sizeof(buffer))
        return NULL;
    Py_ssize_t sign = n > 0 && (p[0] == '-' || p[0] == '+');
    memcpy(buffer, p, n);
    buffer[n] = '\0';
    if (all_digits(p + sign, n - sign))
        return PyLong_FromString(buffer, NULL, 10);
    if (!self->as_number)
        return NULL;
    const Py_UCS1 *dot = memchr(p, '.', n);
    if (dot == NULL)
        return NULL;
    Py_ssize_t whole = dot - p - sign;
    if (whole >= FINITE_DIGITS || !all_digits(p + sign, whole) ||
        !all_digits(dot + 1, n - (dot + 1 - p)))
        return NULL;
    double number = PyOS_string_to_double(buffer, NULL, NULL);
    if (number == -1.0 && PyErr_Occurred())
        return NULL;
    return PyFloat_FromDouble(number);
}

static PyObject *
numeric_call(PyObject *op, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    NumericFix *self = (NumericFix *)op;
    if (!is_node_call(nargsf, kwnames))
        return PyObject_Vectorcall(self->slow, args, nargsf, kwnames);
    PyObject *value = args[0];
    if (in_types(self->allowed, Py_TYPE(value)))
        return Py_NewRef(value);
    if (!PyUnicode_CheckExact(value) || !PyUnicode_IS_ASCII(value))
        return PyObject_Vectorcall(self->slow, args, nargsf, kwnames);
    const Py_UCS1 *p = PyUnicode_1BYTE_DATA(value);
    Py_ssize_t start = 0, end = PyUnicode_GET_LENGTH(value);
    while (start < end && Py_UNICODE_ISSPACE(p[start])) /* str.strip's whitespace */
        start++;
    while (end > start && Py_UNICODE_ISSPACE(p[end - 1]))
        end--;
    PyObject *number = common_number(self, p + start, end - start);
    if (number != NULL || PyErr_Occurred())
        return number;
    return PyObject_Vectorcall(self->slow, args, nargsf, kwnames);
}

static PyObject *
numeric_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    PyObject *allowed, *as_number, *max_text, *slow;
    if (kwds != NULL && PyDict_GET_SIZE(kwds) != 0) {
        PyErr_SetString(PyExc_TypeError, "NumericFix() takes no keyword arguments");
        return NULL;
    }
    if (!PyArg_UnpackTuple(args, "NumericFix", 4, 4, &allowed, &as_number, &max_text, &slow))
        return NULL;
    if (!PyTuple_CheckExact(allowed) || !PyBool_Check(as_number) || !PyLong_Check(max_text) ||
        !PyCallable_Check(slow)) {
        PyErr_SetString(PyExc_TypeError, "NumericFix(allowed: tuple, as_number: bool, "
                                         "max_text: int, slow: callable)");
        return NULL;
    }
    Py_ssize_t limit = PyLong_AsSsize_t(max_text);
    if (limit == -1 && PyErr_Occurred())
        return NULL;
    NumericFix *self = (NumericFix *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    self->vectorcall = numeric_call;
    self->allowed = Py_NewRef(allowed);
    self->rules = NULL;
    self->slow = Py_NewRef(slow);
    self->dict = NULL;
    self->max_text = limit;
    self->as_number = as_number == Py_True;
    return (PyObject *)self;
}

static int
leaf_traverse(PyObject *op, visitproc visit, void *arg)
{
    LeafFix *self = (LeafFix *)op;
    Py_VISIT(self->allowed);
    Py_VISIT(self->rules);
    Py_VISIT(self->slow);
    Py_VISIT(self->dict);
    return 0;
}

static int
leaf_clear(PyObject *op)
{
    LeafFix *self = (LeafFix *)op;
    Py_CLEAR(self->allowed);
    Py_CLEAR(self->rules);
    Py_CLEAR(self->slow);
    Py_CLEAR(self->dict);
    return 0;
}

/* The answer of the first of ``rules`` (a tuple of callables) that converts ``text``: a new
 * reference, or NULL on an error; ``fail`` (a new reference) if none does. */
static PyObject *
first_rule(PyObject *rules, PyObject *text)
{
    Py_ssize_t i;
    for (i = 0; i < PyTuple_GET_SIZE(rules); i++) {
        PyObject *new = PyObject_CallOneArg(PyTuple_GET_ITEM(rules, i), text);
        if (new != fail)
            return new;
        Py_DECREF(new);
    }
    return Py_NewRef(fail);
}

/* 1 if every item of the tuple ``items`` is callable. */
static int
all_callable(PyObject *items)
{
    Py_ssize_t i;
    for (i = 0; i < PyTuple_GET_SIZE(items); i++)
        if (!PyCallable_Check(PyTuple_GET_ITEM(items, i)))
            return 0;
    return 1;
}

/* -- ScalarFix ------------------------------------------------------------------------- */

static PyObject *
scalar_call(PyObject *op, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    ScalarFix *self = (ScalarFix *)op;
    if (!is_node_call(nargsf, kwnames))
        return PyObject_Vectorcall(self->slow, args, nargsf, kwnames);
    PyObject *value = args[0];
    if (in_types(self->allowed, Py_TYPE(value)))
        return Py_NewRef(value);
    if (!PyUnicode_CheckExact(value))
        return PyObject_Vectorcall(self->slow, args, nargsf, kwnames);
    PyObject *text = stripped(value);
    if (text == NULL)
        return NULL;
    PyObject *new = first_rule(self->rules, text);
    Py_DECREF(text);
    if (new != fail)
        return new; /* the value, or NULL on an error */
    Py_DECREF(new);
    return Py_NewRef(value);
}

static PyObject *
scalar_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    PyObject *allowed, *rules, *slow;
    if (kwds != NULL && PyDict_GET_SIZE(kwds) != 0) {
        PyErr_SetString(PyExc_TypeError, "ScalarFix() takes no keyword arguments");
        return NULL;
    }
    if (!PyArg_UnpackTuple(args, "ScalarFix", 3, 3, &allowed, &rules, &slow))
        return NULL;
    int ok = PyTuple_CheckExact(allowed) && PyTuple_CheckExact(rules) && PyCallable_Check(slow);
    ok = ok && all_callable(rules);
    if (!ok) {
        PyErr_SetString(PyExc_TypeError,
                        "ScalarFix(allowed: tuple, rules: tuple of callables, slow: callable)");
        return NULL;
    }
    ScalarFix *self = (ScalarFix *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    self->vectorcall = scalar_call;
    self->allowed = Py_NewRef(allowed);
    self->rules = Py_NewRef(rules);
    self->slow = Py_NewRef(slow);
    self->dict = NULL;
    self->max_text = 0;
    self->as_number = 0;
    return (PyObject *)self;
}

/* -- ObjectFix and ArrayFix ------------------------------------------------------------- */

typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    /* children: ObjectFix, a dict key -> fix; ArrayFix, the items' fix */
    PyObject *node, *children, *parse, *generic, *accepts_of, *slow, *dict;
    PyObject *accepts; /* accepts_of(node), once asked */
    int check_children;
} ContainerFix;

static PyTypeObject ObjectFixType, ArrayFixType;
static PyObject *object_children(ContainerFix *self, PyObject *value, PyObject *depth);
static PyObject *array_items(ContainerFix *self, PyObject *value, PyObject *depth);

/* 1 if the node's validator accepts value, 0 if not, -1 on error. */
static int
container_accepts(ContainerFix *self, PyObject *value)
{
    if (self->accepts == NULL) {
        PyObject *accepts = PyObject_CallOneArg(self->accepts_of, self->node);
        if (accepts == NULL)
            return -1;
        if (self->accepts == NULL)
            self->accepts = accepts;
        else
            Py_DECREF(accepts);
    }
    PyObject *accepts = Py_NewRef(self->accepts);
    PyObject *verdict = PyObject_CallOneArg(accepts, value);
    Py_DECREF(accepts);
    if (verdict == NULL)
        return -1;
    int ok = verdict == Py_True ? 1 : verdict == Py_False ? 0 : PyObject_IsTrue(verdict);
    Py_DECREF(verdict);
    return ok;
}

/* parse(value.strip(), opener, kind, depth): a new reference (possibly ``fail``) or NULL. */
static PyObject *
container_parse(ContainerFix *self, PyObject *value, PyObject *opener, PyTypeObject *kind,
                PyObject *depth)
{
    PyObject *text = stripped(value);
    if (text == NULL)
        return NULL;
    PyObject *parse_args[4] = {text, opener, (PyObject *)kind, depth};
    PyObject *parsed = PyObject_Vectorcall(self->parse, parse_args, 4, NULL);
    Py_DECREF(text);
    return parsed;
}

/* Each property's fix on the children of ``value`` (a dict, held by the caller). Values are
 * bounded in depth before repair (Limits.max_depth); the guard is Python's own recursion
 * limit, as the Python function would meet it. */
static PyObject *
object_descend(ContainerFix *self, PyObject *value, PyObject *depth)
{
    if (Py_EnterRecursiveCall(" while repairing tool arguments"))
        return NULL;
    PyObject *out = object_children(self, value, depth);
    Py_LeaveRecursiveCall();
    return out;
}

static PyObject *
object_children(ContainerFix *self, PyObject *value, PyObject *depth)
{
    PyObject *result = Py_NewRef(value), *key, *child, *deeper = next_depth(depth);
    PyObject *check = self->check_children ? Py_True : Py_False;
    Py_ssize_t pos = 0;
    if (deeper == NULL)
        goto error;
    while (PyDict_Next(value, &pos, &key, &child)) {
        PyObject *fix = PyDict_GetItemWithError(self->children, key); /* borrowed */
        if (fix == NULL) {
            if (PyErr_Occurred())
                goto error;
            continue;
        }
        Py_INCREF(key);
        Py_INCREF(child);
        Py_INCREF(fix);
        PyObject *fix_args[3] = {child, deeper, check};
        PyObject *new = PyObject_Vectorcall(fix, fix_args, 3, NULL);
        Py_DECREF(fix);
        int failed = new == NULL;
        if (!failed && new != child) {
            if (result == value) {
                Py_SETREF(result, PyDict_Copy(value));
                failed = result == NULL;
            }
            if (!failed)
                failed = (new == leave_out ? PyDict_DelItem(result, key)
                                           : PyDict_SetItem(result, key, new)) < 0;
        }
        Py_XDECREF(new);
        Py_DECREF(child);
        Py_DECREF(key);
        if (failed)
            goto error;
    }
    Py_DECREF(deeper);
    return result;
error:
    Py_XDECREF(deeper);
    Py_XDECREF(result);
    return NULL;
}

/* The items' fix on each item of ``value`` (a list, held by the caller). */
static PyObject *
array_descend(ContainerFix *self, PyObject *value, PyObject *depth)
{
    if (Py_EnterRecursiveCall(" while repairing tool arguments"))
        return NULL;
    PyObject *out = array_items(self, value, depth);
    Py_LeaveRecursiveCall();
    return out;
}

static PyObject *
array_items(ContainerFix *self, PyObject *value, PyObject *depth)
{
    PyObject *result = Py_NewRef(value), *deeper = next_depth(depth);
    PyObject *check = self->check_children ? Py_True : Py_False;
    Py_ssize_t i;
    if (deeper == NULL)
        goto error;
    for (i = 0; i < PyList_GET_SIZE(value); i++) {
        PyObject *child = Py_NewRef(PyList_GET_ITEM(value, i));
        PyObject *fix_args[3] = {child, deeper, check};
        PyObject *new = PyObject_Vectorcall(self->children, fix_args, 3, NULL);
        int failed = new == NULL;
        if (!failed && new != child) {
            if (result == value) {
                Py_SETREF(result, PyList_GetSlice(value, 0, PY_SSIZE_T_MAX));
                failed = result == NULL;
            }
            if (!failed && i < PyList_GET_SIZE(result))
                failed = PyList_SetItem(result, i, Py_NewRef(new)) < 0;
        }
        Py_XDECREF(new);
        Py_DECREF(child);
        if (failed)
            goto error;
    }
    Py_DECREF(deeper);
    return result;
error:
    Py_XDECREF(deeper);
    Py_XDECREF(result);
    return NULL;
}

/* coerce_nodes.object_fix's function. */
static PyObject *
object_call(PyObject *op, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    ContainerFix *self = (ContainerFix *)op;
    if (!is_node_call(nargsf, kwnames))
        return PyObject_Vectorcall(self->slow, args, nargsf, kwnames);
    PyObject *value = args[0], *depth = args[1], *parsed, *out;
    if (!PyDict_CheckExact(value)) {
        if (!PyUnicode_CheckExact(value) || self->parse == Py_None)
            return PyObject_Vectorcall(self->generic, args, nargsf, NULL);
        parsed = container_parse(self, value, str_open_brace, &PyDict_Type, depth);
        if (parsed == NULL)
            return NULL;
        if (parsed == fail) {
            Py_DECREF(parsed);
            return Py_NewRef(value); /* no other conversion, nothing to descend */
        }
        out = object_descend(self, parsed, depth);
        Py_DECREF(parsed);
        return out;
    }
    int check = PyObject_IsTrue(args[2]);
    if (check < 0)
        return NULL;
    if (check) {
        int ok = container_accepts(self, value);
        if (ok != 0)
            return ok < 0 ? NULL : Py_NewRef(value);
    }
    Py_INCREF(value);
    out = object_descend(self, value, depth);
    Py_DECREF(value);
    return out;
}

/* coerce_nodes.array_fix's function. */
static PyObject *
array_call(PyObject *op, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    ContainerFix *self = (ContainerFix *)op;
    if (!is_node_call(nargsf, kwnames))
        return PyObject_Vectorcall(self->slow, args, nargsf, kwnames);
    PyObject *value = args[0], *depth = args[1], *items, *out;
    if (PyList_CheckExact(value)) {
        int check = PyObject_IsTrue(args[2]);
        if (check < 0)
            return NULL;
        if (check) {
            int ok = container_accepts(self, value);
            if (ok != 0)
                return ok < 0 ? NULL : Py_NewRef(value);
        }
        items = Py_NewRef(value);
    }
    else if (PyUnicode_CheckExact(value) && self->parse != Py_None) {
        items = container_parse(self, value, str_open_bracket, &PyList_Type, depth);
        if (items == NULL)
            return NULL;
        if (items == fail) {
            Py_DECREF(items);
            items = PyList_New(1); /* text that is no array: the lone value, wrapped */
            if (items == NULL)
                return NULL;
            PyList_SET_ITEM(items, 0, Py_NewRef(value));
        }
        else if (!PyList_CheckExact(items)) { /* parse answers a list or fail */
            Py_DECREF(items);
            return PyObject_Vectorcall(self->slow, args, nargsf, NULL);
        }
    }
    else
        return PyObject_Vectorcall(self->generic, args, nargsf, NULL);
    out = array_descend(self, items, depth);
    Py_DECREF(items);
    return out;
}

static PyObject *
container_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    PyObject *node, *children, *parse, *generic, *accepts_of, *check_children, *slow;
    int is_object = type == &ObjectFixType;
    const char *name = is_object ? "ObjectFix" : "ArrayFix";
    if (kwds != NULL && PyDict_GET_SIZE(kwds) != 0) {
        PyErr_Format(PyExc_TypeError, "%s() takes no keyword arguments", name);
        return NULL;
    }
    if (!PyArg_UnpackTuple(args, name, 7, 7, &node, &children, &parse, &generic, &accepts_of,
                           &check_children, &slow))
        return NULL;
    if ((is_object ? !PyDict_CheckExact(children) : !PyCallable_Check(children)) ||
        (parse != Py_None && !PyCallable_Check(parse)) || !PyCallable_Check(generic) ||
        !PyCallable_Check(accepts_of) || !PyBool_Check(check_children) ||
        !PyCallable_Check(slow)) {
        PyErr_Format(PyExc_TypeError,
                     "%s(node, %s, parse: callable | None, generic: callable, accepts_of: "
                     "callable, check_children: bool, slow: callable)",
                     name, is_object ? "fixes: dict" : "each: callable");
        return NULL;
    }
    ContainerFix *self = (ContainerFix *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    self->vectorcall = is_object ? object_call : array_call;
    self->node = Py_NewRef(node);
    self->children = Py_NewRef(children);
    self->parse = Py_NewRef(parse);
    self->generic = Py_NewRef(generic);
    self->accepts_of = Py_NewRef(accepts_of);
    self->slow = Py_NewRef(slow);
    self->dict = NULL;
    self->accepts = NULL;
    self->check_children = check_children == Py_True;
    return (PyObject *)self;
}

static int
container_traverse(PyObject *op, visitproc visit, void *arg)
{
    ContainerFix *self = (ContainerFix *)op;
    Py_VISIT(self->node);
    Py_VISIT(self->children);
    Py_VISIT(self->parse);
    Py_VISIT(self->generic);
    Py_VISIT(self->accepts_of);
    Py_VISIT(self->slow);
    Py_VISIT(self->dict);
    Py_VISIT(self->accepts);
    return 0;
}

static int
container_clear(PyObject *op)
{
    ContainerFix *self = (ContainerFix *)op;
    Py_CLEAR(self->node);
    Py_CLEAR(self->children);
    Py_CLEAR(self->parse);
    Py_CLEAR(self->generic);
    Py_CLEAR(self->accepts_of);
    Py_CLEAR(self->slow);
    Py_CLEAR(self->dict);
    Py_CLEAR(self->accepts);
    return 0;
}

/* -- NullLeftOut ------------------------------------------------------------------------ */

typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    PyObject *fix, *slow, *dict;
} NullLeftOut;

static PyObject *
null_left_out_call(PyObject *op, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    NullLeftOut *self = (NullLeftOut *)op;
    if (!is_node_call(nargsf, kwnames))
        return PyObject_Vectorcall(self->slow, args, nargsf, kwnames);
    if (args[0] == Py_None)
        return Py_NewRef(leave_out);
    return PyObject_Vectorcall(self->fix, args, nargsf, NULL);
}

static PyObject *
null_left_out_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    PyObject *fix, *slow;
    if (kwds != NULL && PyDict_GET_SIZE(kwds) != 0) {
        PyErr_SetString(PyExc_TypeError, "NullLeftOut() takes no keyword arguments");
        return NULL;
    }
    if (!PyArg_UnpackTuple(args, "NullLeftOut", 2, 2, &fix, &slow))
        return NULL;
    if (!PyCallable_Check(fix) || !PyCallable_Check(slow)) {
        PyErr_SetString(PyExc_TypeError, "NullLeftOut(fix: callable, slow: callable)");
        return NULL;
    }
    NullLeftOut *self = (NullLeftOut *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    self->vectorcall = null_left_out_call;
    self->fix = Py_NewRef(fix);
    self->slow = Py_NewRef(slow);
    self->dict = NULL;
    return (PyObject *)self;
}

static int
null_left_out_traverse(PyObject *op, visitproc visit, void *arg)
{
    NullLeftOut *self = (NullLeftOut *)op;
    Py_VISIT(self->fix);
    Py_VISIT(self->slow);
    Py_VISIT(self->dict);
    return 0;
}

static int
null_left_out_clear(PyObject *op)
{
    NullLeftOut *self = (NullLeftOut *)op;
    Py_CLEAR(self->fix);
    Py_CLEAR(self->slow);
    Py_CLEAR(self->dict);
    return 0;
}

/* -- JsonParse ------------------------------------------------------------------------- */

typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    PyObject *loads, *slow, *dict;
    Py_ssize_t max_depth;
} JsonParse;

/* How many of text's characters are '{' or '[', counted up to limit + 1. */
static Py_ssize_t
count_openers(PyObject *text, Py_ssize_t limit)
{
    int kind = PyUnicode_KIND(text);
    const void *data = PyUnicode_DATA(text);
    Py_ssize_t i, n = PyUnicode_GET_LENGTH(text), count = 0;
    for (i = 0; i < n && count <= limit; i++) {
        Py_UCS4 c = PyUnicode_READ(kind, data, i);
        count += c == '{' || c == '[';
    }
    return count;
}

/* Coercer._parse_text's function: parse(text, opener, wanted, depth). The common case
 * (text orjson reads, shallow enough to need no walk, no float that may be a big integer)
 * is answered here; everything else goes to ``slow`` with the same arguments. */
static PyObject *
json_parse_call(PyObject *op, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    JsonParse *self = (JsonParse *)op;
    if (PyVectorcall_NARGS(nargsf) != 4 || kwnames != NULL || !PyUnicode_CheckExact(args[0]) ||
        !PyUnicode_CheckExact(args[1]) || !PyLong_CheckExact(args[3]) ||
        (args[2] != (PyObject *)&PyDict_Type && args[2] != (PyObject *)&PyList_Type))
        return PyObject_Vectorcall(self->slow, args, nargsf, kwnames);
    PyObject *text = args[0];
    Py_ssize_t starts = PyUnicode_Tailmatch(text, args[1], 0, PY_SSIZE_T_MAX, -1);
    if (starts < 0)
        return NULL;
    if (!starts)
        return Py_NewRef(fail);
    Py_ssize_t level = PyLong_AsSsize_t(args[3]);
    if (level == -1 && PyErr_Occurred())
        return NULL;
    Py_ssize_t levels = self->max_depth - level + 1; /* how many levels may nest from depth */
    if (levels < 1 || level < 0)
        return PyObject_Vectorcall(self->slow, args, nargsf, NULL);
    if (PyUnicode_GET_LENGTH(text) >= 2 * levels + 2 && count_openers(text, levels) > levels)
        return PyObject_Vectorcall(self->slow, args, nargsf, NULL); /* a walk bounds it */
    PyObject *parsed = PyObject_CallOneArg(self->loads, text);
    if (parsed == NULL) {
        if (!PyErr_ExceptionMatches(PyExc_ValueError))
            return NULL;
        PyErr_Clear(); /* text orjson refuses: the exact reader decides */
        return PyObject_Vectorcall(self->slow, args, nargsf, NULL);
    }
    if (_plain_holds_big_float(parsed)) {
        Py_DECREF(parsed);
        return PyObject_Vectorcall(self->slow, args, nargsf, NULL);
    }
    if (Py_TYPE(parsed) == (PyTypeObject *)args[2])
        return parsed;
    Py_DECREF(parsed);
    return Py_NewRef(fail);
}

static PyObject *
json_parse_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    PyObject *loads, *max_depth, *slow;
    if (kwds != NULL && PyDict_GET_SIZE(kwds) != 0) {
        PyErr_SetString(PyExc_TypeError, "JsonParse() takes no keyword arguments");
        return NULL;
    }
    if (!PyArg_UnpackTuple(args, "JsonParse", 3, 3, &loads, &max_depth, &slow))
        return NULL;
    if (!PyCallable_Check(loads) || !PyLong_Check(max_depth) || !PyCallable_Check(slow)) {
        PyErr_SetString(PyExc_TypeError,
                        "JsonParse(loads: callable, max_depth: int, slow: callable)");
        return NULL;
    }
    Py_ssize_t limit = PyLong_AsSsize_t(max_depth);
    if (limit == -1 && PyErr_Occurred())
        return NULL;
    JsonParse *self = (JsonParse *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    self->vectorcall = json_parse_call;
    self->loads = Py_NewRef(loads);
    self->slow = Py_NewRef(slow);
    self->dict = NULL;
    self->max_depth = limit;
    return (PyObject *)self;
}

static int
json_parse_traverse(PyObject *op, visitproc visit, void *arg)
{
    JsonParse *self = (JsonParse *)op;
    Py_VISIT(self->loads);
    Py_VISIT(self->slow);
    Py_VISIT(self->dict);
    return 0;
}

static int
json_parse_clear(PyObject *op)
{
    JsonParse *self = (JsonParse *)op;
    Py_CLEAR(self->loads);
    Py_CLEAR(self->slow);
    Py_CLEAR(self->dict);
    return 0;
}

/* -- TypedFix --------------------------------------------------------------------------- */

typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    /* openers: a tuple of (opener, wanted) pairs, as type_plan gives them */
    PyObject *allowed, *rules, *openers, *parse, *slow, *dict;
    int wrap;
} TypedFix;

/* coerce_nodes.type_fix's function for a type list that names a container: a value of an
 * allowed type is kept; a string is converted as the node's convert step converts it (each
 * rule, then each opener's parse, then wrapped where an array is allowed); any other value
 * goes to ``slow``. */
static PyObject *
typed_call(PyObject *op, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    TypedFix *self = (TypedFix *)op;
    if (!is_node_call(nargsf, kwnames))
        return PyObject_Vectorcall(self->slow, args, nargsf, kwnames);
    PyObject *value = args[0];
    if (in_types(self->allowed, Py_TYPE(value)))
        return Py_NewRef(value);
    if (!PyUnicode_CheckExact(value))
        return PyObject_Vectorcall(self->slow, args, nargsf, kwnames);
    PyObject *text = stripped(value);
    if (text == NULL)
        return NULL;
    PyObject *new = first_rule(self->rules, text);
    if (new != fail) {
        Py_DECREF(text);
        return new; /* the value, or NULL on an error */
    }
    Py_DECREF(new);
    Py_ssize_t i;
    for (i = 0; i < PyTuple_GET_SIZE(self->openers); i++) {
        PyObject *pair = PyTuple_GET_ITEM(self->openers, i);
        PyObject *parse_args[4] = {text, PyTuple_GET_ITEM(pair, 0), PyTuple_GET_ITEM(pair, 1),
                                   args[1]};
        PyObject *new = PyObject_Vectorcall(self->parse, parse_args, 4, NULL);
        if (new != fail) {
            Py_DECREF(text);
            return new;
        }
        Py_DECREF(new);
    }
    Py_DECREF(text);
    if (!self->wrap)
        return Py_NewRef(value);
    PyObject *wrapped = PyList_New(1);
    if (wrapped != NULL)
        PyList_SET_ITEM(wrapped, 0, Py_NewRef(value));
    return wrapped;
}

static PyObject *
typed_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    PyObject *allowed, *rules, *openers, *wrap, *parse, *slow;
    Py_ssize_t i;
    if (kwds != NULL && PyDict_GET_SIZE(kwds) != 0) {
        PyErr_SetString(PyExc_TypeError, "TypedFix() takes no keyword arguments");
        return NULL;
    }
    if (!PyArg_UnpackTuple(args, "TypedFix", 6, 6, &allowed, &rules, &openers, &wrap, &parse,
                           &slow))
        return NULL;
    int ok = PyTuple_CheckExact(allowed) && PyTuple_CheckExact(rules) &&
             PyTuple_CheckExact(openers) && PyBool_Check(wrap) && PyCallable_Check(parse) &&
             PyCallable_Check(slow);
    ok = ok && all_callable(rules);
    for (i = 0; ok && i < PyTuple_GET_SIZE(openers); i++) {
        PyObject *pair = PyTuple_GET_ITEM(openers, i);
        ok = PyTuple_CheckExact(pair) && PyTuple_GET_SIZE(pair) == 2 &&
             PyUnicode_CheckExact(PyTuple_GET_ITEM(pair, 0)) &&
             PyType_Check(PyTuple_GET_ITEM(pair, 1));
    }
    if (!ok) {
        PyErr_SetString(PyExc_TypeError,
                        "TypedFix(allowed: tuple, rules: tuple of callables, openers: tuple of "
                        "(str, type), wrap: bool, parse: callable, slow: callable)");
        return NULL;
    }
    TypedFix *self = (TypedFix *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    self->vectorcall = typed_call;
    self->allowed = Py_NewRef(allowed);
    self->rules = Py_NewRef(rules);
    self->openers = Py_NewRef(openers);
    self->parse = Py_NewRef(parse);
    self->slow = Py_NewRef(slow);
    self->dict = NULL;
    self->wrap = wrap == Py_True;
    return (PyObject *)self;
}

static int
typed_traverse(PyObject *op, visitproc visit, void *arg)
{
    TypedFix *self = (TypedFix *)op;
    Py_VISIT(self->allowed);
    Py_VISIT(self->rules);
    Py_VISIT(self->openers);
    Py_VISIT(self->parse);
    Py_VISIT(self->slow);
    Py_VISIT(self->dict);
    return 0;
}

static int
typed_clear(PyObject *op)
{
    TypedFix *self = (TypedFix *)op;
    Py_CLEAR(self->allowed);
    Py_CLEAR(self->rules);
    Py_CLEAR(self->openers);
    Py_CLEAR(self->parse);
    Py_CLEAR(self->slow);
    Py_CLEAR(self->dict);
    return 0;
}

/* -- MemberFix -------------------------------------------------------------------------- */

typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    /* the scalar members by kind: strings, numbers (int and float, not bool), booleans */
    PyObject *strings, *numbers, *flags, *rules, *slow, *dict;
    int null_ok;
} MemberFix;

/* Whether a rule's answer is a member: 1, 0, -1 on an error, 2 for a type not looked up
 * here (then the Python function decides). Equal as coerce_rules.json_equal: 1 == 1.0,
 * True is no number, NaN equals nothing. */
static int
member_of(MemberFix *self, PyObject *value)
{
    PyTypeObject *kind = Py_TYPE(value);
    if (kind == &PyUnicode_Type)
        return PySet_Contains(self->strings, value);
    if (kind == &PyLong_Type)
        return PySet_Contains(self->numbers, value);
    if (kind == &PyFloat_Type)
        return isnan(PyFloat_AS_DOUBLE(value)) ? 0 : PySet_Contains(self->numbers, value);
    if (kind == &PyBool_Type)
        return PySet_Contains(self->flags, value);
    if (value == Py_None)
        return self->null_ok;
    return 2;
}

/* coerce_nodes.member_fix's function: an enum or const of scalars with nothing else to
 * repair. A string that is no member becomes the first rule's answer that is one; every
 * other value is kept (no step of such a node changes it). */
static PyObject *
member_call(PyObject *op, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    MemberFix *self = (MemberFix *)op;
    if (!is_node_call(nargsf, kwnames))
        return PyObject_Vectorcall(self->slow, args, nargsf, kwnames);
    PyObject *value = args[0];
    PyTypeObject *kind = Py_TYPE(value);
    if (kind != &PyUnicode_Type) {
        if (kind == &PyLong_Type || kind == &PyFloat_Type || kind == &PyBool_Type ||
            value == Py_None || kind == &PyDict_Type || kind == &PyList_Type)
            return Py_NewRef(value);
        return PyObject_Vectorcall(self->slow, args, nargsf, kwnames);
    }
    int found = PySet_Contains(self->strings, value);
    if (found != 0)
        return found < 0 ? NULL : Py_NewRef(value);
    PyObject *text = stripped(value);
    if (text == NULL)
        return NULL;
    Py_ssize_t i;
    for (i = 0; i < PyTuple_GET_SIZE(self->rules); i++) {
        PyObject *new = PyObject_CallOneArg(PyTuple_GET_ITEM(self->rules, i), text);
        if (new == NULL)
            break;
        if (new == fail) {
            Py_DECREF(new);
            continue;
        }
        found = member_of(self, new);
        if (found == 1) {
            Py_DECREF(text);
            return new;
        }
        Py_DECREF(new);
        if (found < 0)
            break;
        if (found == 2) {
            Py_DECREF(text);
            return PyObject_Vectorcall(self->slow, args, nargsf, kwnames);
        }
    }
    Py_DECREF(text);
    return PyErr_Occurred() ? NULL : Py_NewRef(value);
}

static PyObject *
member_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    PyObject *strings, *numbers, *flags, *null_ok, *rules, *slow;
    if (kwds != NULL && PyDict_GET_SIZE(kwds) != 0) {
        PyErr_SetString(PyExc_TypeError, "MemberFix() takes no keyword arguments");
        return NULL;
    }
    if (!PyArg_UnpackTuple(args, "MemberFix", 6, 6, &strings, &numbers, &flags, &null_ok,
                           &rules, &slow))
        return NULL;
    int ok = PyFrozenSet_CheckExact(strings) && PyFrozenSet_CheckExact(numbers) &&
             PyFrozenSet_CheckExact(flags) && PyBool_Check(null_ok) &&
             PyTuple_CheckExact(rules) && PyCallable_Check(slow);
    ok = ok && all_callable(rules);
    if (!ok) {
        PyErr_SetString(PyExc_TypeError,
                        "MemberFix(strings: frozenset, numbers: frozenset, flags: frozenset, "
                        "null_ok: bool, rules: tuple of callables, slow: callable)");
        return NULL;
    }
    MemberFix *self = (MemberFix *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    self->vectorcall = member_call;
    self->strings = Py_NewRef(strings);
    self->numbers = Py_NewRef(numbers);
    self->flags = Py_NewRef(flags);
    self->rules = Py_NewRef(rules);
    self->slow = Py_NewRef(slow);
    self->dict = NULL;
    self->null_ok = null_ok == Py_True;
    return (PyObject *)self;
}

static int
member_traverse(PyObject *op, visitproc visit, void *arg)
{
    MemberFix *self = (MemberFix *)op;
    Py_VISIT(self->strings);
    Py_VISIT(self->numbers);
    Py_VISIT(self->flags);
    Py_VISIT(self->rules);
    Py_VISIT(self->slow);
    Py_VISIT(self->dict);
    return 0;
}

static int
member_clear(PyObject *op)
{
    MemberFix *self = (MemberFix *)op;
    Py_CLEAR(self->strings);
    Py_CLEAR(self->numbers);
    Py_CLEAR(self->flags);
    Py_CLEAR(self->rules);
    Py_CLEAR(self->slow);
    Py_CLEAR(self->dict);
    return 0;
}

/* -- the types -------------------------------------------------------------------------- */

static void
fix_dealloc(PyObject *op)
{
    PyObject_GC_UnTrack(op);
    Py_TYPE(op)->tp_clear(op);
    Py_TYPE(op)->tp_free(op);
}

static PyGetSetDef fix_getset[] = {
    {"__dict__", PyObject_GenericGetDict, PyObject_GenericSetDict, NULL, NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

#define FIX_TYPE_FLAGS (Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL)

static PyTypeObject NumericFixType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "agent_backend.schema._plain.NumericFix",
    .tp_doc = "NumericFix(allowed, as_number, max_text, slow)\n\n"
              "coerce_nodes.type_fix's function for an integer or number leaf: fix(value, "
              "depth, check).",
    .tp_basicsize = sizeof(LeafFix),
    .tp_flags = FIX_TYPE_FLAGS,
    .tp_new = numeric_new,
    .tp_dealloc = fix_dealloc,
    .tp_traverse = leaf_traverse,
    .tp_clear = leaf_clear,
    .tp_call = PyVectorcall_Call,
    .tp_vectorcall_offset = offsetof(LeafFix, vectorcall),
    .tp_dictoffset = offsetof(LeafFix, dict),
    .tp_getset = fix_getset,
};

static PyTypeObject ScalarFixType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "agent_backend.schema._plain.ScalarFix",
    .tp_doc = "ScalarFix(allowed, rules, slow)\n\n"
              "coerce_nodes.type_fix's function for another scalar leaf: fix(value, depth, "
              "check).",
    .tp_basicsize = sizeof(LeafFix),
    .tp_flags = FIX_TYPE_FLAGS,
    .tp_new = scalar_new,
    .tp_dealloc = fix_dealloc,
    .tp_traverse = leaf_traverse,
    .tp_clear = leaf_clear,
    .tp_call = PyVectorcall_Call,
    .tp_vectorcall_offset = offsetof(LeafFix, vectorcall),
    .tp_dictoffset = offsetof(LeafFix, dict),
    .tp_getset = fix_getset,
};

static PyTypeObject ObjectFixType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "agent_backend.schema._plain.ObjectFix",
    .tp_doc = "ObjectFix(node, fixes, parse, generic, accepts_of, check_children, slow)\n\n"
              "coerce_nodes.object_fix's function: fix(value, depth, check).",
    .tp_basicsize = sizeof(ContainerFix),
    .tp_flags = FIX_TYPE_FLAGS,
    .tp_new = container_new,
    .tp_dealloc = fix_dealloc,
    .tp_traverse = container_traverse,
    .tp_clear = container_clear,
    .tp_call = PyVectorcall_Call,
    .tp_vectorcall_offset = offsetof(ContainerFix, vectorcall),
    .tp_dictoffset = offsetof(ContainerFix, dict),
    .tp_getset = fix_getset,
};

static PyTypeObject ArrayFixType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "agent_backend.schema._plain.ArrayFix",
    .tp_doc = "ArrayFix(node, each, parse, generic, accepts_of, check_items, slow)\n\n"
              "coerce_nodes.array_fix's function: fix(value, depth, check).",
    .tp_basicsize = sizeof(ContainerFix),
    .tp_flags = FIX_TYPE_FLAGS,
    .tp_new = container_new,
    .tp_dealloc = fix_dealloc,
    .tp_traverse = container_traverse,
    .tp_clear = container_clear,
    .tp_call = PyVectorcall_Call,
    .tp_vectorcall_offset = offsetof(ContainerFix, vectorcall),
    .tp_dictoffset = offsetof(ContainerFix, dict),
    .tp_getset = fix_getset,
};

static PyTypeObject NullLeftOutType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "agent_backend.schema._plain.NullLeftOut",
    .tp_doc = "NullLeftOut(fix, slow)\n\n"
              "coerce_nodes.null_left_out's function: fix(value, depth, check).",
    .tp_basicsize = sizeof(NullLeftOut),
    .tp_flags = FIX_TYPE_FLAGS,
    .tp_new = null_left_out_new,
    .tp_dealloc = fix_dealloc,
    .tp_traverse = null_left_out_traverse,
    .tp_clear = null_left_out_clear,
    .tp_call = PyVectorcall_Call,
    .tp_vectorcall_offset = offsetof(NullLeftOut, vectorcall),
    .tp_dictoffset = offsetof(NullLeftOut, dict),
    .tp_getset = fix_getset,
};

static PyTypeObject JsonParseType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "agent_backend.schema._plain.JsonParse",
    .tp_doc = "JsonParse(loads, max_depth, slow)\n\n"
              "Coercer._parse_text's function: parse(text, opener, wanted, depth).",
    .tp_basicsize = sizeof(JsonParse),
    .tp_flags = FIX_TYPE_FLAGS,
    .tp_new = json_parse_new,
    .tp_dealloc = fix_dealloc,
    .tp_traverse = json_parse_traverse,
    .tp_clear = json_parse_clear,
    .tp_call = PyVectorcall_Call,
    .tp_vectorcall_offset = offsetof(JsonParse, vectorcall),
    .tp_dictoffset = offsetof(JsonParse, dict),
    .tp_getset = fix_getset,
};

static PyTypeObject TypedFixType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "agent_backend.schema._plain.TypedFix",
    .tp_doc = "TypedFix(allowed, rules, openers, wrap, parse, slow)\n\n"
              "coerce_nodes.type_fix's function for a type that names a container: "
              "fix(value, depth, check).",
    .tp_basicsize = sizeof(TypedFix),
    .tp_flags = FIX_TYPE_FLAGS,
    .tp_new = typed_new,
    .tp_dealloc = fix_dealloc,
    .tp_traverse = typed_traverse,
    .tp_clear = typed_clear,
    .tp_call = PyVectorcall_Call,
    .tp_vectorcall_offset = offsetof(TypedFix, vectorcall),
    .tp_dictoffset = offsetof(TypedFix, dict),
    .tp_getset = fix_getset,
};

static PyTypeObject MemberFixType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "agent_backend.schema._plain.MemberFix",
    .tp_doc = "MemberFix(strings, numbers, flags, null_ok, rules, slow)\n\n"
              "coerce_nodes.member_fix's function: fix(value, depth, check).",
    .tp_basicsize = sizeof(MemberFix),
    .tp_flags = FIX_TYPE_FLAGS,
    .tp_new = member_new,
    .tp_dealloc = fix_dealloc,
    .tp_traverse = member_traverse,
    .tp_clear = member_clear,
    .tp_call = PyVectorcall_Call,
    .tp_vectorcall_offset = offsetof(MemberFix, vectorcall),
    .tp_dictoffset = offsetof(MemberFix, dict),
    .tp_getset = fix_getset,
};

/* set_sentinels(leave_out, fail): coerce_nodes.LEAVE_OUT and coerce_rules.FAIL, given once
 * by coerce_nodes when it imports this module (they are Python objects of that module). */
static PyObject *
set_sentinels(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "set_sentinels(leave_out, fail)");
        return NULL;
    }
    Py_XSETREF(leave_out, Py_NewRef(args[0]));
    Py_XSETREF(fail, Py_NewRef(args[1]));
    Py_RETURN_NONE;
}

static PyMethodDef repair_methods[] = {
    {"set_sentinels", (PyCFunction)(void (*)(void))set_sentinels, METH_FASTCALL,
     "set_sentinels(leave_out, fail): the repair nodes' two sentinel objects."},
    {NULL, NULL, 0, NULL},
};

int
_repair_add_types(PyObject *module)
{
    str_strip = PyUnicode_InternFromString("strip");
    str_open_brace = PyUnicode_InternFromString("{");
    str_open_bracket = PyUnicode_InternFromString("[");
    /* Until set_sentinels: objects no fix returns, so nothing matches them. */
    leave_out = PyBaseObject_Type.tp_alloc(&PyBaseObject_Type, 0);
    fail = PyBaseObject_Type.tp_alloc(&PyBaseObject_Type, 0);
    if (str_strip == NULL || str_open_brace == NULL || str_open_bracket == NULL ||
        leave_out == NULL || fail == NULL)
        return -1;
    if (PyType_Ready(&NumericFixType) < 0 || PyType_Ready(&ScalarFixType) < 0 ||
        PyType_Ready(&ObjectFixType) < 0 || PyType_Ready(&ArrayFixType) < 0 ||
        PyType_Ready(&NullLeftOutType) < 0 || PyType_Ready(&JsonParseType) < 0 ||
        PyType_Ready(&TypedFixType) < 0 || PyType_Ready(&MemberFixType) < 0)
        return -1;
    if (PyModule_AddObjectRef(module, "NumericFix", (PyObject *)&NumericFixType) < 0 ||
        PyModule_AddObjectRef(module, "ScalarFix", (PyObject *)&ScalarFixType) < 0 ||
        PyModule_AddObjectRef(module, "ObjectFix", (PyObject *)&ObjectFixType) < 0 ||
        PyModule_AddObjectRef(module, "ArrayFix", (PyObject *)&ArrayFixType) < 0 ||
        PyModule_AddObjectRef(module, "NullLeftOut", (PyObject *)&NullLeftOutType) < 0 ||
        PyModule_AddObjectRef(module, "JsonParse", (PyObject *)&JsonParseType) < 0 ||
        PyModule_AddObjectRef(module, "TypedFix", (PyObject *)&TypedFixType) < 0 ||
        PyModule_AddObjectRef(module, "MemberFix", (PyObject *)&MemberFixType) < 0)
        return -1;
    return PyModule_AddFunctions(module, repair_methods);
}
