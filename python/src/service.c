/*
 * Services (include/tensorshare/service.h) for Python: Client.call and the C half of
 * Client.serve (tensorshare/service.py holds the worker threads).
 *
 * Threading: the library hands each call to svc_on_call on the client's I/O thread. That callback
 * never takes the GIL: it only queues (call, request) under a mutex and signals a condition
 * variable, so a busy interpreter cannot stall the client's I/O. Python worker threads take calls
 * with _ServiceHandle.next() (which waits with the GIL released), convert the request, run the
 * handler, and answer with reply() or fail(), which are non-blocking and thread-safe in the
 * library.
 */
#include "tsp.h"

#include <limits.h>
#include <pthread.h>
#include <stdlib.h>
#include <time.h>

#include <tensorshare/service.h>

/* One call waiting for a worker: both pointers are owned until a worker takes them. */
typedef struct svc_item_s {
    ts_call_t *call;
    ts_value_t *request;
    struct svc_item_s *next;
} svc_item_t;

/* The queue shared by the I/O thread (producer) and the worker threads (consumers). */
typedef struct svc_queue_s {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    svc_item_t *head, *tail;
    int closed; /* set by close(): next() returns None once the queue is empty */
} svc_queue_t;

typedef struct {
    PyObject_HEAD ts_service_t *svc; /* NULL once closed */
    svc_queue_t *q;
    PyObject *client; /* owned: the client must outlive the registration */
    int entered;      /* counted as a user of client (tsp_client_enter) until closed */
} ServiceHandle;

/* The capsule name of an unanswered call handed to Python. */
static const char CALL_CAPSULE[] = "tensorshare._service_call";

static void svc_on_call(ts_service_t *svc, ts_call_t *call, ts_value_t *request, void *arg)
{
    (void)svc;
    svc_queue_t *q = arg;
    svc_item_t *it = calloc(1, sizeof *it);
    if (it == NULL) {
        ts_value_free(request);
        ts_call_fail(call, TS_EOOM, "out of memory queueing the call");
        return;
    }
    it->call = call;
    it->request = request;
    pthread_mutex_lock(&q->mu);
    if (q->tail != NULL)
        q->tail->next = it;
    else
        q->head = it;
    q->tail = it;
    pthread_cond_signal(&q->cv);
    pthread_mutex_unlock(&q->mu);
}

/* A call capsule that is dropped unanswered answers its caller with an error. */
static void call_capsule_free(PyObject *cap)
{
    ts_call_t **slot = PyCapsule_GetPointer(cap, CALL_CAPSULE);
    if (slot == NULL) {
        PyErr_Clear();
        return;
    }
    if (*slot != NULL)
        ts_call_fail(*slot, TS_ESERVER, "the server dropped the call unanswered");
    free(slot);
}

/* Take the call out of a capsule (the capsule no longer answers it), or NULL with an exception. */
static ts_call_t *call_take(PyObject *cap)
{
    ts_call_t **slot = PyCapsule_GetPointer(cap, CALL_CAPSULE);
    if (slot == NULL)
        return NULL;
    ts_call_t *call = *slot;
    *slot = NULL;
    if (call == NULL)
        PyErr_SetString(PyExc_ValueError, "the call was already answered");
    return call;
}

static void queue_fail_all(svc_queue_t *q, int err, const char *msg)
{
    pthread_mutex_lock(&q->mu);
    svc_item_t *it = q->head;
    q->head = q->tail = NULL;
    pthread_mutex_unlock(&q->mu);
    while (it != NULL) {
        svc_item_t *next = it->next;
        ts_value_free(it->request);
        ts_call_fail(it->call, err, msg);
        free(it);
        it = next;
    }
}

/*
 * Unregister (GIL released: it waits for tensord), so that no call is handed to this server
 * any more, and close the queue: next() returns None once the calls already queued are taken.
 */
static void handle_unregister(ServiceHandle *h)
{
    if (h->svc != NULL) {
        ts_service_t *svc = h->svc;
        h->svc = NULL;
        Py_BEGIN_ALLOW_THREADS ts_service_unregister(svc);
        Py_END_ALLOW_THREADS
    }
    if (h->q != NULL) {
        pthread_mutex_lock(&h->q->mu);
        h->q->closed = 1;
        pthread_cond_broadcast(&h->q->cv);
        pthread_mutex_unlock(&h->q->mu);
    }
}

