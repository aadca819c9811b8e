/*
 * predictor.c: remote predictions through tensord for Python (batcher.h's predictor API):
 * tensorshare._tensorshare._Predictor, which python/tensorshare/predictor.py subclasses into
 * tensorshare.Predictor.
 *
 * A predictor enters its tensorshare.Client for its whole life (tsp_client_enter) and calls the
 * service NAME (the library's ts_predictor_open: a same-host shared-memory slot when the server
 * offers one, else the service; never the relay's bins), and the library gives it one thread
 * (deadlines). predict() waits for its answer with the GIL released, in slices between which
 * signals and close() get through (but for one through the slot: predictor_predict);
 * predict_async() returns a concurrent.futures.Future completed on the client's I/O thread
 * (answers, a request that could not be sent), the predictor's thread (a deadline it reaches
 * first) or in close() with CancelledError. Outputs are handed out as views of the
 * answer's memory (no copy), which lives until the last view of it goes. In a child process after
 * fork() the futures still outstanding at the fork fail with ConnectionError (predictor.py's fork
 * hook, over _take_pending_predictions).
 */
#include "tsp.h"

#include <limits.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include <tensorshare/batcher.h>

/* ms; how often a predict() waiting for its answer checks for signals (Ctrl-C) */
#define TSP_PREDICT_SLICE_MS 100

/* The concurrent.futures.Future class, imported once at init (a new reference kept forever). */
static PyObject *future_class;

/* Set while on_prediction completes a future on this thread (a blocking predict must refuse). */
static _Thread_local int in_prediction_cb;

/*
 * A timeout argument in seconds: None gives TS_TIMEOUT_DEFAULT (TS_PREDICTOR_DEFAULT_TIMEOUT_MS),
 * inf TS_TIMEOUT_INFINITE, a positive number its milliseconds rounded up. 0 or negative is a
 * ValueError: a prediction cannot be answered without waiting. 0 or -1.
 */
static int predict_timeout(PyObject *obj, int *out)
{
    if (obj == NULL || obj == Py_None) {
        *out = TS_TIMEOUT_DEFAULT;
        return 0;
    }
    double s = PyFloat_AsDouble(obj);
    if (s == -1.0 && PyErr_Occurred())
        return -1;
    if (isnan(s) || s <= 0) {
        PyErr_SetString(PyExc_ValueError,
                        "timeout must be None (the default, 30 s), inf or a number of seconds > 0");
        return -1;
    }
    double ms = ceil(s * 1000.0);
    *out = isinf(s) || ms >= (double)INT_MAX ? TS_TIMEOUT_INFINITE : (int)ms;
    return 0;
}

/*
 * u.handle is the ts_predictor_t, with its users counted in u; freeing it (GIL released)
 * completes the outstanding futures with CancelledError.
 */
typedef struct predictor_object {
    tsp_client_user u; /* first: the object's head */
    PyObject *name;    /* the served model's name (str) */
} predictor_object;

static void predictor_free_handle(void *h)
{
    ts_predictor_free(h);
}

/* Start a call: the predictor, or NULL with an exception (closed, or used after fork). */
static ts_predictor_t *predictor_enter(predictor_object *self)
{
    if (self->u.handle == NULL || self->u.closing) {
        tsp_raise_msg(TS_ECANCELED, self->u.closing ? "the Predictor is closed"
                                                    : "the Predictor is not initialised");
        return NULL;
    }
    if (self->u.fork_generation != tsp_fork_generation) {
        tsp_raise_msg(TS_ENOTCONN,
                      "this Predictor was opened before os.fork(): open a new one in the child");
        return NULL;
    }
    self->u.users++;
    return self->u.handle;
}

static void predictor_leave(predictor_object *self)
{
    tsp_client_user_leave(&self->u);
}

/* What predictor_init hands to predictor_open (tsp_client_open), and the predictor opened. */
typedef struct predictor_open_arg {
    const char *name;
    ts_predictor_t *p;
} predictor_open_arg;

