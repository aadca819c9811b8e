/*
 * client.c: tensorshare.Client, a ts_client_t for Python.
 *
 * Blocking methods convert their arguments with the GIL held, release it around the one
 * blocking ts_ call, and convert the result after retaking it. Asynchronous methods queue the
 * request with the GIL held (the library never calls back from inside the call that queued) and
 * complete a concurrent.futures.Future from the client's I/O thread, which takes the GIL for
 * it. wait() is an asynchronous request awaited on a condition variable, so that closing the
 * client (or Ctrl-C) interrupts it.
 *
 * Lifetime: every method enters the client (users++) for as long as it may touch the
 * ts_client_t; close() marks the client closed and the last user to leave frees the
 * ts_client_t (with the GIL released: freeing joins the I/O thread, whose final callbacks take
 * the GIL). A child process after fork() never touches the parent's ts_client_t: every method
 * raises ConnectionError there and the handle is left alone (leaked, on purpose); the futures of
 * requests pending at the fork are failed there by the package's at-fork hook
 * (tensorshare/__init__.py), through _take_pending_futures.
 */
#include "tsp.h"

#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* bytes; the longest token file read (tensord's tokens are far shorter) */
#define TSP_MAX_TOKEN_FILE 4096
/* ms; how often a thread blocked in wait() retakes the GIL to let Ctrl-C through */
#define TSP_WAIT_SLICE_MS 100

typedef struct tsp_client {
    PyObject_HEAD ts_client_t *c; /* NULL before opening and once freed */
    unsigned long fork_gen;       /* tsp_fork_generation when opened */
    int closed;                   /* close() was called (under the GIL) */
    long users;                   /* calls and objects inside (under the GIL) */
    tsp_tensor_type_t tt;         /* TSP_TENSOR_DEFAULT: the process default */
    PyObject *address;            /* str */
    PyObject *kept;               /* list (or NULL) of what tsp_client_keep keeps until freed */
    struct tsp_client *prev;      /* the list of open clients (for atexit), under the GIL */
    struct tsp_client *next;
    PyObject *weakreflist;
} tsp_client;

static tsp_client *open_clients;

static PyObject *future_class; /* concurrent.futures.Future, imported on first use */
static PyObject *s_set_result, *s_set_exception, *s_set_running;

/* ---------------------------------------------------------------------------------------------
 * Lifetime
 */

static void list_unlink(tsp_client *self)
{
    if (self->prev != NULL)
        self->prev->next = self->next;
    else if (open_clients == self)
        open_clients = self->next;
    if (self->next != NULL)
        self->next->prev = self->prev;
    self->prev = self->next = NULL;
}

/* Frees the handle once closed and unused. GIL held; releases it while freeing. */
static void maybe_free(tsp_client *self)
{
    if (!self->closed || self->users > 0 || self->c == NULL)
        return;
    ts_client_t *c = self->c;
    self->c = NULL;
    list_unlink(self);
    if (self->fork_gen != tsp_fork_generation)
        return; /* the parent's: its I/O thread does not exist here (kept is leaked with it) */
    PyThreadState *nogil = PyEval_SaveThread();
    ts_client_free(c);
    PyEval_RestoreThread(nogil);
    Py_CLEAR(self->kept); /* every request has had its callback: nothing reads them any more */
}

static int check_usable(tsp_client *self)
{
    if (self->fork_gen != tsp_fork_generation && self->c != NULL) {
        PyObject *exc = tsp_exception_make(
            tsp_state.ConnectionError, TS_ENOTCONN,
            "this Client was opened in the parent process and cannot be used after os.fork(): "
            "open a new Client in the child");
        if (exc != NULL) {
            PyErr_SetObject(tsp_state.ConnectionError, exc);
            Py_DECREF(exc);
        }
        return -1;
    }
    if (self->closed || self->c == NULL) {
        tsp_raise_msg(TS_ECANCELED, self->c == NULL && !self->closed ? "the Client is not open"
                                                                     : "the Client is closed");
        return -1;
    }
    return 0;
}

static ts_client_t *enter(tsp_client *self)
{
    if (check_usable(self) < 0)
        return NULL;
    self->users++;
    return self->c;
}

static void leave(tsp_client *self)
{
    self->users--;
    maybe_free(self);
}

ts_client_t *tsp_client_enter(PyObject *obj)
{
    if (!PyObject_TypeCheck(obj, tsp_state.ClientType)) {
        PyErr_Format(PyExc_TypeError, "a tensorshare.Client is required, not %s",
                     Py_TYPE(obj)->tp_name);
        return NULL;
    }
    return enter((tsp_client *)obj);
}

void tsp_client_leave(PyObject *obj)
{
    leave((tsp_client *)obj);
}

int tsp_client_keep(PyObject *obj, PyObject *item)
{
    tsp_client *self = (tsp_client *)obj;
    if (self->kept == NULL && (self->kept = PyList_New(0)) == NULL)
        return -1;
    return PyList_Append(self->kept, item);
}

int tsp_client_cancelled(PyObject *obj)
{
    if (!((tsp_client *)obj)->closed)
        return 0;
    tsp_raise_msg(TS_ECANCELED, "the Client was closed during the wait");
    return 1;
}

tsp_tensor_type_t tsp_client_tensor_type(PyObject *obj)
{
    tsp_tensor_type_t tt = ((tsp_client *)obj)->tt;
    return tt != TSP_TENSOR_DEFAULT ? tt : tsp_tensor_type_default();
}

int tsp_client_tensor_type_arg(PyObject *obj, PyObject *client, tsp_tensor_type_t *out)
{
    tsp_tensor_type_t dflt = tsp_client_tensor_type(client);
    if (dflt == TSP_TENSOR_DEFAULT || tsp_tensor_type_from_py(obj, dflt, out) < 0)
        return -1;
    return tsp_tensor_type_ready(*out);
}

/* Marks the client closed and frees it unless it is in use (then the last user does). */
static void do_close(tsp_client *self)
{
    self->closed = 1;
    maybe_free(self);
}

/* ---------------------------------------------------------------------------------------------
 * Arguments
 */

/*
 * Binds vectorcall arguments to names: positional ones first (at most npos), then keywords.
 * out[i] is borrowed, or NULL when not given; the first nreq are required. 0 or -1.
 */
static int bind(const char *fn, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames,
                const char *const *names, int nnames, int npos, int nreq, PyObject **out)
{
    for (int i = 0; i < nnames; i++)
        out[i] = NULL;
    if (nargs > npos) {
        PyErr_Format(PyExc_TypeError, "%s() takes at most %d positional arguments (%zd given)", fn,
                     npos, nargs);
        return -1;
    }
    for (Py_ssize_t i = 0; i < nargs; i++)
        out[i] = args[i];
    Py_ssize_t nkw = kwnames != NULL ? PyTuple_GET_SIZE(kwnames) : 0;
    for (Py_ssize_t k = 0; k < nkw; k++) {
        PyObject *key = PyTuple_GET_ITEM(kwnames, k);
        int found = 0;
        for (int i = 0; i < nnames; i++) {
            if (PyUnicode_CompareWithASCIIString(key, names[i]) == 0) {
                if (out[i] != NULL) {
                    PyErr_Format(PyExc_TypeError, "%s() got multiple values for argument '%s'", fn,
                                 names[i]);
                    return -1;
                }
                out[i] = args[nargs + k];
                found = 1;
                break;
            }
        }
        if (!found) {
            PyErr_Format(PyExc_TypeError, "%s() got an unexpected keyword argument %R", fn, key);
            return -1;
        }
    }
    for (int i = 0; i < nreq; i++) {
        if (out[i] == NULL) {
            PyErr_Format(PyExc_TypeError, "%s() missing required argument '%s'", fn, names[i]);
            return -1;
        }
    }
    return 0;
}

