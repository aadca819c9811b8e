/*
 * module.c: the tensorshare._tensorshare module: its state, the exception classes and the
 * mapping of TS_E* codes onto them, the checks of int arguments, fork detection, the GIL helpers
 * for library threads, and the init function that registers every type (the Client here, the RL
 * and predictor bindings through tsp_rl_init and tsp_predictor_init).
 */
#include "tsp.h"

#include <limits.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>

tsp_state_t tsp_state;

volatile unsigned long tsp_fork_generation;

/* Runs in the child after fork(): every Client opened before belongs to the parent. */
static void on_fork_child(void)
{
    tsp_fork_generation++;
}

/* ---------------------------------------------------------------------------------------------
 * Exceptions
 */

/* One exception class: its name in the module, its bases besides Error, and its doc. */
typedef struct exc_def {
    const char *name;
    PyObject **slot;
    PyObject **parent; /* a tensorshare class to derive from instead of Error, or NULL */
    PyObject *builtin; /* the builtin base, or NULL */
    int code;          /* the class's code (set_class_code) */
    const char *doc;
} exc_def;

/*
 * Error.__init__(self, *args): the base classes' __init__, then the attributes every
 * tensorshare.Error carries, whoever made it (the package, or a program raising one itself):
 * code and name come from the class (see set_class_code) until the package sets the status's,
 * and message is the first argument as a str (KeyError's str() would quote it), or the code's
 * ts_strerror() without arguments. Bound as an instancemethod, so args[0] is self.
 */
static PyObject *error_init(PyObject *unused, PyObject *args, PyObject *kw)
{
    (void)unused;
    Py_ssize_t n = PyTuple_GET_SIZE(args);
    if (n < 1) {
        PyErr_SetString(PyExc_TypeError, "Error.__init__ needs self");
        return NULL;
    }
    PyObject *self = PyTuple_GET_ITEM(args, 0);
    PyObject *rest = PyTuple_GetSlice(args, 1, n);
    if (rest == NULL)
        return NULL;
    PyObject *super =
        PyObject_CallFunctionObjArgs((PyObject *)&PySuper_Type, tsp_state.Error, self, NULL);
    PyObject *init = super != NULL ? PyObject_GetAttrString(super, "__init__") : NULL;
    PyObject *r = init != NULL ? PyObject_Call(init, rest, kw) : NULL;
    Py_XDECREF(init);
    Py_XDECREF(super);
    PyObject *msg = NULL;
    if (r != NULL && n > 1) {
        msg = PyObject_Str(PyTuple_GET_ITEM(rest, 0));
    } else if (r != NULL) {
        PyObject *code = PyObject_GetAttrString(self, "code");
        long c = code != NULL ? PyLong_AsLong(code) : -1;
        Py_XDECREF(code);
        if (!PyErr_Occurred())
            msg = PyUnicode_FromString(c != 0 ? ts_strerror((int)c) : "");
    }
    Py_DECREF(rest);
    if (msg == NULL || PyObject_SetAttrString(self, "message", msg) < 0) {
        Py_XDECREF(msg);
        Py_XDECREF(r);
        return NULL;
    }
    Py_DECREF(msg);
    return r;
}

static PyMethodDef error_init_def = {"__init__", (PyCFunction)(void (*)(void))error_init,
                                     METH_VARARGS | METH_KEYWORDS, NULL};

/*
 * The class attributes code and name of cls: the TS_E* code its instances carry when nobody
 * set one (an instance a program made, an error the package found itself): the class's first
 * code in docs/PYTHON.md's table; 0 and "" for Error itself. 0 or -1.
 */
static int set_class_code(PyObject *cls, int code)
{
    PyObject *c = PyLong_FromLong(code);
    PyObject *name = PyUnicode_FromString(code != 0 ? ts_err_name(code) : "");
    int rc = c == NULL || name == NULL || PyObject_SetAttrString(cls, "code", c) < 0 ||
                     PyObject_SetAttrString(cls, "name", name) < 0
                 ? -1
                 : 0;
    Py_XDECREF(c);
    Py_XDECREF(name);
    return rc;
}