static PyObject *handle_unregister_py(PyObject *self, PyObject *unused)
{
    (void)unused;
    handle_unregister((ServiceHandle *)self);
    Py_RETURN_NONE;
}

/* Unregister, and answer what is still queued (no worker will take it). */
static void handle_close(ServiceHandle *h)
{
    handle_unregister(h);
    if (h->q != NULL) {
        /* Not started, so not run: the caller may call again (ServiceGoneError). */
        queue_fail_all(h->q, TS_ESERVICE, "the server stopped serving before the call started");
    }
    /* Only now may a close() of the Client free the ts_client_t the calls point into. */
    if (h->entered) {
        h->entered = 0;
        tsp_client_leave(h->client);
    }
}

static PyObject *handle_close_py(PyObject *self, PyObject *unused)
{
    (void)unused;
    handle_close((ServiceHandle *)self);
    Py_RETURN_NONE;
}

/* next(timeout) -> (call, request) or None (timeout passed, or the handle is closed). */
static PyObject *handle_next(PyObject *self, PyObject *args)
{
    ServiceHandle *h = (ServiceHandle *)self;
    double timeout = 0.1;
    if (!PyArg_ParseTuple(args, "|d:next", &timeout))
        return NULL;
    if (h->q == NULL)
        Py_RETURN_NONE;
    svc_queue_t *q = h->q;
    svc_item_t *it = NULL;
    Py_BEGIN_ALLOW_THREADS struct timespec until;
    clock_gettime(CLOCK_REALTIME, &until);
    long long ns = (long long)until.tv_nsec + (long long)(timeout * 1e9);
    until.tv_sec += (time_t)(ns / 1000000000LL);
    until.tv_nsec = (long)(ns % 1000000000LL);
    pthread_mutex_lock(&q->mu);
    while (q->head == NULL && !q->closed) {
        if (pthread_cond_timedwait(&q->cv, &q->mu, &until) != 0)
            break;
    }
    it = q->head;
    if (it != NULL) {
        q->head = it->next;
        if (q->head == NULL)
            q->tail = NULL;
    }
    pthread_mutex_unlock(&q->mu);
    Py_END_ALLOW_THREADS if (it == NULL) Py_RETURN_NONE;
    ts_call_t **slot = malloc(sizeof *slot);
    PyObject *cap = NULL;
    if (slot != NULL) {
        *slot = it->call;
        cap = PyCapsule_New(slot, CALL_CAPSULE, call_capsule_free);
        if (cap == NULL)
            free(slot);
    } else {
        PyErr_NoMemory();
    }
    if (cap == NULL) {
        ts_value_free(it->request);
        ts_call_fail(it->call, TS_EOOM, "out of memory");
        free(it);
        return NULL;
    }
    /* The request becomes the Python object's (its tensors may borrow its memory). */
    tsp_tensor_type_t tt = tsp_client_tensor_type(h->client);
    PyObject *req = NULL;
    if (tt != TSP_TENSOR_DEFAULT)
        req = tsp_value_to_py_owned(it->request, tt);
    else
        ts_value_free(it->request);
    free(it);
    if (req == NULL) {
        Py_DECREF(cap); /* fails the call */
        return NULL;
    }
    PyObject *r = PyTuple_Pack(2, cap, req);
    Py_DECREF(cap);
    Py_DECREF(req);
    return r;
}

/* reply(call, answer): answer the call (the answer is copied). */
static PyObject *handle_reply(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *cap, *answer;
    if (!PyArg_ParseTuple(args, "OO:reply", &cap, &answer))
        return NULL;
    tsp_send_t s;
    if (tsp_send_init(&s, answer) < 0)
        return NULL; /* the call stays in the capsule: the caller may still fail it */
    ts_call_t *call = call_take(cap);
    if (call == NULL) {
        tsp_send_clear(&s);
        return NULL;
    }
    int rc;
    Py_BEGIN_ALLOW_THREADS rc = ts_call_reply(call, s.value);
    Py_END_ALLOW_THREADS tsp_send_clear(&s);
    if (rc != 0)
        return tsp_raise(rc);
    Py_RETURN_NONE;
}