/*
 * The UTF-8 of a str argument that the library takes as a C string (valid while the str lives),
 * refusing NUL characters, which would silently cut it short; NULL with a ValueError.
 */
static const char *c_string_arg(PyObject *s, const char *what)
{
    Py_ssize_t len;
    const char *u = PyUnicode_AsUTF8AndSize(s, &len);
    if (u == NULL)
        return NULL;
    if ((size_t)len != strlen(u)) {
        PyErr_Format(PyExc_ValueError, "%s cannot contain NUL characters", what);
        return NULL;
    }
    return u;
}

/* The UTF-8 of a bin name (valid while the str lives); NULL with an exception. */
static const char *bin_name(PyObject *obj)
{
    if (!PyUnicode_Check(obj)) {
        PyErr_Format(PyExc_TypeError, "a bin name is a str, not %s", Py_TYPE(obj)->tp_name);
        return NULL;
    }
    Py_ssize_t len;
    const char *s = PyUnicode_AsUTF8AndSize(obj, &len);
    if (s == NULL)
        return NULL;
    if ((size_t)len != strlen(s)) {
        tsp_raise_msg(TS_EINVAL, "a bin name cannot contain NUL characters");
        return NULL;
    }
    return s;
}

/* A count argument (None or absent: 0), 0..PY_SSIZE_T_MAX; -1 with an exception. */
static int size_arg(PyObject *obj, const char *what, size_t *out)
{
    unsigned long long v = 0;
    if (obj != Py_None && tsp_uint_arg(obj, what, 0, PY_SSIZE_T_MAX, &v) < 0)
        return -1;
    *out = (size_t)v;
    return 0;
}

/* A version argument (None or absent: 0), 0..2**64-1; -1 with an exception. */
static int version_arg(PyObject *obj, const char *what, unsigned long long *out)
{
    *out = 0;
    return obj != Py_None ? tsp_uint_arg(obj, what, 0, UINT64_MAX, out) : 0;
}

/*
 * Seconds (a number, or None) to the library's milliseconds: none_ms for None, 0 for 0,
 * otherwise rounded up so that a tiny positive timeout still waits. Where None means no limit
 * (none_ms TS_TIMEOUT_INFINITE), math.inf means it too, as for the RL helpers and the
 * predictor. -1 with an exception.
 */
static int timeout_arg(PyObject *obj, int none_ms, int *out)
{
    if (obj == NULL || obj == Py_None) {
        *out = none_ms;
        return 0;
    }
    double s = PyFloat_AsDouble(obj);
    if (s == -1.0 && PyErr_Occurred())
        return -1;
    int inf_ok = none_ms == TS_TIMEOUT_INFINITE;
    if (inf_ok && isinf(s) && s > 0) {
        *out = TS_TIMEOUT_INFINITE;
        return 0;
    }
    if (!(s >= 0) || s > 2e6) {
        PyErr_Format(PyExc_ValueError,
                     inf_ok ? "a timeout is a number of seconds from 0 to 2000000, or inf or None "
                              "(no limit), not %R"
                            : "a timeout is a number of seconds from 0 to 2000000, or None, not %R",
                     obj);
        return -1;
    }
    *out = (int)ceil(s * 1000.0);
    return 0;
}

/* ---------------------------------------------------------------------------------------------
 * Opening and closing
 */

/* Reads a token file (trailing whitespace dropped) into buf; -1 with an exception. */
static int read_token_file(PyObject *path, char *buf, size_t cap)
{
    PyObject *bytes = NULL;
    if (!PyUnicode_FSConverter(path, &bytes))
        return -1;
    FILE *f = fopen(PyBytes_AS_STRING(bytes), "rb");
    if (f == NULL) {
        PyErr_SetFromErrnoWithFilenameObject(PyExc_OSError, path);
        Py_DECREF(bytes);
        return -1;
    }
    size_t n = fread(buf, 1, cap - 1, f);
    int bad = ferror(f);
    /* Whether anything is left: a longer token would be cut short, never to match. */
    int longer = !bad && n == cap - 1 && fgetc(f) != EOF;
    fclose(f);
    Py_DECREF(bytes);
    if (bad) {
        PyErr_SetFromErrnoWithFilenameObject(PyExc_OSError, path);
        return -1;
    }
    if (longer) {
        PyErr_Format(PyExc_ValueError, "the token file %R is longer than %d bytes", path,
                     (int)(cap - 1));
        return -1;
    }
    while (n > 0 &&
           (buf[n - 1] == '\n' || buf[n - 1] == '\r' || buf[n - 1] == ' ' || buf[n - 1] == '\t'))
        n--;
    buf[n] = '\0';
    if (strlen(buf) != n) {
        PyErr_Format(PyExc_ValueError, "the token file %R holds a NUL byte", path);
        return -1;
    }
    return 0;
}

static int client_init(PyObject *obj, PyObject *args, PyObject *kwargs)
{
    tsp_client *self = (tsp_client *)obj;
    static char *kwlist[] = {"address",         "token",       "token_file", "timeout",
                             "connect_timeout", "tensor_type", NULL};
    PyObject *address = NULL, *token = Py_None, *token_file = Py_None, *timeout = Py_None,
             *connect_timeout = Py_None, *tensor_type = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "|U$OOOOO:Client", kwlist, &address, &token,
                                     &token_file, &timeout, &connect_timeout, &tensor_type))
        return -1;
    if (self->c != NULL || self->closed) {
        PyErr_SetString(PyExc_RuntimeError, "Client.__init__ called twice");
        return -1;
    }
    ts_client_options_t opts;
    ts_client_options_init(&opts);
    if (timeout != Py_None && timeout_arg(timeout, 0, &opts.request_timeout_ms) < 0)
        return -1;
    if (connect_timeout != Py_None && timeout_arg(connect_timeout, 0, &opts.connect_timeout_ms) < 0)
        return -1;
    if ((timeout != Py_None && opts.request_timeout_ms == 0) ||
        (connect_timeout != Py_None && opts.connect_timeout_ms == 0)) {
        PyErr_SetString(PyExc_ValueError, "a client's timeouts must be positive");
        return -1;
    }
    if (tsp_tensor_type_from_py(tensor_type, TSP_TENSOR_DEFAULT, &self->tt) < 0)
        return -1;
    char token_buf[TSP_MAX_TOKEN_FILE];
    if (token != Py_None && token_file != Py_None) {
        PyErr_SetString(PyExc_ValueError, "give token or token_file, not both");
        return -1;
    }
    if (token != Py_None) {
        if (!PyUnicode_Check(token)) {
            PyErr_SetString(PyExc_TypeError, "token must be a str");
            return -1;
        }
        opts.auth_token = c_string_arg(token, "a token");
        if (opts.auth_token == NULL)
            return -1;
    } else if (token_file != Py_None) {
        if (read_token_file(token_file, token_buf, sizeof(token_buf)) < 0)
            return -1;
        opts.auth_token = token_buf;
    }
    /* A plain path is a unix socket. */
    PyObject *addr;
    if (address == NULL)
        addr = PyUnicode_FromString("127.0.0.1:8000");
    else if (PyUnicode_GET_LENGTH(address) > 0 && PyUnicode_READ_CHAR(address, 0) == '/')
        addr = PyUnicode_FromFormat("unix:%U", address);
    else {
        addr = address;
        Py_INCREF(addr);
    }
    if (addr == NULL)
        return -1;
    const char *a = c_string_arg(addr, "an address");
    if (a == NULL) {
        Py_DECREF(addr);
        return -1;
    }
    ts_client_t *c = NULL;
    int rc;
    Py_BEGIN_ALLOW_THREADS rc = ts_client_open(&c, a, &opts);
    Py_END_ALLOW_THREADS if (rc != 0)
    {
        Py_DECREF(addr);
        tsp_raise(rc);
        return -1;
    }
    Py_XSETREF(self->address, addr);
    self->c = c;
    self->fork_gen = tsp_fork_generation;
    self->next = open_clients;
    if (open_clients != NULL)
        open_clients->prev = self;
    open_clients = self;
    return 0;
}