int tsp_exception_subclass(PyObject *module, const char *name, const char *doc, int code,
                           PyObject **out)
{
    char qualname[96];
    snprintf(qualname, sizeof(qualname), "tensorshare.%s", name);
    PyObject *cls = PyErr_NewExceptionWithDoc(qualname, doc, tsp_state.Error, NULL);
    if (cls == NULL)
        return -1;
    if (set_class_code(cls, code) < 0 || PyModule_AddObjectRef(module, name, cls) < 0) {
        Py_DECREF(cls);
        return -1;
    }
    *out = cls;
    return 0;
}

/* Makes one class with bases (parent or Error, builtin); 0 or -1. */
static int make_exception(PyObject *module, const exc_def *d)
{
    PyObject *first = d->parent != NULL ? *d->parent : tsp_state.Error;
    PyObject *bases =
        d->builtin != NULL ? PyTuple_Pack(2, first, d->builtin) : PyTuple_Pack(1, first);
    if (bases == NULL)
        return -1;
    char qualname[96];
    snprintf(qualname, sizeof(qualname), "tensorshare.%s", d->name);
    PyObject *cls = PyErr_NewExceptionWithDoc(qualname, d->doc, bases, NULL);
    Py_DECREF(bases);
    if (cls == NULL)
        return -1;
    if (set_class_code(cls, d->code) < 0) {
        Py_DECREF(cls);
        return -1;
    }
    *d->slot = cls;
    Py_INCREF(cls);
    if (PyModule_AddObject(module, d->name, cls) < 0) {
        Py_DECREF(cls);
        return -1;
    }
    return 0;
}

