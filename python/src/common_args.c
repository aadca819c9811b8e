/*
 * common_args.c: the steps that the objects living on a tensorshare.Client (the RL trainer and
 * worker of rl.c, the predictor of predictor.c) take alike when they are created, kept in one
 * place so that their reference counting and their errors cannot drift apart.
 */
#include "tsp.h"

int tsp_client_open(PyObject *client, PyObject *tt_obj, tsp_open_fn open_fn, void *arg,
                    tsp_tensor_type_t *tt)
{
    ts_client_t *c = tsp_client_enter(client);
    if (c == NULL)
        return -1;
    if (tsp_tensor_type_from_py(tt_obj, tsp_client_tensor_type(client), tt) < 0) {
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