static int predictor_open(ts_client_t *c, void *arg)
{
    predictor_open_arg *a = arg;
    return ts_predictor_open(&a->p, c, a->name);
}

static int predictor_init(PyObject *self_obj, PyObject *args, PyObject *kwds)
{
    predictor_object *self = (predictor_object *)self_obj;
    static char *kwlist[] = {"client", "name", "tensor_type", NULL};
    PyObject *client, *name, *tt_obj = NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OU|$O", kwlist, &client, &name, &tt_obj))
        return -1;
    if (self->u.handle != NULL || self->u.closing) {
        PyErr_SetString(PyExc_RuntimeError, "Predictor.__init__ called twice");
        return -1;
    }
    predictor_open_arg a = {tsp_c_string(name), NULL};
    if (a.name == NULL) {
        if (!PyErr_Occurred())
            tsp_raise_msg(TS_EINVAL, "a service name cannot contain NUL characters");
        return -1;
    }
    tsp_tensor_type_t tt;
    if (tsp_client_open(client, tt_obj, predictor_open, &a, &tt) < 0)
        return -1;
    Py_INCREF(client);
    Py_INCREF(name);
    self->u.client = client;
    self->name = name;
    self->u.handle = a.p;
    self->u.fork_generation = tsp_fork_generation;
    self->u.tensor_type = tt;
    self->u.free_handle = predictor_free_handle;
    return 0;
}

/* The answer as Python: output, or (output, version) when asked for; takes output over. */
static PyObject *answer_to_py(ts_value_t *output, int64_t version, tsp_tensor_type_t tt,
                              int with_version)
{
    PyObject *out = tsp_value_to_py_owned(output, tt);
    if (out == NULL || !with_version)
        return out;
    PyObject *res = Py_BuildValue("(OL)", out, (long long)version);
    Py_DECREF(out);
    return res;
}

/*
 * Whether v holds a tensor of 0 rows (a first dimension of 0). Every field of a served schema
 * has a batch dimension of 1 or more rows (docs/BATCHER.md), so such an input is refused here,
 * before it is sent.
 */
static int has_empty_rows(const ts_value_t *v)
{
    switch (ts_value_type(v)) {
    case TS_TYPE_TENSOR: {
        const ts_tensor_t *t = ts_value_tensor(v);
        return t->ndim >= 1 && t->shape[0] == 0;
    }
    case TS_TYPE_MAP:
        for (size_t i = 0; i < ts_value_len(v); i++)
            if (has_empty_rows(ts_map_value_at(v, i)))
                return 1;
        return 0;
    case TS_TYPE_LIST:
        for (size_t i = 0; i < ts_value_len(v); i++)
            if (has_empty_rows(ts_list_at(v, i)))
                return 1;
        return 0;
    default:
        return 0;
    }
}

/*
 * The arguments of predict and predict_async (input, timeout=None, *, return_version=False),
 * then predictor_enter and the input's encoding into *s: the predictor (the caller clears s and
 * leaves the predictor), or NULL with an exception and nothing to undo.
 */
static ts_predictor_t *predict_enter(predictor_object *self, PyObject *args, PyObject *kwds,
                                     tsp_send_t *s, int *timeout_ms, int *with_version)
{
    static char *kwlist[] = {"input", "timeout", "return_version", NULL};
    PyObject *input, *timeout_obj = Py_None;
    *with_version = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O|O$p", kwlist, &input, &timeout_obj,
                                     with_version))
        return NULL;
    if (predict_timeout(timeout_obj, timeout_ms) < 0)
        return NULL;
    ts_predictor_t *p = predictor_enter(self);
    if (p == NULL)
        return NULL;
    if (tsp_send_init(s, input) < 0) {
        predictor_leave(self);
        return NULL;
    }
    if (has_empty_rows(s->value)) {
        tsp_send_clear(s);
        predictor_leave(self);
        tsp_raise_msg(TS_ESCHEMA, "the input has a tensor of 0 rows: a prediction takes at least "
                                  "one row");
        return NULL;
    }
    return p;
}