/* Creates Error and every subclass, and adds them to the module; 0 or -1. */
static int init_exceptions(PyObject *module)
{
    PyObject *init_fn = PyCFunction_New(&error_init_def, NULL);
    PyObject *init = init_fn != NULL ? PyInstanceMethod_New(init_fn) : NULL;
    PyObject *dict = init != NULL ? Py_BuildValue("{sO}", "__init__", init) : NULL;
    Py_XDECREF(init_fn);
    Py_XDECREF(init);
    if (dict == NULL)
        return -1;
    tsp_state.Error = PyErr_NewExceptionWithDoc(
        "tensorshare.Error",
        "Base class of every tensorshare error. Attributes: code (the TS_E* number, negative), "
        "name (such as 'ETIMEDOUT') and message (the server's or the local reason). An error "
        "found before anything was sent has the code the library gives it, or its class's "
        "code (the class attribute code: InvalidArgumentError's is EINVAL); a plain Error made "
        "by a program has code 0 and name ''.",
        PyExc_Exception, dict);
    Py_DECREF(dict);
    if (tsp_state.Error == NULL || set_class_code(tsp_state.Error, 0) < 0)
        return -1;
    Py_INCREF(tsp_state.Error);
    if (PyModule_AddObject(module, "Error", tsp_state.Error) < 0) {
        Py_DECREF(tsp_state.Error);
        return -1;
    }
    const exc_def defs[] = {
        {"TimeoutError", &tsp_state.TimeoutError, NULL, PyExc_TimeoutError, TS_ETIMEDOUT,
         "The operation did not complete in time (ETIMEDOUT)."},
        {"ConnectionError", &tsp_state.ConnectionError, NULL, PyExc_ConnectionError, TS_ENOTCONN,
         "No usable connection to tensord (ENOTCONN, ESLOW, ESHUTDOWN, ETOOMANY, EPROTO, "
         "EVERSION), or a Client used after os.fork()."},
        {"ConnectionResetError", &tsp_state.ConnectionResetError, &tsp_state.ConnectionError,
         PyExc_ConnectionResetError, TS_ECONNRESET,
         "The connection was lost while the request was in flight (ECONNRESET)."},
        {"ConnectionRefusedError", &tsp_state.ConnectionRefusedError, &tsp_state.ConnectionError,
         PyExc_ConnectionRefusedError, TS_ECONNREFUSED,
         "tensord refused the connection (ECONNREFUSED)."},
        {"BinNotFoundError", &tsp_state.BinNotFoundError, NULL, PyExc_KeyError, TS_ENOENT,
         "The bin does not exist (ENOENT)."},
        {"RecordError", &tsp_state.RecordError, NULL, PyExc_ValueError, TS_EBADRECORD,
         "A value cannot be sent as a record (refused before anything was sent), or the "
         "server found a record malformed (EBADRECORD, ETYPE, ESCHEMA)."},
        {"InvalidArgumentError", &tsp_state.InvalidArgumentError, NULL, PyExc_ValueError, TS_EINVAL,
         "An argument was refused (EINVAL, ENAMETOOLONG, EMSGSIZE)."},
        {"AuthenticationError", &tsp_state.AuthenticationError, NULL, PyExc_PermissionError,
         TS_EAUTH,
         "The token was missing or wrong (EAUTH), or the unix socket's file mode refuses this "
         "user (EACCES)."},
        {"CancelledError", &tsp_state.CancelledError, NULL, NULL, TS_ECANCELED,
         "The client was closed (ECANCELED)."},
        {"DeadlockError", &tsp_state.DeadlockError, NULL, PyExc_RuntimeError, TS_EDEADLK,
         "A blocking call was made from a callback on the client's I/O thread (EDEADLK): use "
         "the *_async form there."},
        {"ServerError", &tsp_state.ServerError, NULL, NULL, TS_ESERVER,
         "The server could not do it (EOOM, ESERVER, ESAVEFAIL, EUNKNOWNOP, EWRONGSHARD)."},
        {"VersionMismatchError", &tsp_state.VersionMismatchError, NULL, NULL, TS_ECONFLICT,
         "A put_if lost: the bin's version was not the one expected (ECONFLICT); "
         "current_version holds the bin's version (0: no such bin) to read and retry with."},
        {"StaleGradientError", &tsp_state.StaleGradientError, NULL, NULL, TS_ESTALE,
         "A sync ps_push's gradient lags its parameter by more than the tolerance (ESTALE); "
         "nothing changed; current_version holds the parameter's version to pull and retry."},
        {"BackpressureError", &tsp_state.BackpressureError, NULL, PyExc_BlockingIOError, TS_EAGAIN,
         "No room now, nothing was done (EAGAIN): a stream's window is full (a group is "
         "`window` entries behind), or RLWorker.add(block=False) found max_in_flight adds on "
         "their way. Try again later."},
    };
    for (size_t i = 0; i < sizeof(defs) / sizeof(defs[0]); i++)
        if (make_exception(module, &defs[i]) < 0)
            return -1;
    /* A class attribute: None on an instance nobody gave a version (one a program made). */
    if (PyObject_SetAttrString(tsp_state.VersionMismatchError, "current_version", Py_None) < 0 ||
        PyObject_SetAttrString(tsp_state.StaleGradientError, "current_version", Py_None) < 0)
        return -1;
    return 0;
}

PyObject *tsp_exception_class(int status)
{
    switch (status) {
    case TS_ETIMEDOUT:
        return tsp_state.TimeoutError;
    case TS_ECONNRESET:
        return tsp_state.ConnectionResetError;
    case TS_ECONNREFUSED:
        return tsp_state.ConnectionRefusedError;
    case TS_ENOTCONN:
    case TS_ESLOW:
    case TS_ESHUTDOWN:
    case TS_ETOOMANY:
    case TS_EPROTO:
    case TS_EVERSION:
        return tsp_state.ConnectionError;
    case TS_ENOENT:
        return tsp_state.BinNotFoundError;
    case TS_EBADRECORD:
    case TS_ETYPE:
    case TS_ESCHEMA:
        return tsp_state.RecordError;
    case TS_EINVAL:
    case TS_ENAMETOOLONG:
    case TS_EMSGSIZE:
        return tsp_state.InvalidArgumentError;
    case TS_EACCES:
    case TS_EAUTH:
        return tsp_state.AuthenticationError;
    case TS_ECANCELED:
        return tsp_state.CancelledError;
    case TS_EDEADLK:
        return tsp_state.DeadlockError;
    case TS_EAGAIN:
        return tsp_state.BackpressureError;
    case TS_ECONFLICT:
        return tsp_state.VersionMismatchError;
    case TS_ESTALE:
        return tsp_state.StaleGradientError;
    case TS_ESERVICE:
        return tsp_state.ServiceGoneError;
    case TS_EOOM:
    case TS_ESERVER:
    case TS_ESAVEFAIL:
    case TS_EUNKNOWNOP:
    case TS_EWRONGSHARD:
        return tsp_state.ServerError;
    case TS_ENOMEM:
        return tsp_state.Error;
    default:
        return tsp_state.Error;
    }
}

