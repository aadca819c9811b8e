/*
 * tensorshare parameter server: optimizer steps applied by tensord to the tensors it stores
 * (dense parameters), and embedding tables (rows of floats by int64 id, created on first use).
 * docs/PS.md describes the modes, the dtype rules, the NaN policy and versions; the wire form is
 * docs/PROTOCOL.md 8.45 to 8.50.
 *
 * A dense parameter is a plain bin holding one item whose record's root is a float32 tensor: put
 * it with ts_put, make it a parameter with ts_ps_create, then push gradients and pull the value.
 * ts_peek, ts_wait and ts_listen work on it like on any bin; every applied step replaces the
 * item with a new one (readers holding the old one keep it whole) and gives the bin a new
 * version.
 *
 * Every call names its parameter or table and nothing else, so that a client opened on a
 * cluster address routes it like any other call that names a bin: dense parameters by the
 * name's slot. An embedding table exists on every shard of a cluster and its rows are spread by
 * id (the slot of the id's 8 little-endian bytes): ts_emb_create goes to every shard, ts_emb_pull
 * and ts_emb_push split their ids by shard and send the parts at once (since 0.6.0; docs/PS.md
 * "Several daemons").
 *
 * Conventions are those of tensorshare.h: 0 or a negative TS_E* code with its reason in
 * ts_last_error(), out-parameters written only on success (they may be NULL) except where a
 * function says otherwise, borrowed pointer parameters. Every call blocks: it may be made from
 * any thread (one client may be shared), never from a client callback (TS_EDEADLK), and is
 * bounded by the client's request timeout. Names are NUL-terminated strings of at most 255
 * bytes (NULL: TS_EINVAL; longer: TS_ENAMETOOLONG). Server errors common to all: TS_EINVAL for
 * bad input (nothing changed), TS_ENOENT, TS_EOOM, TS_ESAVEFAIL, TS_ESHUTDOWN. Added in 0.5.0.
 */
#ifndef TENSORSHARE_PS_H
#define TENSORSHARE_PS_H

#include <stddef.h>
#include <stdint.h>

#include "tensorshare/tensorshare.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Optimizers (the wire codes). Added in 0.5.0. */
typedef enum ts_ps_optimizer_e {
    TS_PS_SUM = 0,      /* p += scale * g: accumulation (no learning rate) */
    TS_PS_SGD = 1,      /* p -= lr * g */
    TS_PS_MOMENTUM = 2, /* v = beta1 * v + g; p -= lr * v */
    TS_PS_ADAM = 3      /* Adam (beta1, beta2, eps) with bias correction */
} ts_ps_optimizer_t;

/* Modes of a dense parameter. Added in 0.5.0. */
typedef enum ts_ps_mode_e {
    TS_PS_ASYNC = 0, /* every push is applied on its own */
    TS_PS_SYNC = 1   /* sync_k pushes are averaged into one step */
} ts_ps_mode_t;

/* Row initializers of an embedding table (docs/PS.md gives the formulas). Added in 0.5.0. */
typedef enum ts_ps_init_e {
    TS_PS_INIT_ZEROS = 0,
    TS_PS_INIT_UNIFORM = 1, /* uniform in [-init_scale, init_scale) */
    TS_PS_INIT_NORMAL = 2   /* normal, mean 0, standard deviation init_scale */
} ts_ps_init_t;

/*
 * The settings of a dense parameter (ts_ps_options_init fills the defaults: SGD, async, lr 0.01,
 * beta1 0.9, beta2 0.999, eps 1e-8, sync_k 1, tolerance 0, no staleness scaling). Added in 0.5.0.
 */
typedef struct ts_ps_options_s {
    ts_ps_optimizer_t optimizer;
    ts_ps_mode_t mode;
    uint32_t sync_k;    /* sync: gradients averaged into one step (1 to 65536) */
    uint32_t tolerance; /* sync: steps a gradient may lag its parameter (below 1024) */
    int lr_staleness;   /* async: divide the learning rate by the gradient's staleness */
    /*
     * ts_ps_create: when the bin already is a parameter with the same settings (one restored
     * from a snapshot, or made by another worker), keep it as it is (slots, step counts, queued
     * pushes) instead of resetting it; with other settings (or another element count) the call
     * is TS_EINVAL and nothing changes. 0 (the default): replace and reset. Sits in what was
     * padding before 0.6.0, so the struct keeps its size. Added in 0.6.0.
     */
    int keep;
    double lr, beta1, beta2, eps;
} ts_ps_options_t;
/* Fill o with the defaults. Added in 0.5.0. */
TS_EXTERN void ts_ps_options_init(ts_ps_options_t *o);

/*
 * Make bin name (one item whose record's root is a float32 tensor) a parameter with the
 * settings o (NULL: the defaults). Its optimizer slots start at zero. Calling it again replaces
 * the settings and zeroes the slots, unless pushes are in flight (TS_EINVAL), or, with o->keep
 * set, leaves a parameter of the same settings untouched (the way to start again from a
 * snapshot without losing the optimizer's state). *version: the
 * bin's version. TS_ENOENT: no such bin; TS_EINVAL: another record, bad settings, or the name of
 * a stream or a replay table.
 * Added in 0.5.0.
 */