/*
 * A predict() through the service: the answer of an asynchronous request, awaited on a
 * condition variable by the caller, who does not keep the predictor entered meanwhile; so a
 * close() from another thread frees the predictor, which cancels the request (CancelledError).
 */
typedef struct predict_wait {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int refs; /* the caller's and the callback's; under mu */
    int done;
    int status;
    ts_value_t *output; /* owned until the caller takes it */
    int64_t version;
    char msg[TS_MAX_ERROR_LEN + 1];
} predict_wait;

/* Drop a reference (mu held; released here); the last frees pw. */
static void predict_wait_unref_locked(predict_wait *pw)
{
    int last = --pw->refs == 0;
    pthread_mutex_unlock(&pw->mu);
    if (last) {
        ts_value_free(pw->output);
        pthread_cond_destroy(&pw->cv);
        pthread_mutex_destroy(&pw->mu);
        free(pw);
    }
}

/* ts_predictor_cb of a blocking predict; needs no GIL (it may run in ts_predictor_free). */
static void on_blocking_prediction(ts_predictor_t *p, int status, ts_value_t *output,
                                   int64_t version, void *arg)
{
    (void)p;
    predict_wait *pw = arg;
    pthread_mutex_lock(&pw->mu);
    pw->status = status;
    pw->output = output;
    pw->version = version;
    if (status != 0)
        snprintf(pw->msg, sizeof(pw->msg), "%s", ts_last_error());
    pw->done = 1;
    pthread_cond_signal(&pw->cv);
    predict_wait_unref_locked(pw);
}

/*
 * The service path of predict(): send, leave the predictor, and wait for the answer in slices
 * of TSP_PREDICT_SLICE_MS with the GIL released, running signal handlers between them. Takes
 * over s and the caller's entry of the predictor.
 */
static PyObject *predict_through_service(predictor_object *self, ts_predictor_t *p, tsp_send_t *s,
                                         int timeout_ms, int with_version)
{
    tsp_tensor_type_t tt = self->u.tensor_type;
    predict_wait *pw = calloc(1, sizeof(*pw));
    if (pw == NULL) {
        tsp_send_clear(s);
        predictor_leave(self);
        return PyErr_NoMemory();
    }
    pthread_mutex_init(&pw->mu, NULL);
    pthread_cond_init(&pw->cv, NULL);
    pw->refs = 2;
    PyThreadState *nogil = PyEval_SaveThread();
    int rc = ts_predictor_predict_async(p, s->value, timeout_ms, on_blocking_prediction, pw);
    PyEval_RestoreThread(nogil);
    tsp_send_clear(s); /* encoded and sent by the call */
    if (rc != 0) {
        tsp_raise(rc);
        predictor_leave(self);
        pthread_mutex_lock(&pw->mu);
        pw->refs--; /* the callback's: it never comes */
        predict_wait_unref_locked(pw);
        return NULL;
    }
    /* From here the callback holds the request: close() may free the predictor meanwhile. */
    predictor_leave(self);
    int done = 0;
    while (!done) {
        nogil = PyEval_SaveThread();
        pthread_mutex_lock(&pw->mu);
        if (!pw->done) {
            struct timespec ts;
            clock_gettime(CLOCK_REALTIME, &ts);
            ts.tv_nsec += (long)TSP_PREDICT_SLICE_MS * 1000000L;
            if (ts.tv_nsec >= 1000000000L) {
                ts.tv_sec++;
                ts.tv_nsec -= 1000000000L;
            }
            pthread_cond_timedwait(&pw->cv, &pw->mu, &ts);
        }
        done = pw->done;
        pthread_mutex_unlock(&pw->mu);
        PyEval_RestoreThread(nogil);
        if (!done && PyErr_CheckSignals() < 0) {
            /* Ctrl-C: give up; the answer (or the deadline) frees the request when it comes. */
            pthread_mutex_lock(&pw->mu);
            predict_wait_unref_locked(pw);
            return NULL;
        }
    }
    PyObject *res;
    if (pw->status == 0) {
        ts_value_t *output = pw->output;
        pw->output = NULL;
        res = answer_to_py(output, pw->version, tt, with_version);
    } else {
        res = tsp_raise_msg(pw->status, pw->msg[0] ? pw->msg : NULL);
    }
    pthread_mutex_lock(&pw->mu);
    predict_wait_unref_locked(pw);
    return res;
}

