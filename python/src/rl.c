/* tensorshare Python module: the RL helpers (RLTrainer, RLWorker) over rl.h.
 *
 * This file registers the RL types on the module. The first version registers
 * nothing yet, so that the module links while the bindings are written; the
 * declaration below matches the one in tsp.h. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

int tsp_rl_init(PyObject *module);

int tsp_rl_init(PyObject *module)
{
    /* Nothing is registered yet: the RL types come with the bindings. */
    (void)module;
    return 0;
}
