/*
 * client_user.c: what the objects living on a tensorshare.Client (the RL trainer and worker of
 * rl.c, the predictor of predictor.c) do alike: their creation (tsp_client_open) and their life
 * cycle (tsp_client_user: call accounting, free, close, the closed and client getters), kept in
 * one place so that their reference counting and their errors cannot drift apart.
 */
#include "tsp.h"

int tsp_client_open(PyObject *client, PyObject *tt_obj, tsp_open_fn open_fn, void *arg,
                    tsp_tensor_type_t *tt)
{
    ts_client_t *c = tsp_client_enter(client);
    if (c == NULL)
        return -1;
    tsp_tensor_type_t dflt = tsp_client_tensor_type(client);
    if (dflt == TSP_TENSOR_DEFAULT || tsp_tensor_type_from_py(tt_obj, dflt, tt) < 0) {
        tsp_client_leave(client);
        return -1;
    }
    PyThreadState *nogil = PyEval_SaveThread();
    int rc = open_fn(c, arg);
    PyEval_RestoreThread(nogil);
    if (rc != 0) {
        tsp_raise(rc);
        tsp_client_leave(client);
        return -1;
    }
    return 0;
}

void tsp_client_user_free(tsp_client_user *u)
{
    void *h = u->handle;
    u->handle = NULL;
    if (h != NULL && u->fork_generation == tsp_fork_generation) {
        if (u->before_free != NULL)
            u->before_free(u, h);
        PyThreadState *nogil = PyEval_SaveThread();
        u->free_handle(h);
        PyEval_RestoreThread(nogil);
    }
    /* In a child after fork the library's threads are gone: the object is left as it is. */
    if (u->client != NULL) {
        if (h != NULL)
            tsp_client_leave(u->client);
        Py_CLEAR(u->client);
    }
}

void tsp_client_user_leave(tsp_client_user *u)
{
    if (--u->users == 0 && u->closing)
        tsp_client_user_free(u);
}

void tsp_client_user_close(tsp_client_user *u)
{
    if (u->closing)
        return;
    u->closing = 1;
    if (u->users == 0)
        tsp_client_user_free(u);
}

PyObject *tsp_client_user_close_method(PyObject *self, PyObject *unused)
{
    (void)unused;
    tsp_client_user_close((tsp_client_user *)self);
    Py_RETURN_NONE;
}

PyObject *tsp_client_user_exit_method(PyObject *self, PyObject *args)
{
    (void)args;
    tsp_client_user_close((tsp_client_user *)self);
    Py_RETURN_FALSE;
}

PyObject *tsp_client_user_get_closed(PyObject *self, void *closure)
{
    (void)closure;
    tsp_client_user *u = (tsp_client_user *)self;
    return PyBool_FromLong(u->handle == NULL || u->closing);
}

PyObject *tsp_client_user_get_client(PyObject *self, void *closure)
{
    (void)closure;
    tsp_client_user *u = (tsp_client_user *)self;
    if (u->client == NULL)
        Py_RETURN_NONE;
    Py_INCREF(u->client);
    return u->client;
}

int tsp_client_user_traverse(PyObject *self, visitproc visit, void *arg)
{
    Py_VISIT(((tsp_client_user *)self)->client);
    return 0;
}