/*
 * predict(): through the predictor's same-host shared-memory slot when it holds one (the
 * library's blocking call, which close() waits for: it ends within its timeout), else through
 * the service (predict_through_service). Refused in a prediction's callback, where its answer
 * could not come (the client's I/O thread would wait for itself).
 */
static PyObject *predictor_predict(PyObject *self_obj, PyObject *args, PyObject *kwds)
{
    predictor_object *self = (predictor_object *)self_obj;
    if (in_prediction_cb)
        return tsp_raise_msg(TS_EDEADLK, "Predictor.predict() called from a prediction's "
                                         "callback (use predict_async)");
    tsp_send_t s;
    int timeout_ms, with_version;
    ts_predictor_t *p = predict_enter(self, args, kwds, &s, &timeout_ms, &with_version);
    if (p == NULL)
        return NULL;
    ts_predictor_stats_t st;
    ts_predictor_stats(p, &st);
    if (st.transport != TS_PREDICTOR_SHM)
        return predict_through_service(self, p, &s, timeout_ms, with_version);
    ts_value_t *output = NULL;
    int64_t version = -1;
    PyThreadState *nogil = PyEval_SaveThread();
    int rc = ts_predictor_predict(p, s.value, timeout_ms, &output, &version);
    PyEval_RestoreThread(nogil);
    PyObject *res =
        rc == 0 ? answer_to_py(output, version, self->u.tensor_type, with_version) : tsp_raise(rc);
    tsp_send_clear(&s);
    predictor_leave(self);
    return res;
}

/* One outstanding asynchronous prediction. */
typedef struct predict_req {
    tsp_pending pend; /* the future, and the link in pending_reqs while outstanding */
    tsp_tensor_type_t tensor_type;
    int with_version;
} predict_req;

/* Every asynchronous prediction requested and not answered yet (see tsp_pending). Under the GIL. */
static tsp_pending *pending_reqs;

/* In a child process after fork() (predictor.py's os.register_at_fork hook). */
static PyObject *take_pending_predictions(PyObject *module, PyObject *unused)
{
    (void)module;
    (void)unused;
    return tsp_pending_take(&pending_reqs,
                            "this prediction was requested in the parent process before "
                            "os.fork(): its answer goes there only (open a new Predictor in the "
                            "child)");
}

/* Complete fut with a result (steals res) or, when res is NULL, with the current exception. */
static void future_complete(PyObject *fut, PyObject *res)
{
    PyObject *r;
    if (res != NULL) {
        r = PyObject_CallMethod(fut, "set_result", "(O)", res);
        Py_DECREF(res);
    } else {
        PyObject *type, *value, *tb;
        PyErr_Fetch(&type, &value, &tb);
        PyErr_NormalizeException(&type, &value, &tb);
        if (value == NULL) {
            Py_XDECREF(type);
            Py_XDECREF(tb);
            return;
        }
        if (tb != NULL)
            PyException_SetTraceback(value, tb);
        r = PyObject_CallMethod(fut, "set_exception", "(O)", value);
        Py_XDECREF(type);
        Py_DECREF(value);
        Py_XDECREF(tb);
    }
    /* set_result runs the future's done-callbacks: their errors are reported there. */
    if (r == NULL)
        tsp_report_callback_error("Predictor future", fut);
    Py_XDECREF(r);
}

