/*
 * DLPack interop for tensorshare: hand tensors to and from any framework that speaks DLPack
 * (PyTorch's at::fromDLPack / at::toDLPack, TVM, ...), without copying their data.
 *
 * Needs <dlpack/dlpack.h> (Debian: libdlpack-dev). Thread safety as for other record functions.
 */
#ifndef TENSORSHARE_DLPACK_H
#define TENSORSHARE_DLPACK_H

#include <dlpack/dlpack.h>

#include "tensorshare/tensorshare.h"

#ifdef __cplusplus
extern "C" {
#endif

/*
 * A tensor value that borrows t's memory (zero-copy). Only dense, row-major (C-contiguous) CPU
 * tensors (kDLCPU or kDLCUDAHost) of a dtype tensorshare knows, with lanes == 1 and at most
 * TS_MAX_NDIM dimensions, are accepted; strides may be NULL or the compact ones.
 *
 * On success the value takes over t: t->deleter(t) is called when the value is freed (by
 * ts_value_free, or by the container it was added to). On failure it returns NULL and t stays
 * the caller's. Like any tensor value, it can be put (the data is sent straight from t's
 * memory) or added to a map. Added in 0.1.0.
 */
TS_EXTERN ts_value_t *ts_tensor_from_dlpack(DLManagedTensor *t);

/*
 * A DLManagedTensor describing v's tensor (zero-copy); free it by calling its deleter.
 * - For a received value (from get or peek) the DLManagedTensor holds
 *   its own reference on the receive buffer: it stays valid after ts_items_free, until its
 *   deleter runs. Received data is meant to be read-only.
 * - For a value you built, the data is borrowed: the DLManagedTensor must not outlive v.
 * Returns 0, TS_ETYPE when v is not a tensor, TS_EINVAL for NULL arguments, TS_ENOMEM.
 * Added in 0.1.0.
 */
TS_EXTERN int ts_value_to_dlpack(const ts_value_t *v, DLManagedTensor **out);

#ifdef __cplusplus
}
#endif

#endif /* TENSORSHARE_DLPACK_H */
