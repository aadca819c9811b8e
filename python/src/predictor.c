/* tensorshare Python module: remote predictions through tensord (Predictor)
 * over batcher.h's predictor API.
 *
 * This file registers the predictor type on the module. The first version
 * registers nothing yet, so that the module links while the bindings are
 * written; the declaration below matches the one in tsp.h. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

int tsp_predictor_init(PyObject *module);

int tsp_predictor_init(PyObject *module)
{
    /* Nothing is registered yet: the predictor type comes with the bindings. */
    (void)module;
    return 0;
}