/* ts_predictor_cb: on the client's I/O thread, the predictor's thread, or in ts_predictor_free. */
static void on_prediction(ts_predictor_t *p, int status, ts_value_t *output, int64_t version,
                          void *arg)
{
    (void)p;
    predict_req *req = arg;
    char msg[TS_MAX_ERROR_LEN + 1];
    snprintf(msg, sizeof(msg), "%s", status != 0 ? ts_last_error() : "");
    PyGILState_STATE g;
    if (!tsp_gil_acquire(&g)) {
        /* The interpreter is finalizing: drop the answer, leak the Python objects. */
        ts_value_free(output);
        return;
    }
    tsp_pending_unlink(&pending_reqs, &req->pend);
    int was = in_prediction_cb;
    in_prediction_cb = 1; /* the future's done-callbacks run below */
    if (status == 0) {
        PyObject *res = answer_to_py(output, version, req->tensor_type, req->with_version);
        future_complete(req->pend.future, res);
    } else {
        ts_value_free(output);
        PyObject *exc = tsp_exception_new(status, msg[0] ? msg : NULL);
        if (exc != NULL) {
            PyObject *r = PyObject_CallMethod(req->pend.future, "set_exception", "(O)", exc);
            if (r == NULL)
                tsp_report_callback_error("Predictor future", req->pend.future);
            Py_XDECREF(r);
            Py_DECREF(exc);
        } else {
            future_complete(req->pend.future, NULL);
        }
    }
    in_prediction_cb = was;
    Py_DECREF(req->pend.future);
    PyMem_Free(req);
    tsp_gil_release(g);
}

static PyObject *predictor_predict_async(PyObject *self_obj, PyObject *args, PyObject *kwds)
{
    predictor_object *self = (predictor_object *)self_obj;
    tsp_send_t s;
    int timeout_ms, with_version;
    ts_predictor_t *p = predict_enter(self, args, kwds, &s, &timeout_ms, &with_version);
    if (p == NULL)
        return NULL;
    predict_req *req = NULL;
    PyObject *fut = PyObject_CallNoArgs(future_class);
    if (fut == NULL)
        goto fail;
    /* Running from the start: a request on its way cannot be withdrawn. */
    PyObject *r = PyObject_CallMethod(fut, "set_running_or_notify_cancel", NULL);
    if (r == NULL)
        goto fail;
    Py_DECREF(r);
    req = PyMem_Malloc(sizeof(*req));
    if (req == NULL) {
        PyErr_NoMemory();
        goto fail;
    }
    Py_INCREF(fut);
    req->pend.future = fut;
    req->tensor_type = self->u.tensor_type;
    req->with_version = with_version;
    /* Linked before the GIL is released: the answer may come before the call returns. */
    tsp_pending_link(&pending_reqs, &req->pend);
    /* The input is encoded and sent before this returns: its memory is not needed after it. */
    PyThreadState *nogil = PyEval_SaveThread();
    int rc = ts_predictor_predict_async(p, s.value, timeout_ms, on_prediction, req);
    PyEval_RestoreThread(nogil);
    tsp_send_clear(&s);
    if (rc != 0) {
        /* The callback is never called when the call fails. */
        tsp_pending_unlink(&pending_reqs, &req->pend);
        Py_DECREF(req->pend.future);
        PyMem_Free(req);
        tsp_raise(rc);
        Py_DECREF(fut);
        predictor_leave(self);
        return NULL;
    }
    predictor_leave(self);
    return fut;

fail:
    tsp_send_clear(&s);
    Py_XDECREF(fut);
    predictor_leave(self);
    return NULL;
}