static void client_dealloc(PyObject *obj)
{
    tsp_client *self = (tsp_client *)obj;
    if (self->weakreflist != NULL)
        PyObject_ClearWeakRefs(obj);
    self->closed = 1;
    self->users = 0; /* nothing can be inside: they would hold a reference */
    maybe_free(self);
    Py_CLEAR(self->address);
    Py_TYPE(obj)->tp_free(obj);
}

static PyObject *client_close(PyObject *obj, PyObject *unused)
{
    (void)unused;
    do_close((tsp_client *)obj);
    Py_RETURN_NONE;
}

static PyObject *client_enter_cm(PyObject *obj, PyObject *unused)
{
    (void)unused;
    if (check_usable((tsp_client *)obj) < 0)
        return NULL;
    Py_INCREF(obj);
    return obj;
}

static PyObject *client_exit_cm(PyObject *obj, PyObject *const *args, Py_ssize_t nargs)
{
    (void)args;
    (void)nargs;
    do_close((tsp_client *)obj);
    Py_RETURN_FALSE;
}

/* Closes every client still open (atexit: before the interpreter finalizes). */
static PyObject *close_all(PyObject *module, PyObject *unused)
{
    (void)module;
    (void)unused;
    /*
     * Take the head each time: closing releases the GIL, and other threads may open or close
     * clients meanwhile. A client that a thread is still inside stays open until that call
     * returns (it is bounded by the request timeout), or the process exits first.
     */
    while (open_clients != NULL) {
        tsp_client *self = open_clients;
        list_unlink(self);
        if (self->fork_gen != tsp_fork_generation)
            continue; /* the parent's, in a child: leave it alone */
        Py_INCREF(self);
        do_close(self);
        Py_DECREF(self);
    }
    Py_RETURN_NONE;
}

/* ---------------------------------------------------------------------------------------------
 * Blocking operations
 */

static PyObject *put_impl(PyObject *obj, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames,
                          int append)
{
    static const char *const names[] = {"bin", "value"};
    PyObject *a[2];
    const char *fn = append ? "append" : "put";
    if (bind(fn, args, nargs, kwnames, names, 2, 2, 2, a) < 0)
        return NULL;
    const char *bin = bin_name(a[0]);
    if (bin == NULL)
        return NULL;
    tsp_client *self = (tsp_client *)obj;
    ts_client_t *c = enter(self);
    if (c == NULL)
        return NULL;
    tsp_send_t s;
    if (tsp_send_init(&s, a[1]) < 0) {
        leave(self);
        return NULL;
    }
    uint64_t version = 0;
    int rc;
    Py_BEGIN_ALLOW_THREADS rc =
        append ? ts_append(c, bin, s.value, &version) : ts_put(c, bin, s.value, &version);
    Py_END_ALLOW_THREADS PyObject *r =
        rc == 0 ? PyLong_FromUnsignedLongLong(version) : tsp_raise(rc);
    tsp_send_clear(&s);
    leave(self);
    return r;
}

static PyObject *client_put(PyObject *obj, PyObject *const *args, Py_ssize_t nargs,
                            PyObject *kwnames)
{
    return put_impl(obj, args, nargs, kwnames, 0);
}

static PyObject *client_append(PyObject *obj, PyObject *const *args, Py_ssize_t nargs,
                               PyObject *kwnames)
{
    return put_impl(obj, args, nargs, kwnames, 1);
}

static PyObject *get_impl(PyObject *obj, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames,
                          int peek)
{
    static const char *const names[] = {"bin", "max_items", "tensor_type", "ref"};
    PyObject *a[4];
    const char *fn = peek ? "peek" : "get";
    if (bind(fn, args, nargs, kwnames, names, 4, 2, 1, a) < 0)
        return NULL;
    const char *bin = bin_name(a[0]);
    size_t max_items;
    if (bin == NULL || size_arg(a[1], "max_items", &max_items) < 0)
        return NULL;
    /* ref=True: large items as read-only mappings of the server's memory (python/src/shm.c). */
    int ref = a[3] == NULL ? 0 : PyObject_IsTrue(a[3]);
    if (ref < 0)
        return NULL;
    tsp_client *self = (tsp_client *)obj;
    tsp_tensor_type_t tt;
    if (tsp_tensor_type_from_py(a[2], self->tt, &tt) < 0 || tsp_tensor_type_ready(tt) < 0)
        return NULL;
    ts_client_t *c = enter(self);
    if (c == NULL)
        return NULL;
    ts_items_t *items = NULL;
    int rc;
    Py_BEGIN_ALLOW_THREADS if (ref) rc =
        peek ? ts_peek_ref(c, bin, max_items, &items) : ts_get_ref(c, bin, max_items, &items);
    else rc = peek ? ts_peek(c, bin, max_items, &items) : ts_get(c, bin, max_items, &items);
    Py_END_ALLOW_THREADS PyObject *r;
    if (rc == 0) {
        r = peek ? tsp_items_to_py(items, tt) : tsp_taken_items_to_py(items, tt);
        ts_items_free(items);
    } else {
        r = tsp_raise(rc);
    }
    leave(self);
    return r;
}

static PyObject *client_get(PyObject *obj, PyObject *const *args, Py_ssize_t nargs,
                            PyObject *kwnames)
{
    return get_impl(obj, args, nargs, kwnames, 0);
}

static PyObject *client_peek(PyObject *obj, PyObject *const *args, Py_ssize_t nargs,
                             PyObject *kwnames)
{
    return get_impl(obj, args, nargs, kwnames, 1);
}

static PyObject *client_delete(PyObject *obj, PyObject *const *args, Py_ssize_t nargs,
                               PyObject *kwnames)
{
    static const char *const names[] = {"bin"};
    PyObject *a[1];
    if (bind("delete", args, nargs, kwnames, names, 1, 1, 1, a) < 0)
        return NULL;
    const char *bin = bin_name(a[0]);
    if (bin == NULL)
        return NULL;
    tsp_client *self = (tsp_client *)obj;
    ts_client_t *c = enter(self);
    if (c == NULL)
        return NULL;
    uint32_t n = 0;
    int rc;
    Py_BEGIN_ALLOW_THREADS rc = ts_delete(c, bin, &n);
    Py_END_ALLOW_THREADS PyObject *r = rc == 0 ? PyLong_FromUnsignedLong(n) : tsp_raise(rc);
    leave(self);
    return r;
}

/* {name: BinInfo(n_items, bytes, version)} of a list reply. */
static PyObject *bins_to_py(const ts_bin_list_t *l)
{
    PyObject *d = PyDict_New();
    if (d == NULL)
        return NULL;
    for (size_t i = 0; i < l->count; i++) {
        const ts_bin_info_t *b = &l->bins[i];
        PyObject *info = PyStructSequence_New((PyTypeObject *)tsp_state.BinInfoType);
        if (info == NULL) {
            Py_DECREF(d);
            return NULL;
        }
        PyStructSequence_SET_ITEM(info, 0, PyLong_FromUnsignedLong(b->n_items));
        PyStructSequence_SET_ITEM(info, 1, PyLong_FromUnsignedLongLong(b->bytes));
        PyStructSequence_SET_ITEM(info, 2, PyLong_FromUnsignedLongLong(b->version));
        PyObject *name =
            PyUnicode_DecodeUTF8(b->name, (Py_ssize_t)strlen(b->name), "surrogateescape");
        int rc = name != NULL && !PyErr_Occurred() ? PyDict_SetItem(d, name, info) : -1;
        Py_XDECREF(name);
        Py_DECREF(info);
        if (rc < 0) {
            Py_DECREF(d);
            return NULL;
        }
    }
    return d;
}