/* fail(call, err, message): answer the call with an error. */
static PyObject *handle_fail(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *cap, *err_obj;
    const char *msg = NULL;
    if (!PyArg_ParseTuple(args, "OOz:fail", &cap, &err_obj, &msg))
        return NULL;
    /* A code that is no int, or past an int's range (a program's own .code), is no code tensord
     * carries: ESERVER, as the library answers for the others; the call is answered either way. */
    long long err = TS_ESERVER;
    if (tsp_int_arg(err_obj, "err", INT_MIN, INT_MAX, &err) < 0) {
        if (!PyErr_ExceptionMatches(PyExc_ValueError) && !PyErr_ExceptionMatches(PyExc_TypeError))
            return NULL;
        PyErr_Clear();
        err = TS_ESERVER;
    }
    ts_call_t *call = call_take(cap);
    if (call == NULL)
        return NULL;
    ts_call_fail(call, (int)err, msg);
    Py_RETURN_NONE;
}

static void handle_dealloc(PyObject *self)
{
    ServiceHandle *h = (ServiceHandle *)self;
    handle_close(h);
    if (h->q != NULL) {
        pthread_mutex_destroy(&h->q->mu);
        pthread_cond_destroy(&h->q->cv);
        free(h->q);
        h->q = NULL;
    }
    Py_XDECREF(h->client);
    Py_TYPE(self)->tp_free(self);
}

static PyMethodDef handle_methods[] = {
    {"next", handle_next, METH_VARARGS,
     "next(timeout=0.1) -> (call, request) or None\n\nWait for a call."},
    {"reply", handle_reply, METH_VARARGS, "reply(call, answer)\n\nAnswer the call."},
    {"fail", handle_fail, METH_VARARGS,
     "fail(call, err, message)\n\nAnswer the call with error code err."},
    {"unregister", handle_unregister_py, METH_NOARGS,
     "unregister()\n\nStop taking calls; next() returns None once the queued ones are taken."},
    {"close", handle_close_py, METH_NOARGS,
     "close()\n\nStop serving; answer the calls still queued with ESERVICE."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject handle_type = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "tensorshare._ServiceHandle",
    .tp_basicsize = sizeof(ServiceHandle),
    .tp_dealloc = handle_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A registration of this client as a server of a service (internal).",
    .tp_methods = handle_methods,
};

/* Client._serve(service, concurrency=64) -> _ServiceHandle. */
PyObject *tsp_client__serve(PyObject *client, PyObject *args, PyObject *kw)
{
    static char *names[] = {"service", "concurrency", NULL};
    const char *name;
    PyObject *concurrency_obj = NULL;
    unsigned long long concurrency = TS_SERVICE_DEFAULT_CONCURRENCY;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "s|O:_serve", names, &name, &concurrency_obj) ||
        tsp_uint_arg_einval(concurrency_obj, "concurrency", 1, TS_SERVICE_MAX_CONCURRENCY,
                            &concurrency) < 0)
        return NULL;
    ServiceHandle *h = PyObject_New(ServiceHandle, &handle_type);
    if (h == NULL)
        return NULL;
    h->svc = NULL;
    h->client = NULL;
    h->entered = 0;
    h->q = calloc(1, sizeof *h->q);
    if (h->q == NULL) {
        Py_DECREF(h);
        return PyErr_NoMemory();
    }
    pthread_mutex_init(&h->q->mu, NULL);
    pthread_cond_init(&h->q->cv, NULL);
    Py_INCREF(client);
    h->client = client;
    /* The handle stays a user of the client until it is closed (see tsp_client_enter): calls and
     * the registration point into the ts_client_t. */
    ts_client_t *c = tsp_client_enter(client);
    if (c == NULL) {
        Py_DECREF(h);
        return NULL;
    }
    h->entered = 1;
    ts_service_options_t o;
    ts_service_options_init(&o);
    o.concurrency = (int)concurrency;
    ts_service_t *svc = NULL;
    int rc;
    Py_BEGIN_ALLOW_THREADS rc = ts_service_register(&svc, c, name, &o, svc_on_call, h->q);
    Py_END_ALLOW_THREADS if (rc != 0)
    {
        Py_DECREF(h); /* leaves the client */
        return tsp_raise(rc);
    }
    h->svc = svc;
    return (PyObject *)h;
}