static PyObject *predictor_enter_method(PyObject *self_obj, PyObject *unused)
{
    (void)unused;
    predictor_object *self = (predictor_object *)self_obj;
    if (self->u.handle == NULL || self->u.closing)
        return tsp_raise_msg(TS_ECANCELED, "the Predictor is closed");
    Py_INCREF(self_obj);
    return self_obj;
}

static PyObject *predictor_get_name(PyObject *self_obj, void *closure)
{
    (void)closure;
    predictor_object *self = (predictor_object *)self_obj;
    if (self->name == NULL)
        Py_RETURN_NONE;
    Py_INCREF(self->name);
    return self->name;
}

static void predictor_dealloc(PyObject *self_obj)
{
    predictor_object *self = (predictor_object *)self_obj;
    PyObject_GC_UnTrack(self_obj);
    self->u.closing = 1;
    tsp_client_user_free(&self->u);
    Py_CLEAR(self->name);
    Py_TYPE(self_obj)->tp_free(self_obj);
}

static PyMethodDef predictor_methods[] = {
    {"predict", (PyCFunction)(void (*)(void))predictor_predict, METH_VARARGS | METH_KEYWORDS,
     "predict(input, timeout=None, *, return_version=False)\n\nSend input (a record matching the "
     "served model's input schema) and wait for the answer: the output record, or (output, "
     "version) with return_version. timeout in seconds (None: 30 s; inf: no limit)."},
    {"predict_async", (PyCFunction)(void (*)(void))predictor_predict_async,
     METH_VARARGS | METH_KEYWORDS,
     "predict_async(input, timeout=None, *, return_version=False) -> concurrent.futures.Future\n\n"
     "As predict, without waiting: the Future completes on the client's I/O thread (or the "
     "predictor's thread at a deadline, or in close())."},
    {"close", tsp_client_user_close_method, METH_NOARGS,
     "close(): outstanding predictions fail with CancelledError"},
    {"__enter__", predictor_enter_method, METH_NOARGS, NULL},
    {"__exit__", tsp_client_user_exit_method, METH_VARARGS, NULL},
    {NULL, NULL, 0, NULL}};

static PyGetSetDef predictor_getset[] = {
    {"name", predictor_get_name, NULL, "the served model's name", NULL},
    {"closed", tsp_client_user_get_closed, NULL, "True after close()", NULL},
    {"client", tsp_client_user_get_client, NULL, "the tensorshare.Client (None after close)", NULL},
    {NULL, NULL, NULL, NULL, NULL}};

static PyTypeObject predictor_type = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "tensorshare._tensorshare._Predictor",
    .tp_basicsize = sizeof(predictor_object),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "A remote predictor of batcher.h (see tensorshare.Predictor).",
    .tp_new = PyType_GenericNew,
    .tp_init = predictor_init,
    .tp_dealloc = predictor_dealloc,
    .tp_traverse = tsp_client_user_traverse,
    .tp_methods = predictor_methods,
    .tp_getset = predictor_getset,
};

static PyMethodDef predictor_module_methods[] = {
    {"_take_pending_predictions", take_pending_predictions, METH_NOARGS,
     "In a child after os.fork(): [(future, exception)] of the predictions the parent awaited."},
    {NULL, NULL, 0, NULL},
};

int tsp_predictor_init(PyObject *module)
{
    if (PyModule_AddFunctions(module, predictor_module_methods) < 0)
        return -1;
    PyObject *futures = PyImport_ImportModule("concurrent.futures");
    if (futures == NULL)
        return -1;
    future_class = PyObject_GetAttrString(futures, "Future");
    Py_DECREF(futures);
    if (future_class == NULL)
        return -1;
    if (tsp_add_type(module, &predictor_type, "_Predictor") < 0)
        return -1;
    return PyModule_AddIntConstant(module, "PREDICTOR_DEFAULT_TIMEOUT_MS",
                                   TS_PREDICTOR_DEFAULT_TIMEOUT_MS);
}