static PyObject *client_list(PyObject *obj, PyObject *unused)
{
    (void)unused;
    tsp_client *self = (tsp_client *)obj;
    ts_client_t *c = enter(self);
    if (c == NULL)
        return NULL;
    ts_bin_list_t *l = NULL;
    int rc;
    Py_BEGIN_ALLOW_THREADS rc = ts_list(c, &l);
    Py_END_ALLOW_THREADS PyObject *r;
    if (rc == 0) {
        r = bins_to_py(l);
        ts_bin_list_free(l);
    } else {
        r = tsp_raise(rc);
    }
    leave(self);
    return r;
}

static PyObject *client_stats(PyObject *obj, PyObject *unused)
{
    (void)unused;
    tsp_client *self = (tsp_client *)obj;
    ts_client_t *c = enter(self);
    if (c == NULL)
        return NULL;
    ts_value_t *v = NULL;
    int rc;
    Py_BEGIN_ALLOW_THREADS rc = ts_stats(c, &v);
    Py_END_ALLOW_THREADS PyObject *r = rc == 0 ? tsp_value_to_py_owned(v, self->tt) : tsp_raise(rc);
    leave(self);
    return r;
}

PyObject *tsp_client_info(PyObject *client, PyObject *args, PyObject *kw, const char *format,
                          tsp_info_fn info)
{
    static char *names[] = {"name", NULL};
    const char *name;
    if (!PyArg_ParseTupleAndKeywords(args, kw, format, names, &name))
        return NULL;
    ts_client_t *c = tsp_client_enter(client);
    if (c == NULL)
        return NULL;
    ts_value_t *v = NULL;
    int rc;
    Py_BEGIN_ALLOW_THREADS rc = info(c, name, &v);
    Py_END_ALLOW_THREADS PyObject *r =
        rc == 0 ? tsp_value_to_py_owned(v, ((tsp_client *)client)->tt) : tsp_raise(rc);
    tsp_client_leave(client);
    return r;
}

/* ping and save: no arguments, no result. */
static PyObject *simple_impl(PyObject *obj, int save)
{
    tsp_client *self = (tsp_client *)obj;
    ts_client_t *c = enter(self);
    if (c == NULL)
        return NULL;
    int rc;
    Py_BEGIN_ALLOW_THREADS rc = save ? ts_save(c) : ts_ping(c);
    Py_END_ALLOW_THREADS PyObject *r = NULL;
    if (rc == 0) {
        r = Py_None;
        Py_INCREF(r);
    } else {
        tsp_raise(rc);
    }
    leave(self);
    return r;
}

static PyObject *client_ping(PyObject *obj, PyObject *unused)
{
    (void)unused;
    return simple_impl(obj, 0);
}

static PyObject *client_save(PyObject *obj, PyObject *unused)
{
    (void)unused;
    return simple_impl(obj, 1);
}

/* ---------------------------------------------------------------------------------------------
 * wait: an asynchronous request awaited on a condition variable
 */

typedef struct wait_ctx {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int refs; /* the caller and the callback; under mu */
    int done;
    int status;
    uint64_t version;
    uint32_t n_items;
    char msg[TS_MAX_ERROR_LEN + 1];
} wait_ctx;

static void wait_ctx_unref_locked(wait_ctx *w)
{
    int last = --w->refs == 0;
    pthread_mutex_unlock(&w->mu);
    if (last) {
        pthread_cond_destroy(&w->cv);
        pthread_mutex_destroy(&w->mu);
        free(w);
    }
}

/* On the I/O thread; needs no GIL. */
static void wait_cb(ts_client_t *c, int status, ts_result_t *res, void *arg)
{
    (void)c;
    wait_ctx *w = arg;
    pthread_mutex_lock(&w->mu);
    w->status = status;
    if (res != NULL) {
        w->version = res->version;
        w->n_items = res->n_items;
    }
    if (status != 0)
        snprintf(w->msg, sizeof(w->msg), "%s", ts_last_error());
    w->done = 1;
    pthread_cond_signal(&w->cv);
    wait_ctx_unref_locked(w);
}

static PyObject *client_wait(PyObject *obj, PyObject *const *args, Py_ssize_t nargs,
                             PyObject *kwnames)
{
    static const char *const names[] = {"bin", "after_version", "timeout"};
    PyObject *a[3];
    if (bind("wait", args, nargs, kwnames, names, 3, 3, 1, a) < 0)
        return NULL;
    const char *bin = bin_name(a[0]);
    if (bin == NULL)
        return NULL;
    unsigned long long after = 0;
    if (version_arg(a[1], "after_version", &after) < 0)
        return NULL;
    int timeout_ms;
    if (timeout_arg(a[2], TS_TIMEOUT_INFINITE, &timeout_ms) < 0)
        return NULL;
    tsp_client *self = (tsp_client *)obj;
    ts_client_t *c = enter(self);
    if (c == NULL)
        return NULL;
    /*
     * Ask once without waiting first: it answers at once when the bin has moved on already
     * (and for timeout 0), and it is how a call from a callback on this client's I/O thread
     * learns that it would wait for itself (TS_EDEADLK), which the condition variable below
     * could not tell. When tensord did not answer it (the client's own timeout), the call ends
     * with that: a second request would add another request timeout to the promised bound
     * (timeout plus one request timeout). The wait below gets what is left of the timeout.
     */
    uint64_t now_version = 0;
    uint32_t now_items = 0;
    int rc;
    int no_reply = 0;
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    Py_BEGIN_ALLOW_THREADS rc = ts_wait(c, bin, (uint64_t)after, 0, &now_version, &now_items);
    no_reply = rc == TS_ETIMEDOUT && ts_last_error_no_reply();
    Py_END_ALLOW_THREADS clock_gettime(CLOCK_MONOTONIC, &t1);
    int64_t took_ms = (int64_t)(t1.tv_sec - t0.tv_sec) * 1000 + (t1.tv_nsec - t0.tv_nsec) / 1000000;
    if (timeout_ms > 0 && rc == TS_ETIMEDOUT && !no_reply)
        timeout_ms = took_ms >= timeout_ms ? 0 : timeout_ms - (int)took_ms;
    if (rc != TS_ETIMEDOUT || timeout_ms == 0 || no_reply) {
        PyObject *r = rc == 0 ? Py_BuildValue("(KI)", (unsigned long long)now_version,
                                              (unsigned int)now_items)
                              : tsp_raise(rc);
        leave(self);
        return r;
    }
    if (check_usable(self) < 0) { /* closed by another thread meanwhile */
        leave(self);
        return NULL;
    }
    wait_ctx *w = calloc(1, sizeof(*w));
    if (w == NULL) {
        leave(self);
        return PyErr_NoMemory();
    }
    pthread_mutex_init(&w->mu, NULL);
    pthread_cond_init(&w->cv, NULL);
    w->refs = 2;
    rc = ts_wait_async(c, bin, (uint64_t)after, timeout_ms, wait_cb, w);
    if (rc != 0) {
        tsp_raise(rc);
        leave(self);
        pthread_mutex_lock(&w->mu);
        w->refs--; /* the callback's: it never comes */
        wait_ctx_unref_locked(w);
        return NULL;
    }
    /* From here the callback holds the request; the client may close while we sleep. */
    leave(self);
    int done = 0;
    while (!done) {
        Py_BEGIN_ALLOW_THREADS pthread_mutex_lock(&w->mu);
        if (!w->done) {
            struct timespec ts;
            clock_gettime(CLOCK_REALTIME, &ts);
            ts.tv_nsec += (long)TSP_WAIT_SLICE_MS * 1000000L;
            if (ts.tv_nsec >= 1000000000L) {
                ts.tv_sec++;
                ts.tv_nsec -= 1000000000L;
            }
            pthread_cond_timedwait(&w->cv, &w->mu, &ts);
        }
        done = w->done;
        pthread_mutex_unlock(&w->mu);
        Py_END_ALLOW_THREADS if (!done && PyErr_CheckSignals() < 0)
        {
            /* Ctrl-C: give up; the callback frees the request when it comes. */
            pthread_mutex_lock(&w->mu);
            wait_ctx_unref_locked(w);
            return NULL;
        }
    }
    PyObject *r;
    if (w->status == 0)
        r = Py_BuildValue("(KI)", (unsigned long long)w->version, (unsigned int)w->n_items);
    else
        r = tsp_raise_msg(w->status, w->msg);
    pthread_mutex_lock(&w->mu);
    wait_ctx_unref_locked(w);
    return r;
}