PyObject *tsp_exception_new(int status, const char *message)
{
    return tsp_exception_make(tsp_exception_class(status), status, message);
}

/*
 * The C library's words for giving a token ("TS_AUTH_TOKEN or the auth_token option", in
 * tensord's EAUTH message), and what a Python program gives instead.
 */
#define C_TOKEN_HINT  "TS_AUTH_TOKEN or the auth_token option"
#define PY_TOKEN_HINT "the Client's token= or token_file= argument, or TS_AUTH_TOKEN"

PyObject *tsp_exception_make(PyObject *cls, int status, const char *message)
{
    if (message == NULL || message[0] == '\0')
        message = status != 0 ? ts_strerror(status) : "error";
    char hinted[1024];
    const char *hint = status == TS_EAUTH ? strstr(message, C_TOKEN_HINT) : NULL;
    if (hint != NULL) {
        snprintf(hinted, sizeof(hinted), "%.*s%s%s", (int)(hint - message), message, PY_TOKEN_HINT,
                 hint + strlen(C_TOKEN_HINT));
        message = hinted;
    }
    PyObject *msg = PyUnicode_DecodeUTF8(message, (Py_ssize_t)strlen(message), "replace");
    if (msg == NULL)
        return NULL;
    PyObject *exc = PyObject_CallOneArg(cls, msg);
    if (exc == NULL) {
        Py_DECREF(msg);
        return NULL;
    }
    Py_DECREF(msg);
    if (status == 0) /* Error.__init__ gave it the class's code and the message */
        return exc;
    PyObject *code = PyLong_FromLong(status);
    PyObject *name = PyUnicode_FromString(ts_err_name(status));
    int bad = code == NULL || name == NULL || PyObject_SetAttrString(exc, "code", code) < 0 ||
              PyObject_SetAttrString(exc, "name", name) < 0;
    Py_XDECREF(code);
    Py_XDECREF(name);
    if (bad) {
        Py_DECREF(exc);
        return NULL;
    }
    return exc;
}

PyObject *tsp_raise_msg(int status, const char *message)
{
    if (status == TS_ENOMEM && (message == NULL || message[0] == '\0'))
        return PyErr_NoMemory();
    PyObject *exc = tsp_exception_new(status, message);
    if (exc == NULL)
        return NULL;
    PyErr_SetObject((PyObject *)Py_TYPE(exc), exc);
    Py_DECREF(exc);
    return NULL;
}

const char *tsp_c_string(PyObject *s)
{
    Py_ssize_t len;
    const char *u = PyUnicode_AsUTF8AndSize(s, &len);
    return u != NULL && (size_t)len != strlen(u) ? NULL : u;
}

PyObject *tsp_raise(int status)
{
    return tsp_raise_msg(status, ts_last_error());
}

PyObject *tsp_raise_versioned(int status, uint64_t version)
{
    PyObject *exc = tsp_exception_new(status, ts_last_error());
    PyObject *v = PyLong_FromUnsignedLongLong(version);
    if (exc != NULL && v != NULL && PyObject_SetAttrString(exc, "current_version", v) == 0)
        PyErr_SetObject((PyObject *)Py_TYPE(exc), exc);
    Py_XDECREF(v);
    Py_XDECREF(exc);
    return NULL;
}