/* Client.serve(service, handler, concurrency=64, workers=None): tensorshare.service.serve. */
PyObject *tsp_client_serve(PyObject *client, PyObject *args, PyObject *kw)
{
    PyObject *mod = PyImport_ImportModule("tensorshare.service");
    if (mod == NULL)
        return NULL;
    PyObject *fn = PyObject_GetAttrString(mod, "serve");
    Py_DECREF(mod);
    if (fn == NULL)
        return NULL;
    Py_ssize_t n = PyTuple_GET_SIZE(args);
    PyObject *full = PyTuple_New(n + 1);
    if (full == NULL) {
        Py_DECREF(fn);
        return NULL;
    }
    Py_INCREF(client);
    PyTuple_SET_ITEM(full, 0, client);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *a = PyTuple_GET_ITEM(args, i);
        Py_INCREF(a);
        PyTuple_SET_ITEM(full, i + 1, a);
    }
    PyObject *r = PyObject_Call(fn, full, kw);
    Py_DECREF(full);
    Py_DECREF(fn);
    return r;
}

/* Client.call(service, request, timeout=None, wait_for_server=False, *, tensor_type=None). */
PyObject *tsp_client_call(PyObject *client, PyObject *args, PyObject *kw)
{
    static char *names[] = {"service",         "request",     "timeout",
                            "wait_for_server", "tensor_type", NULL};
    const char *name;
    PyObject *request, *timeout = Py_None, *tt_obj = NULL;
    int wait = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "sO|Op$O:call", names, &name, &request, &timeout,
                                     &wait, &tt_obj))
        return NULL;
    int timeout_ms = TS_TIMEOUT_DEFAULT;
    if (timeout != Py_None) {
        double t = PyFloat_AsDouble(timeout);
        if (t == -1.0 && PyErr_Occurred())
            return NULL;
        if (!(t > 0) || t * 1000.0 > (double)TS_CALL_MAX_TIMEOUT_MS) {
            /* inf included: a call always has a limit (the library refuses none). */
            PyErr_Format(PyExc_ValueError,
                         "call: timeout must be a number of seconds above 0 and at most 86400 "
                         "(24 hours), or None (the client's request timeout, at most 86400), "
                         "not %R: a call cannot wait without a limit or longer than tensord "
                         "allows",
                         timeout);
            return NULL;
        }
        timeout_ms = (int)(t * 1000.0);
        if (timeout_ms < 1)
            timeout_ms = 1;
    }
    tsp_tensor_type_t tt;
    if (tsp_client_tensor_type_arg(tt_obj, client, &tt) < 0)
        return NULL;
    tsp_send_t s;
    if (tsp_send_init(&s, request) < 0)
        return NULL;
    ts_client_t *c = tsp_client_enter(client);
    if (c == NULL) {
        tsp_send_clear(&s);
        return NULL;
    }
    ts_value_t *answer = NULL;
    int rc;
    Py_BEGIN_ALLOW_THREADS rc =
        ts_call(c, name, s.value, timeout_ms, wait ? TS_CALL_WAIT : 0u, &answer);
    Py_END_ALLOW_THREADS tsp_send_clear(&s);
    tsp_client_leave(client);
    if (rc != 0)
        return tsp_raise(rc);
    return tsp_value_to_py_owned(answer, tt);
}

int tsp_service_init(PyObject *module)
{
    if (PyType_Ready(&handle_type) < 0)
        return -1;
    if (tsp_exception_subclass(module, "ServiceGoneError",
                               "The server holding a call disconnected (or the last server left "
                               "before the call was handed to one) (TS_ESERVICE).",
                               TS_ESERVICE, &tsp_state.ServiceGoneError) < 0)
        return -1;
    if (PyModule_AddIntConstant(module, "_TS_EINVAL", TS_EINVAL) < 0 ||
        PyModule_AddIntConstant(module, "_TS_ESERVER", TS_ESERVER) < 0)
        return -1;
    return 0;
}