/* ---------------------------------------------------------------------------------------------
 * Asynchronous operations: concurrent.futures.Future
 */

enum async_op {
    OP_PUT,
    OP_APPEND,
    OP_GET,
    OP_PEEK,
    OP_DELETE,
    OP_LIST,
    OP_WAIT,
    OP_STATS,
    OP_PING
};

typedef struct async_ctx {
    tsp_pending pend; /* the future, and the link in pending_async while queued */
    enum async_op op;
    tsp_tensor_type_t tt;
    tsp_send_t send; /* put and append: the record and its pins, until the callback */
} async_ctx;

/* Every request queued and not completed yet (see tsp_pending). Under the GIL. */
static tsp_pending *pending_async;

void tsp_pending_link(tsp_pending **head, tsp_pending *p)
{
    p->prev = NULL;
    p->next = *head;
    if (*head != NULL)
        (*head)->prev = p;
    *head = p;
}

void tsp_pending_unlink(tsp_pending **head, tsp_pending *p)
{
    if (p->prev != NULL)
        p->prev->next = p->next;
    else if (*head == p)
        *head = p->next;
    if (p->next != NULL)
        p->next->prev = p->prev;
    p->prev = p->next = NULL;
}

PyObject *tsp_pending_take(tsp_pending **head, const char *message)
{
    PyObject *out = PyList_New(0);
    if (out == NULL)
        return NULL;
    while (*head != NULL) {
        tsp_pending *p = *head;
        tsp_pending_unlink(head, p);
        PyObject *f = p->future;
        p->future = NULL;
        if (f == NULL)
            continue;
        PyObject *exc = tsp_exception_make(tsp_state.ConnectionError, TS_ENOTCONN, message);
        PyObject *pair = exc != NULL ? PyTuple_Pack(2, f, exc) : NULL;
        Py_XDECREF(exc);
        Py_DECREF(f);
        if (pair == NULL || PyList_Append(out, pair) < 0) {
            Py_XDECREF(pair);
            Py_DECREF(out);
            return NULL;
        }
        Py_DECREF(pair);
    }
    return out;
}

/* In a child process after fork() (the package's os.register_at_fork hook). */
static PyObject *take_pending_futures(PyObject *module, PyObject *unused)
{
    (void)module;
    (void)unused;
    return tsp_pending_take(&pending_async,
                            "this request was made in the parent process before os.fork(): its "
                            "result exists only there (open a new Client in the child)");
}

static PyObject *new_future(void)
{
    if (future_class == NULL) {
        PyObject *m = PyImport_ImportModule("concurrent.futures");
        if (m == NULL)
            return NULL;
        future_class = PyObject_GetAttrString(m, "Future");
        Py_DECREF(m);
        if (future_class == NULL)
            return NULL;
    }
    PyObject *f = PyObject_CallNoArgs(future_class);
    if (f == NULL)
        return NULL;
    /* Running from the start: a request on the wire cannot be cancelled. */
    PyObject *r = PyObject_CallMethodNoArgs(f, s_set_running);
    if (r == NULL) {
        Py_DECREF(f);
        return NULL;
    }
    Py_DECREF(r);
    return f;
}

/* The result object of a completed asynchronous operation; NULL with an exception. */
static PyObject *async_result(async_ctx *a, ts_result_t *res)
{
    switch (a->op) {
    case OP_PUT:
    case OP_APPEND:
        return PyLong_FromUnsignedLongLong(res->version);
    case OP_GET:
        return tsp_taken_items_to_py(res->items, a->tt);
    case OP_PEEK:
        return tsp_items_to_py(res->items, a->tt);
    case OP_DELETE:
        return PyLong_FromUnsignedLong(res->n_items);
    case OP_LIST:
        return bins_to_py(res->bins);
    case OP_WAIT:
        return Py_BuildValue("(KI)", (unsigned long long)res->version, (unsigned int)res->n_items);
    case OP_STATS: {
        ts_value_t *v = res->value;
        res->value = NULL; /* ours now: the views may keep it */
        return tsp_value_to_py_owned(v, a->tt);
    }
    case OP_PING:
    default:
        Py_RETURN_NONE;
    }
}

/* On the I/O thread: completes the future with the GIL taken. */
static void async_cb(ts_client_t *c, int status, ts_result_t *res, void *arg)
{
    (void)c;
    async_ctx *a = arg;
    char msg[TS_MAX_ERROR_LEN + 1] = "";
    if (status != 0)
        snprintf(msg, sizeof(msg), "%s", ts_last_error());
    PyGILState_STATE g;
    if (!tsp_gil_acquire(&g))
        return; /* finalizing: the future and the pins are left as they are */
    tsp_pending_unlink(&pending_async, &a->pend);
    PyObject *value = status == 0 ? async_result(a, res) : tsp_exception_new(status, msg);
    PyObject *r = NULL;
    if (value != NULL) {
        PyObject *meth = status == 0 ? s_set_result : s_set_exception;
        r = PyObject_CallMethodOneArg(a->pend.future, meth, value);
        Py_DECREF(value);
    } else {
        /* The result could not be built: the future gets that exception instead. */
        PyObject *type, *val, *tb;
        PyErr_Fetch(&type, &val, &tb);
        PyErr_NormalizeException(&type, &val, &tb);
        if (val != NULL)
            r = PyObject_CallMethodOneArg(a->pend.future, s_set_exception, val);
        Py_XDECREF(type);
        Py_XDECREF(val);
        Py_XDECREF(tb);
    }
    if (r == NULL)
        tsp_report_callback_error("a tensorshare future's completion", a->pend.future);
    Py_XDECREF(r);
    tsp_send_clear(&a->send);
    Py_DECREF(a->pend.future);
    free(a);
    tsp_gil_release(g);
}