/* ---------------------------------------------------------------------------------------------
 * Integer arguments
 */

/* A range's bound as the messages write it: the 64-bit extremes as powers of two. */
static const char *ubound(unsigned long long v, char *buf, size_t cap)
{
    if (v == ULLONG_MAX)
        return "2**64-1";
    snprintf(buf, cap, "%llu", v);
    return buf;
}

static const char *sbound(long long v, char *buf, size_t cap)
{
    if (v == LLONG_MIN)
        return "-2**63";
    if (v == LLONG_MAX)
        return "2**63-1";
    snprintf(buf, cap, "%lld", v);
    return buf;
}

/* ValueError (or, einval, InvalidArgumentError) for obj outside lo..hi; returns -1. */
static int range_error(PyObject *obj, const char *what, const char *lo, const char *hi, int einval)
{
    PyObject *msg =
        PyUnicode_FromFormat("%s must be an int from %s to %s, not %R", what, lo, hi, obj);
    if (msg == NULL)
        return -1;
    if (einval) {
        const char *m = PyUnicode_AsUTF8(msg);
        if (m != NULL)
            tsp_raise_msg(TS_EINVAL, m);
    } else {
        PyErr_SetObject(PyExc_ValueError, msg);
    }
    Py_DECREF(msg);
    return -1;
}

/* obj as an int (a new reference), or NULL with TypeError: a bool or no __index__. */
static PyObject *index_arg(PyObject *obj, const char *what)
{
    if (PyBool_Check(obj) || !PyIndex_Check(obj)) {
        PyErr_Format(PyExc_TypeError, "%s must be an int, not %s", what, Py_TYPE(obj)->tp_name);
        return NULL;
    }
    return PyNumber_Index(obj);
}

/* tsp_uint_arg's body; einval: InvalidArgumentError instead of ValueError. */
static int uint_arg(PyObject *obj, const char *what, unsigned long long min, unsigned long long max,
                    int einval, unsigned long long *out)
{
    if (obj == NULL)
        return 0;
    PyObject *i = index_arg(obj, what);
    if (i == NULL)
        return -1;
    unsigned long long v = PyLong_AsUnsignedLongLong(i);
    Py_DECREF(i);
    int outside = 0;
    if (v == (unsigned long long)-1 && PyErr_Occurred()) {
        if (!PyErr_ExceptionMatches(PyExc_OverflowError))
            return -1;
        PyErr_Clear(); /* negative, or over 2**64-1 */
        outside = 1;
    }
    if (outside || v < min || v > max) {
        char lo[24], hi[24];
        return range_error(obj, what, ubound(min, lo, sizeof(lo)), ubound(max, hi, sizeof(hi)),
                           einval);
    }
    *out = v;
    return 0;
}

int tsp_uint_arg(PyObject *obj, const char *what, unsigned long long min, unsigned long long max,
                 unsigned long long *out)
{
    return uint_arg(obj, what, min, max, 0, out);
}

int tsp_uint_arg_einval(PyObject *obj, const char *what, unsigned long long min,
                        unsigned long long max, unsigned long long *out)
{
    return uint_arg(obj, what, min, max, 1, out);
}

int tsp_int_arg(PyObject *obj, const char *what, long long min, long long max, long long *out)
{
    if (obj == NULL)
        return 0;
    PyObject *i = index_arg(obj, what);
    if (i == NULL)
        return -1;
    int overflow = 0;
    long long v = PyLong_AsLongLongAndOverflow(i, &overflow);
    Py_DECREF(i);
    if (v == -1 && PyErr_Occurred())
        return -1;
    if (overflow != 0 || v < min || v > max) {
        char lo[24], hi[24];
        return range_error(obj, what, sbound(min, lo, sizeof(lo)), sbound(max, hi, sizeof(hi)), 0);
    }
    *out = v;
    return 0;
}

