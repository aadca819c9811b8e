/*
 * tensorshare libtorch shim: TorchScript models over tensorshare records, in plain C.
 *
 * Link with -ltensorshare_torch -ltensorshare (a C compiler and linker suffice; libtorch is a
 * private dependency of the shim). Only builds that have libtorch install this header.
 *
 * Values convert to and from TorchScript values (IValue) as follows:
 *   tensor          <-> Tensor (CPU inputs are not copied: the tensor wraps the record's memory)
 *   map             <-> Dict[str, T] (T unified over the entries; Any when they differ)
 *   list            <-> List[T] (outputs: tuples become lists too)
 *   int, float, str <-> int, float, str (outputs: bool becomes an int 0/1)
 *   bytes            -> a 1-D uint8 Tensor over the bytes
 * A model's forward takes the converted input as its only argument.
 *
 * Errors: every function returns 0 or a negative TS_E* code; no C++ exception crosses into C.
 * TS_ETORCH means libtorch raised an error, TS_ENOMEM that an allocation failed; the message is
 * in ts_last_error() on the calling thread (tensorshare.h). A model may be used from one thread at
 * a time; distinct models are independent.
 */
#ifndef TENSORSHARE_TORCH_H
#define TENSORSHARE_TORCH_H

#include "tensorshare/batcher.h"
#include "tensorshare/tensorshare.h"

#ifdef __cplusplus
extern "C" {
#endif

/* A TorchScript model (opaque). Added in 0.1.0. */
typedef struct ts_torch_model_s ts_torch_model_t;

/*
 * Load a TorchScript module saved with torch.jit.save / Module::save, from a file or from bytes
 * (which may come straight out of a bin; they are read during the call only), onto device
 * ("cpu", "cuda" or "cuda:N"; NULL means "cpu"). The model is put in eval mode and runs every
 * forward in inference mode (no autograd). A CUDA device on a build or machine without CUDA
 * gives TS_ENOTSUP; a device number past the last GPU TS_EINVAL; a file that cannot be opened
 * TS_ENOENT; bytes that are not a TorchScript archive TS_ETORCH. Added in 0.1.0.
 */
TS_EXTERN int ts_torch_load_file(ts_torch_model_t **out, const char *path, const char *device);
TS_EXTERN int ts_torch_load_bytes(ts_torch_model_t **out, const void *data, size_t len,
                                  const char *device);
/* A deep copy of m (weights included) on device (NULL: m's device). Added in 0.1.0. */
TS_EXTERN int ts_torch_clone(ts_torch_model_t **out, const ts_torch_model_t *m, const char *device);
/* Free a model. NULL is a no-op. Added in 0.1.0. */
TS_EXTERN void ts_torch_model_free(ts_torch_model_t *m);
/* The model's device, e.g. "cpu" or "cuda:0" (valid while m lives). Added in 0.1.0. */
TS_EXTERN const char *ts_torch_model_device(const ts_torch_model_t *m);

/*
 * Run forward on input (a record or any value; borrowed). CPU tensors of input are handed to
 * libtorch without copying; for a CUDA model they go through pinned staging buffers, and the
 * copies and kernels run on the model's own CUDA stream (from libtorch's pool; set the
 * environment variable TS_TORCH_STREAMS=0 to use the device's current stream instead), so that
 * two models on one GPU overlap. *output is
 * a new value you own (tensor data copied to CPU memory). The model must not keep references to
 * its input after forward returns (use ts_torch_forward_retained when it may). Added in 0.1.0.
 */
TS_EXTERN int ts_torch_forward(ts_torch_model_t *m, const ts_value_t *input, ts_value_t **output);
/*
 * As ts_torch_forward, but input is retained until release(arg) is called: when libtorch drops
 * the last tensor that wraps input's memory. That is normally before this function returns,
 * later only when the model kept such a tensor (in an attribute, say). release is called exactly
 * once, even when this function fails. Added in 0.1.0.
 */
TS_EXTERN int ts_torch_forward_retained(ts_torch_model_t *m, const ts_value_t *input,
                                        void (*release)(void *arg), void *arg, ts_value_t **output);

/* load_state_dict: ignore missing and unexpected names. Added in 0.1.0. */
#define TS_TORCH_NONSTRICT 1u

/*
 * Load a state dict into the model's parameters and buffers: a map of dotted names to tensors
 * ({"fc1.weight": ..., ...}), nested maps allowed ({"fc1": {"weight": ...}} means the same), as
 * an RL trainer publishes it. Everything is checked before anything is copied: names missing
 * from the dict, names the model lacks (unless TS_TORCH_NONSTRICT) and shape mismatches give
 * TS_EINVAL with every offending name in ts_last_error(), and the model is unchanged.
 * dtypes convert as in Tensor.copy_. Never call it during a forward on the same model.
 * Added in 0.1.0.
 */
TS_EXTERN int ts_torch_load_state_dict(ts_torch_model_t *m, const ts_value_t *state_dict,
                                       unsigned flags);
/*
 * Export the parameters and buffers as a flat map of dotted names to (CPU copies of) tensors.
 * Added in 0.1.0.
 */
TS_EXTERN int ts_torch_state_dict(ts_torch_model_t *m, ts_value_t **out);

/*
 * Mixed precision (like torch.autocast): forwards of m, and of every copy made from it afterwards
 * (ts_torch_clone, the batcher's replicas through ts_torch_model_create), run under autocast to
 * dtype: TS_FLOAT16 (CUDA models only: a CPU model then fails its forwards and clones to the CPU
 * with TS_ENOTSUP) or TS_BFLOAT16 (CUDA, and CPU); TS_FLOAT32 turns it off. Output tensors that
 * come out in that dtype are converted back to the model's own floating dtype (its first
 * floating parameter's, float32 for most models), so answers keep the dtype the model has
 * without autocast; they differ from float32 answers by the reduced precision (about 1e-2
 * relative for bfloat16, 1e-3 for float16). Not thread-safe against forwards of m. 0, or
 * TS_EINVAL for another dtype. Added in 0.2.0.
 */
TS_EXTERN int ts_torch_set_autocast(ts_torch_model_t *m, ts_dtype_t dtype);

/* Number of CUDA devices libtorch sees (0 on CPU-only builds). Added in 0.1.0. */
TS_EXTERN int ts_torch_cuda_device_count(void);
/*
 * Threads libtorch uses inside one CPU operator (process-wide; n < 1 is ignored).
 * Added in 0.1.0.
 */
TS_EXTERN void ts_torch_set_num_threads(int n);

/*
 * The batcher's model factory for TorchScript (a ts_model_create_cb): prototype is a
 * ts_torch_model_t (borrowed; it must outlive ts_batcher_new), and every replica gets its own
 * copy on its device. The replicas run forward in inference mode and load weights with
 * ts_torch_load_state_dict (strict).
 *   opts.create = ts_torch_model_create; opts.create_arg = model;
 *   opts.cuda_devices = ts_torch_cuda_device_count();
 * Added in 0.1.0. Changed in 0.2.0: prototype comes last (the order of ts_model_create_cb).
 */
TS_EXTERN int ts_torch_model_create(const char *device, int replica, ts_model_t **out,
                                    void *prototype);

#ifdef __cplusplus
}
#endif

#endif /* TENSORSHARE_TORCH_H */