static PyObject *async_op(PyObject *obj, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames,
                          enum async_op op)
{
    static const char *const put_names[] = {"bin", "value"};
    static const char *const get_names[] = {"bin", "max_items", "tensor_type"};
    static const char *const bin_names[] = {"bin"};
    static const char *const wait_names[] = {"bin", "after_version", "timeout"};
    static const char *const fn[] = {"put_async",  "append_async", "get_async",
                                     "peek_async", "delete_async", "list_async",
                                     "wait_async", "stats_async",  "ping_async"};
    PyObject *a[3] = {NULL, NULL, NULL};
    int rc = 0;
    switch (op) {
    case OP_PUT:
    case OP_APPEND:
        rc = bind(fn[op], args, nargs, kwnames, put_names, 2, 2, 2, a);
        break;
    case OP_GET:
    case OP_PEEK:
        rc = bind(fn[op], args, nargs, kwnames, get_names, 3, 2, 1, a);
        break;
    case OP_DELETE:
        rc = bind(fn[op], args, nargs, kwnames, bin_names, 1, 1, 1, a);
        break;
    case OP_WAIT:
        rc = bind(fn[op], args, nargs, kwnames, wait_names, 3, 3, 1, a);
        break;
    default:
        rc = bind(fn[op], args, nargs, kwnames, NULL, 0, 0, 0, a);
        break;
    }
    if (rc < 0)
        return NULL;
    tsp_client *self = (tsp_client *)obj;
    const char *bin = NULL;
    if (op != OP_LIST && op != OP_STATS && op != OP_PING) {
        bin = bin_name(a[0]);
        if (bin == NULL)
            return NULL;
    }
    async_ctx *ctx = calloc(1, sizeof(*ctx));
    if (ctx == NULL)
        return PyErr_NoMemory();
    ctx->op = op;
    ctx->tt = tsp_client_tensor_type(obj);
    size_t max_items = 0;
    unsigned long long after = 0;
    int timeout_ms = TS_TIMEOUT_INFINITE;
    if (ctx->tt == TSP_TENSOR_DEFAULT)
        goto fail;
    if ((op == OP_GET || op == OP_PEEK) && (size_arg(a[1], "max_items", &max_items) < 0 ||
                                            tsp_tensor_type_from_py(a[2], ctx->tt, &ctx->tt) < 0 ||
                                            tsp_tensor_type_ready(ctx->tt) < 0))
        goto fail;
    if (op == OP_WAIT) {
        if (version_arg(a[1], "after_version", &after) < 0)
            goto fail;
        if (timeout_arg(a[2], TS_TIMEOUT_INFINITE, &timeout_ms) < 0)
            goto fail;
    }
    ts_client_t *c = enter(self);
    if (c == NULL)
        goto fail;
    if ((op == OP_PUT || op == OP_APPEND) && tsp_send_init(&ctx->send, a[1]) < 0) {
        leave(self);
        goto fail;
    }
    ctx->pend.future = new_future();
    if (ctx->pend.future == NULL) {
        tsp_send_clear(&ctx->send);
        leave(self);
        goto fail;
    }
    /* Queued with the GIL held: these calls never block and never call back from inside. */
    tsp_pending_link(&pending_async, &ctx->pend);
    switch (op) {
    case OP_PUT:
        rc = ts_put_async(c, bin, ctx->send.value, TS_BORROW, async_cb, ctx);
        break;
    case OP_APPEND:
        rc = ts_append_async(c, bin, ctx->send.value, TS_BORROW, async_cb, ctx);
        break;
    case OP_GET:
        rc = ts_get_async(c, bin, max_items, async_cb, ctx);
        break;
    case OP_PEEK:
        rc = ts_peek_async(c, bin, max_items, async_cb, ctx);
        break;
    case OP_DELETE:
        rc = ts_delete_async(c, bin, async_cb, ctx);
        break;
    case OP_LIST:
        rc = ts_list_async(c, async_cb, ctx);
        break;
    case OP_WAIT:
        rc = ts_wait_async(c, bin, (uint64_t)after, timeout_ms, async_cb, ctx);
        break;
    case OP_STATS:
        rc = ts_stats_async(c, async_cb, ctx);
        break;
    case OP_PING:
        rc = ts_ping_async(c, async_cb, ctx);
        break;
    }
    if (rc != 0) {
        tsp_pending_unlink(&pending_async, &ctx->pend);
        tsp_raise(rc);
        tsp_send_clear(&ctx->send);
        Py_DECREF(ctx->pend.future);
        leave(self);
        goto fail;
    }
    PyObject *f = ctx->pend.future;
    Py_INCREF(f); /* the callback keeps the context's reference */
    leave(self);
    return f;
fail:
    free(ctx);
    return NULL;
}

#define ASYNC_METHOD(name, op)                                                                     \
    static PyObject *client_##name(PyObject *obj, PyObject *const *args, Py_ssize_t nargs,         \
                                   PyObject *kwnames)                                              \
    {                                                                                              \
        return async_op(obj, args, nargs, kwnames, op);                                            \
    }
ASYNC_METHOD(put_async, OP_PUT)
ASYNC_METHOD(append_async, OP_APPEND)
ASYNC_METHOD(get_async, OP_GET)
ASYNC_METHOD(peek_async, OP_PEEK)
ASYNC_METHOD(delete_async, OP_DELETE)
ASYNC_METHOD(list_async, OP_LIST)
ASYNC_METHOD(wait_async, OP_WAIT)
ASYNC_METHOD(stats_async, OP_STATS)
ASYNC_METHOD(ping_async, OP_PING)

/* ---------------------------------------------------------------------------------------------
 * listen / unlisten
 */

typedef struct listen_ctx {
    PyObject *callback;
    PyObject *bin; /* str */
} listen_ctx;

static const char *event_name(ts_event_t e)
{
    switch (e) {
    case TS_EV_PUT:
        return "put";
    case TS_EV_APPEND:
        return "append";
    case TS_EV_GET:
        return "get";
    case TS_EV_DELETE:
        return "delete";
    case TS_EV_ROWS:
        return "rows";
    case TS_EV_DISCONNECTED:
        return "disconnected";
    case TS_EV_RESUBSCRIBED:
        return "resubscribed";
    default:
        return "unknown";
    }
}

static PyObject *notification_new(PyObject *bin, const char *event, uint64_t version,
                                  uint32_t n_items, int coalesced, PyObject *error)
{
    PyObject *n = PyStructSequence_New((PyTypeObject *)tsp_state.NotificationType);
    if (n == NULL)
        return NULL;
    Py_INCREF(bin);
    PyStructSequence_SET_ITEM(n, 0, bin);
    PyStructSequence_SET_ITEM(n, 1, PyUnicode_InternFromString(event));
    PyStructSequence_SET_ITEM(n, 2, PyLong_FromUnsignedLongLong(version));
    PyStructSequence_SET_ITEM(n, 3, PyLong_FromUnsignedLong(n_items));
    PyObject *co = coalesced ? Py_True : Py_False;
    Py_INCREF(co);
    PyStructSequence_SET_ITEM(n, 4, co);
    if (error == NULL)
        error = Py_None;
    Py_INCREF(error);
    PyStructSequence_SET_ITEM(n, 5, error);
    if (PyErr_Occurred()) {
        Py_DECREF(n);
        return NULL;
    }
    return n;
}

/* On the I/O thread: one call per change, then a final one. */
static void notify_cb(ts_client_t *c, int status, const ts_notification_t *n, void *arg)
{
    (void)c;
    listen_ctx *l = arg;
    char msg[TS_MAX_ERROR_LEN + 1] = "";
    if (status < 0)
        snprintf(msg, sizeof(msg), "%s", ts_last_error());
    PyGILState_STATE g;
    if (!tsp_gil_acquire(&g))
        return; /* finalizing: nothing of Python may run */
    PyObject *note = NULL;
    if (status == 0) {
        note = notification_new(l->bin, event_name(n->event), n->version, n->n_items, n->coalesced,
                                NULL);
    } else if (status != TS_ECANCELED) {
        /* The subscription ended on an error (refused after a reconnect): say it, last. */
        PyObject *exc = tsp_exception_new(status, msg);
        if (exc != NULL) {
            note = notification_new(l->bin, "error", 0, 0, 0, exc);
            Py_DECREF(exc);
        }
    }
    if (note != NULL) {
        PyObject *r = PyObject_CallOneArg(l->callback, note);
        Py_DECREF(note);
        if (r == NULL)
            tsp_report_callback_error("a tensorshare listen callback", l->callback);
        Py_XDECREF(r);
    } else if (PyErr_Occurred()) {
        tsp_report_callback_error("a tensorshare listen callback", l->callback);
    }
    if (status < 0) {
        Py_DECREF(l->callback);
        Py_DECREF(l->bin);
        free(l);
    }
    tsp_gil_release(g);
}