TS_EXTERN int ts_ps_create(ts_client_t *c, const char *name, const ts_ps_options_t *o,
                           uint64_t *version);

/*
 * Push gradient grad (float32, the parameter's shape; borrowed, sent from the caller's memory
 * during the call) into parameter name, multiplied by scale. base_version is the version of the
 * parameter the gradient was computed on (0: unknown, no staleness check). Returns once the
 * push is applied: async, at once after its own step; sync, once the step it is part of (sync_k
 * pushes) is applied. *version: the parameter's version after it. TS_ESTALE (sync): the
 * gradient lags by more than the tolerance; nothing changed, and *version is set to the
 * parameter's current version (the one out-parameter written on an error). TS_EINVAL: another
 * shape or dtype, a NaN or infinity in the gradient, a non-finite scale, the name of a stream or
 * a replay table (nothing changed). TS_ENOENT: not a parameter. A sync push waits for others: give
 * the client a request timeout long enough for a step to form. Added in 0.5.0.
 */
TS_EXTERN int ts_ps_push(ts_client_t *c, const char *name, const ts_tensor_t *grad,
                         uint64_t base_version, double scale, uint64_t *version);

/*
 * Pull bin name's newest item when its version is above if_newer_than (0: always): *out gets
 * the items (one; transferred, ts_items_free), or NULL when the bin is not newer. *version: the
 * bin's version either way. One round trip. Works on any bin but a stream or a replay table
 * (TS_EINVAL). Added in 0.5.0.
 */
TS_EXTERN int ts_ps_pull(ts_client_t *c, const char *name, uint64_t if_newer_than, ts_items_t **out,
                         uint64_t *version);

/*
 * The settings of an embedding table (ts_emb_options_init fills the defaults for dim: SGD,
 * lr 0.01, beta1 0.9, beta2 0.999, eps 1e-8, uniform rows in [-0.05, 0.05) from seed 0, any
 * id >= 0). Added in 0.5.0.
 */
typedef struct ts_emb_options_s {
    uint32_t dim; /* floats per row, 1 to 65536 */
    ts_ps_optimizer_t optimizer;
    ts_ps_init_t init;
    uint64_t seed;    /* the initializer's seed: the same on every daemon gives the same rows */
    uint64_t num_ids; /* ids must be below it (at most 2^63 - 1); 0: any id >= 0 */
    double lr, beta1, beta2, eps;
    double init_scale;
} ts_emb_options_t;
/* Fill o with the defaults for rows of dim floats. Added in 0.5.0. */
TS_EXTERN void ts_emb_options_init(ts_emb_options_t *o, uint32_t dim);

/*
 * Create embedding table name (its own namespace: not a bin, not in ts_list). Creating it again
 * with the same settings succeeds and changes nothing; with other settings it is TS_EINVAL.
 * Added in 0.5.0.
 */
TS_EXTERN int ts_emb_create(ts_client_t *c, const char *name, const ts_emb_options_t *o);

/*
 * Read the rows of ids[0..n) (each >= 0 and below the table's num_ids) into out, n x dim floats
 * in the order of ids (dim must be the table's). Rows that do not exist yet are created by the
 * table's initializer first. Duplicate ids are sent once and copied back to every place they
 * appear. *version: the table's version. TS_EINVAL: an id out of range (nothing created), or
 * another dim: the request carries no dim, so the client finds the mismatch in the answer, and
 * rows the pull made for new ids stay in the table (as a pull with the right dim would have made
 * them; out is not written). Added in 0.5.0.
 */
TS_EXTERN int ts_emb_pull(ts_client_t *c, const char *name, const int64_t *ids, size_t n,
                          uint32_t dim, float *out, uint64_t *version);

/*
 * Push row gradients: grads holds n x dim floats, row i for ids[i], multiplied by scale. Rows of
 * a duplicate id get one optimizer step with the sum of their gradients. Missing rows are
 * created first. *version: the table's version after the step. TS_EINVAL: an id out of range,
 * another dim, a NaN or infinity, a non-finite scale (nothing changed). Added in 0.5.0.
 */
TS_EXTERN int ts_emb_push(ts_client_t *c, const char *name, const int64_t *ids, size_t n,
                          uint32_t dim, const float *grads, double scale, uint64_t *version);

/*
 * The version of table name on each daemon that holds it: versions[i] for the i-th shard of a
 * cluster handle that owns slots, in the order of the addresses given to ts_client_open (its list
 * or map file; addresses learned later from the daemons follow), which may differ from the
 * shard order of the daemons' map; versions[0] alone for a client of one daemon; *n gets how
 * many there are (at most the cluster's shards), and only the first cap are written. One
 * EMB_PULL of no ids per daemon, sent at once; no row is made. On a cluster, ts_emb_pull's and
 * ts_emb_push's *version is the highest of the shards the call reached; a worker that needs to
 * know which shard moved keeps this vector instead. Added in 0.6.0.
 */
TS_EXTERN int ts_emb_versions(ts_client_t *c, const char *name, uint64_t *versions, size_t cap,
                              size_t *n);

#ifdef __cplusplus
}
#endif

#endif /* TENSORSHARE_PS_H */