int tsp_ms_arg(PyObject *obj, const char *what, int none_ms, int *out)
{
    if (obj == NULL || obj == Py_None) {
        *out = none_ms;
        return 0;
    }
    unsigned long long v = 0;
    if (tsp_uint_arg(obj, what, 0, INT_MAX, &v) < 0)
        return -1;
    *out = (int)v;
    return 0;
}

/* ---------------------------------------------------------------------------------------------
 * Library threads calling into Python
 */

/* Whether the interpreter has started finalizing (a private API before Python 3.13). */
static int finalizing(void)
{
#if PY_VERSION_HEX >= 0x030D0000
    return Py_IsFinalizing();
#else
    return _Py_IsFinalizing();
#endif
}

int tsp_gil_acquire(PyGILState_STATE *state)
{
    /*
     * A thread that takes the GIL while the interpreter finalizes is ended on the spot (or
     * hangs), which would take a library thread down in the middle of its work: check first.
     * The check can race with the start of finalization; atexit closes every client before
     * finalization begins, so callbacks do not arrive there in a clean shutdown.
     */
    if (finalizing())
        return 0;
    *state = PyGILState_Ensure();
    return 1;
}

void tsp_gil_release(PyGILState_STATE state)
{
    PyGILState_Release(state);
}

void tsp_report_callback_error(const char *what, PyObject *callable)
{
    if (!PyErr_Occurred())
        return;
#if PY_VERSION_HEX >= 0x030D0000
    PyErr_FormatUnraisable("Exception ignored in %s %R", what, callable);
#else
    /* sys.unraisablehook prints "Exception ignored in: <obj>"; name the callable. */
    (void)what;
    PyErr_WriteUnraisable(callable);
#endif
}

/* ---------------------------------------------------------------------------------------------
 * The module
 */

int tsp_client_type_init(PyObject *module);
int tsp_view_type_init(PyObject *module);
int tsp_convert_init(PyObject *module);

int tsp_add_type(PyObject *module, PyTypeObject *type, const char *name)
{
    if (PyType_Ready(type) < 0)
        return -1;
    Py_INCREF(type);
    if (PyModule_AddObject(module, name, (PyObject *)type) < 0) {
        Py_DECREF(type);
        return -1;
    }
    return 0;
}

static PyObject *mod_strerror(PyObject *self, PyObject *arg)
{
    (void)self;
    long long code = 0;
    if (tsp_int_arg(arg, "code", INT_MIN, INT_MAX, &code) < 0)
        return NULL;
    return PyUnicode_FromString(ts_strerror((int)code));
}

static PyMethodDef module_methods[] = {
    {"strerror", mod_strerror, METH_O, "strerror(code) -> str: the message of a TS_E* code."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT,
    .m_name = "tensorshare._tensorshare",
    .m_doc = "The C core of the tensorshare package (import tensorshare instead).",
    .m_size = -1,
    .m_methods = module_methods,
};

PyMODINIT_FUNC PyInit__tensorshare(void);

PyMODINIT_FUNC PyInit__tensorshare(void)
{
    PyObject *m = PyModule_Create(&module_def);
    if (m == NULL)
        return NULL;
    tsp_state.module = m;
    static int fork_hooked;
    if (!fork_hooked) {
        fork_hooked = 1;
        pthread_atfork(NULL, NULL, on_fork_child);
    }
    if (init_exceptions(m) < 0 || tsp_view_type_init(m) < 0 || tsp_convert_init(m) < 0 ||
        tsp_client_type_init(m) < 0 || tsp_rl_init(m) < 0 || tsp_predictor_init(m) < 0 ||
        tsp_shm_init(m) < 0 || tsp_stream_init(m) < 0 || tsp_service_init(m) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    if (PyModule_AddIntConstant(m, "MAX_NDIM", TS_MAX_NDIM) < 0 ||
        PyModule_AddIntConstant(m, "MAX_DEPTH", TS_MAX_DEPTH) < 0 ||
        PyModule_AddIntConstant(m, "MAX_NAME_LEN", TS_MAX_NAME_LEN) < 0 ||
        PyModule_AddStringConstant(m, "__version__", TS_VERSION_STRING) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