static PyObject *client_listen(PyObject *obj, PyObject *const *args, Py_ssize_t nargs,
                               PyObject *kwnames)
{
    static const char *const names[] = {"bin", "callback"};
    PyObject *a[2];
    if (bind("listen", args, nargs, kwnames, names, 2, 2, 2, a) < 0)
        return NULL;
    const char *bin = bin_name(a[0]);
    if (bin == NULL)
        return NULL;
    if (!PyCallable_Check(a[1])) {
        PyErr_SetString(PyExc_TypeError, "listen: callback must be callable");
        return NULL;
    }
    tsp_client *self = (tsp_client *)obj;
    ts_client_t *c = enter(self);
    if (c == NULL)
        return NULL;
    listen_ctx *l = malloc(sizeof(*l));
    if (l == NULL) {
        leave(self);
        return PyErr_NoMemory();
    }
    Py_INCREF(a[1]);
    Py_INCREF(a[0]);
    l->callback = a[1];
    l->bin = a[0];
    int rc;
    Py_BEGIN_ALLOW_THREADS rc = ts_listen(c, bin, notify_cb, l);
    Py_END_ALLOW_THREADS PyObject *r = NULL;
    if (rc == 0) {
        r = Py_None;
        Py_INCREF(r);
    } else {
        tsp_raise(rc);
        Py_DECREF(l->callback);
        Py_DECREF(l->bin);
        free(l);
    }
    leave(self);
    return r;
}

static PyObject *client_unlisten(PyObject *obj, PyObject *const *args, Py_ssize_t nargs,
                                 PyObject *kwnames)
{
    static const char *const names[] = {"bin"};
    PyObject *a[1];
    if (bind("unlisten", args, nargs, kwnames, names, 1, 1, 1, a) < 0)
        return NULL;
    const char *bin = bin_name(a[0]);
    if (bin == NULL)
        return NULL;
    tsp_client *self = (tsp_client *)obj;
    ts_client_t *c = enter(self);
    if (c == NULL)
        return NULL;
    int rc = ts_unlisten(c, bin); /* does not block */
    PyObject *r = NULL;
    if (rc == 0) {
        r = Py_None;
        Py_INCREF(r);
    } else {
        tsp_raise(rc);
    }
    leave(self);
    return r;
}

/* ---------------------------------------------------------------------------------------------
 * Properties and the type
 */

static PyObject *client_get_closed(PyObject *obj, void *unused)
{
    (void)unused;
    tsp_client *self = (tsp_client *)obj;
    return PyBool_FromLong(self->closed || self->c == NULL);
}

static PyObject *client_get_connected(PyObject *obj, void *unused)
{
    (void)unused;
    tsp_client *self = (tsp_client *)obj;
    if (self->closed || self->c == NULL || self->fork_gen != tsp_fork_generation)
        Py_RETURN_FALSE;
    return PyBool_FromLong(ts_client_connected(self->c));
}

static PyObject *client_get_address(PyObject *obj, void *unused)
{
    (void)unused;
    tsp_client *self = (tsp_client *)obj;
    PyObject *a = self->address != NULL ? self->address : Py_None;
    Py_INCREF(a);
    return a;
}

static PyObject *client_get_tensor_type(PyObject *obj, void *unused)
{
    (void)unused;
    tsp_tensor_type_t tt = tsp_client_tensor_type(obj);
    if (tt == TSP_TENSOR_DEFAULT)
        return NULL;
    return PyUnicode_FromString(tt == TSP_TENSOR_NUMPY ? "numpy" : "torch");
}

static PyObject *client_repr(PyObject *obj)
{
    tsp_client *self = (tsp_client *)obj;
    return PyUnicode_FromFormat("<tensorshare.Client %R%s>",
                                self->address != NULL ? self->address : Py_None,
                                self->closed || self->c == NULL ? " closed" : "");
}

#define FAST (METH_FASTCALL | METH_KEYWORDS)
static PyMethodDef client_methods[] = {
    {"put", (PyCFunction)(void (*)(void))client_put, FAST,
     "put(bin, value) -> int\n\nReplace the bin's content with one item; returns the bin's new "
     "version. Blocks (GIL released) until tensord holds it."},
    {"append", (PyCFunction)(void (*)(void))client_append, FAST,
     "append(bin, value) -> int\n\nAdd one item to the bin (creating it); returns its version."},
    {"get", (PyCFunction)(void (*)(void))client_get, FAST,
     "get(bin, max_items=0, *, tensor_type=None, ref=False) -> list\n\nTake the oldest "
     "max_items items (0: all) out of the bin. BinNotFoundError when it does not exist. "
     "ref=True (unix sockets): large items arrive as read-only mappings of the server's memory "
     "instead of copies, at most 64 items per call (see docs/PYTHON.md)."},
    {"peek", (PyCFunction)(void (*)(void))client_peek, FAST,
     "peek(bin, max_items=0, *, tensor_type=None, ref=False) -> list\n\nAs get, keeping the "
     "items."},
    TSP_SHM_CLIENT_METHODS{
        "create_tensor_bin", (PyCFunction)(void (*)(void))tsp_client_create_tensor_bin,
        METH_VARARGS | METH_KEYWORDS,
        "create_tensor_bin(bin, dtype, shape) -> int\n\nMake bin a tensor bin: one zero-filled "
        "tensor of dtype ('float32', numpy or torch dtype) and shape, written in place by "
        "write_rows. Returns its version."},
    {"read_rows", (PyCFunction)(void (*)(void))tsp_client_read_rows, METH_VARARGS | METH_KEYWORDS,
     "read_rows(bin, start, end, *, item=0, key=None, tensor_type=None) -> tensor\n\nRows "
     "[start, end) of the item's tensor (its root, or the root map's entry key)."},
    {"gather_rows", (PyCFunction)(void (*)(void))tsp_client_gather_rows,
     METH_VARARGS | METH_KEYWORDS,
     "gather_rows(bin, index, *, item=0, key=None, tensor_type=None) -> tensor\n\nThe rows "
     "index[0], index[1], ... (a 1-D int64 numpy/torch tensor or a list of ints)."},
    {"write_rows", (PyCFunction)(void (*)(void))tsp_client_write_rows, METH_VARARGS | METH_KEYWORDS,
     "write_rows(bin, start, rows) -> int\n\nWrite rows (the bin's dtype, shape [k, ...]) "
     "into the tensor bin at start, in place; returns the bin's new version."},
    /* The method entries of the other files (tsp.h), one macro per file. */
    /* clang-format off */
    TSP_STREAM_CLIENT_METHODS
    TSP_COORD_CLIENT_METHODS
    TSP_PS_CLIENT_METHODS
    TSP_SERVICE_CLIENT_METHODS
    TSP_REPLAY_CLIENT_METHODS
    /* clang-format on */
    {"delete", (PyCFunction)(void (*)(void))client_delete, FAST,
     "delete(bin) -> int\n\nRemove the bin; returns the items removed (0 for a missing bin)."},
    {"list", client_list, METH_NOARGS,
     "list() -> dict\n\nEvery bin: {name: BinInfo(n_items, bytes, version)}."},
    {"wait", (PyCFunction)(void (*)(void))client_wait, FAST,
     "wait(bin, after_version=0, timeout=None) -> (version, n_items)\n\nBlock until the bin's "
     "version passes after_version (a missing bin has version 0). timeout in seconds; None "
     "waits as long as the server allows. TimeoutError when it passes."},
    {"stats", client_stats, METH_NOARGS, "stats() -> dict\n\nThe server's statistics."},
    {"ping", client_ping, METH_NOARGS, "ping() -> None\n\nA round trip to the server."},
    {"save", client_save, METH_NOARGS,
     "save() -> None\n\nAsk the server for a snapshot and wait until it is on disk."},
    {"listen", (PyCFunction)(void (*)(void))client_listen, FAST,
     "listen(bin, callback) -> None\n\nCall callback(Notification) on the client's I/O thread "
     "for every later change of the bin, in order. Live when it returns."},
    {"unlisten", (PyCFunction)(void (*)(void))client_unlisten, FAST,
     "unlisten(bin) -> None\n\nEnd the bin's subscription (BinNotFoundError if none)."},
    {"put_async", (PyCFunction)(void (*)(void))client_put_async, FAST,
     "put_async(bin, value) -> Future[int]\n\nThe tensors' memory is read until the future "
     "completes: do not change it before."},
    {"append_async", (PyCFunction)(void (*)(void))client_append_async, FAST,
     "append_async(bin, value) -> Future[int]"},
    {"get_async", (PyCFunction)(void (*)(void))client_get_async, FAST,
     "get_async(bin, max_items=0, *, tensor_type=None) -> Future[list]"},
    {"peek_async", (PyCFunction)(void (*)(void))client_peek_async, FAST,
     "peek_async(bin, max_items=0, *, tensor_type=None) -> Future[list]"},
    {"delete_async", (PyCFunction)(void (*)(void))client_delete_async, FAST,
     "delete_async(bin) -> Future[int]"},
    {"list_async", (PyCFunction)(void (*)(void))client_list_async, FAST,
     "list_async() -> Future[dict]"},
    {"wait_async", (PyCFunction)(void (*)(void))client_wait_async, FAST,
     "wait_async(bin, after_version=0, timeout=None) -> Future[(version, n_items)]"},
    {"stats_async", (PyCFunction)(void (*)(void))client_stats_async, FAST,
     "stats_async() -> Future[dict]"},
    {"ping_async", (PyCFunction)(void (*)(void))client_ping_async, FAST,
     "ping_async() -> Future[None]"},
    {"close", client_close, METH_NOARGS,
     "close() -> None\n\nClose the connection. Pending asynchronous requests and waits fail "
     "with CancelledError; listeners end. Idempotent."},
    {"__enter__", client_enter_cm, METH_NOARGS, NULL},
    {"__exit__", (PyCFunction)(void (*)(void))client_exit_cm, METH_FASTCALL, NULL},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef client_getset[] = {
    {"closed", client_get_closed, NULL, "True once close() was called.", NULL},
    {"connected", client_get_connected, NULL, "True while a connection is up.", NULL},
    {"address", client_get_address, NULL, "The address given to the constructor.", NULL},
    {"tensor_type", client_get_tensor_type, NULL,
     "'torch' or 'numpy': what received tensors become.", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject client_type = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "tensorshare.Client",
    .tp_basicsize = sizeof(tsp_client),
    .tp_dealloc = client_dealloc,
    .tp_repr = client_repr,
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE,
    .tp_doc = "Client(address='127.0.0.1:8000', *, token=None, token_file=None, timeout=None, "
              "connect_timeout=None, tensor_type=None)\n\n"
              "A connection to tensord. address is 'host:port', 'unix:/path' or a path. timeout "
              "(seconds) bounds every request; connect_timeout each connection attempt. "
              "tensor_type: 'torch' or 'numpy', what received tensors become (default torch "
              "when it can be imported). Thread-safe; close() or use it as a context manager.",
    .tp_methods = client_methods,
    .tp_getset = client_getset,
    .tp_init = client_init,
    .tp_new = PyType_GenericNew,
    .tp_weaklistoffset = offsetof(tsp_client, weakreflist),
};

static PyStructSequence_Field bininfo_fields[] = {
    {"n_items", "items in the bin"},
    {"bytes", "encoded bytes its items hold"},
    {"version", "the version of its last change"},
    {NULL, NULL},
};
static PyStructSequence_Desc bininfo_desc = {"tensorshare.BinInfo", "One bin of Client.list().",
                                             bininfo_fields, 3};

static PyStructSequence_Field notification_fields[] = {
    {"bin", "the bin's name"},
    {"event", "'put', 'append', 'get', 'delete', 'disconnected', 'resubscribed' or 'error'"},
    {"version", "the bin's version after the change"},
    {"n_items", "items in the bin after the change"},
    {"coalesced", "True when the server merged several changes into this one"},
    {"error", "for 'error' (the subscription's last call): the exception; else None"},
    {NULL, NULL},
};
static PyStructSequence_Desc notification_desc = {
    "tensorshare.Notification", "One change of a bin, passed to a listen callback.",
    notification_fields, 6};

static PyMethodDef client_module_methods[] = {
    {"_close_all", close_all, METH_NOARGS, "Close every open Client (registered with atexit)."},
    {"_take_pending_futures", take_pending_futures, METH_NOARGS,
     "In a child after os.fork(): [(future, exception)] of the requests the parent had queued."},
    {NULL, NULL, 0, NULL},
};

int tsp_client_type_init(PyObject *module);
int tsp_client_type_init(PyObject *module)
{
    s_set_result = PyUnicode_InternFromString("set_result");
    s_set_exception = PyUnicode_InternFromString("set_exception");
    s_set_running = PyUnicode_InternFromString("set_running_or_notify_cancel");
    if (s_set_result == NULL || s_set_exception == NULL || s_set_running == NULL)
        return -1;
    if (PyType_Ready(&client_type) < 0)
        return -1;
    tsp_state.ClientType = &client_type;
    Py_INCREF(&client_type);
    if (PyModule_AddObject(module, "Client", (PyObject *)&client_type) < 0) {
        Py_DECREF(&client_type);
        return -1;
    }
    PyTypeObject *bi = PyStructSequence_NewType(&bininfo_desc);
    PyTypeObject *no = PyStructSequence_NewType(&notification_desc);
    if (bi == NULL || no == NULL)
        return -1;
    tsp_state.BinInfoType = (PyObject *)bi;
    tsp_state.NotificationType = (PyObject *)no;
    Py_INCREF(bi);
    Py_INCREF(no);
    if (PyModule_AddObject(module, "BinInfo", (PyObject *)bi) < 0 ||
        PyModule_AddObject(module, "Notification", (PyObject *)no) < 0)
        return -1;
    if (PyModule_AddFunctions(module, client_module_methods) < 0)
        return -1;
    /* Close every client before the interpreter finalizes (LIFO: the bindings initialised
     * after this register theirs later, so their objects close before the clients). */
    PyObject *atexit = PyImport_ImportModule("atexit");
    if (atexit == NULL)
        return -1;
    PyObject *fn = PyObject_GetAttrString(module, "_close_all");
    PyObject *r = fn != NULL ? PyObject_CallMethod(atexit, "register", "O", fn) : NULL;
    Py_XDECREF(fn);
    Py_DECREF(atexit);
    if (r == NULL)
        return -1;
    Py_DECREF(r);
    return 0;
}
