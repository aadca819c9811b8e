/*
 * Parameter server (msg_ps.c): the bodies of opcodes 0x38 to 0x3D (docs/PROTOCOL.md 8.44 to
 * 8.49). Included by msg.h; the conventions of msg.h hold (strict decoders that check the layout
 * and the reserved fields only, encoders that check their room first).
 *
 *   PS_CREATE:  name, 48 fixed bytes (optimizer, mode, ...)          -> BIN_STATE
 *   PS_PUSH:    name, u64 base_version, f64 scale, record (upload)   -> BIN_STATE
 *               (STALE_GRADIENT also carries a BIN_STATE: the parameter's current version)
 *   PS_PULL:    name, u64 if_newer_than                              -> ITEMS (0 or 1 item)
 *   EMB_CREATE: name, 64 fixed bytes (dim, optimizer, initializer...) -> BIN_STATE
 *   EMB_PULL:   name, record: int64 tensor [n] of ids (upload)       -> ITEMS (one [n, dim] tensor)
 *   EMB_PUSH:   name, f64 scale, record: list [ids, grads] (upload)  -> BIN_STATE
 *
 * The values (an unknown optimizer, a dim of 0...) are the server's to refuse (INVALID).
 */
#ifndef TS_MSG_PS_H
#define TS_MSG_PS_H

#define TS_MSG_PS_CREATE_FIXED  48 /* after the name: see ts__msg_ps_create_req */
#define TS_MSG_EMB_CREATE_FIXED 64 /* after the name: see ts__msg_ps_create_req */
#define TS_MSG_PS_PUSH_FIXED    16 /* u64 base_version, f64 scale between name and record */
#define TS_MSG_PS_PULL_FIXED    8  /* u64 if_newer_than after the name */
#define TS_MSG_EMB_PUSH_FIXED   8  /* f64 scale between name and record */

/* Optimizers (u8 on the wire; append-only). */
enum {
    TS_PS_OPT_SUM = 0,      /* p += scale * g: accumulation, no learning rate */
    TS_PS_OPT_SGD = 1,      /* p -= lr * g */
    TS_PS_OPT_MOMENTUM = 2, /* v = beta1 * v + g; p -= lr * v (one slot) */
    TS_PS_OPT_ADAM = 3,     /* Adam with bias correction (two slots and a step count) */
    TS_PS_OPT_COUNT_
};
/* Modes of a dense parameter (u8). */
enum { TS_PS_MODE_ASYNC = 0, TS_PS_MODE_SYNC = 1, TS_PS_MODE_COUNT_ };
/* PS_CREATE flags (u8). */
#define TS_PS_FLAG_LR_STALENESS 0x01 /* async: the learning rate is divided by the staleness */
#define TS_PS_FLAGS_KNOWN       0x01 /* the flags a parameter keeps (and snapshots hold) */
/* A request flag only (since 0.6.0): an existing parameter with the same settings is kept. */
#define TS_PS_FLAG_KEEP 0x02
/* Row initializers of an embedding table (u8). */
enum { TS_PSW_INIT_ZEROS = 0, TS_PSW_INIT_UNIFORM = 1, TS_PSW_INIT_NORMAL = 2, TS_PSW_INIT_COUNT_ };

/*
 * PS_CREATE and EMB_CREATE. One struct serves both; the fields a layout does not have are 0 after
 * decoding and ignored by the encoder.
 *
 * PS_CREATE fixed part (48 bytes): u8 optimizer, u8 mode, u8 flags, u8 reserved 0, u32 sync_k,
 * u32 tolerance, u32 reserved 0, f64 lr, f64 beta1, f64 beta2, f64 eps.
 * EMB_CREATE fixed part (64 bytes): u32 dim, u8 optimizer, u8 init, u16 reserved 0, u64 seed,
 * u64 num_ids, f64 lr, f64 beta1, f64 beta2, f64 eps, f64 init_scale.
 */
typedef struct ts__msg_ps_create_req {
    const uint8_t *name; /* borrowed; not NUL-terminated */
    size_t name_len;
    uint8_t optimizer;  /* TS_PS_OPT_* */
    uint8_t mode;       /* PS_CREATE: TS_PS_MODE_* */
    uint8_t flags;      /* PS_CREATE: TS_PS_FLAG_* */
    uint8_t init;       /* EMB_CREATE: TS_PS_INIT_* */
    uint32_t sync_k;    /* PS_CREATE, sync: gradients per step */
    uint32_t tolerance; /* PS_CREATE, sync: steps a gradient may lag */
    uint32_t dim;       /* EMB_CREATE: floats per row */
    uint64_t seed;      /* EMB_CREATE: the initializer's seed */
    uint64_t num_ids;   /* EMB_CREATE: ids are in [0, num_ids); 0 = any id >= 0 */
    double lr, beta1, beta2, eps;
    double init_scale; /* EMB_CREATE: uniform bound or normal standard deviation */
} ts__msg_ps_create_req;
size_t ts__msg_ps_create_req_size(size_t name_len);
int ts__msg_ps_create_req_encode(uint8_t *out, size_t cap, const ts__msg_ps_create_req *m,
                                 size_t *len);
int ts__msg_ps_create_req_decode(const uint8_t *body, size_t len, ts__msg_ps_create_req *m);
size_t ts__msg_emb_create_req_size(size_t name_len);
int ts__msg_emb_create_req_encode(uint8_t *out, size_t cap, const ts__msg_ps_create_req *m,
                                  size_t *len);
int ts__msg_emb_create_req_decode(const uint8_t *body, size_t len, ts__msg_ps_create_req *m);

/* PS_PULL: name, u64 if_newer_than (0: always the parameter). */
typedef struct ts__msg_ps_pull_req {
    const uint8_t *name; /* borrowed */
    size_t name_len;
    uint64_t if_newer_than;
} ts__msg_ps_pull_req;
size_t ts__msg_ps_pull_req_size(size_t name_len);
int ts__msg_ps_pull_req_encode(uint8_t *out, size_t cap, const ts__msg_ps_pull_req *m, size_t *len);
int ts__msg_ps_pull_req_decode(const uint8_t *body, size_t len, ts__msg_ps_pull_req *m);

/*
 * The fixed fields of PS_PUSH (16 bytes: base_version, scale) and EMB_PUSH (8 bytes: scale).
 * The decoders take exactly that many bytes (the connection kept them); any bit pattern of a
 * double is well-formed (a non-finite scale is the server's to refuse).
 */
typedef struct ts__msg_ps_push_fixed {
    uint64_t base_version; /* PS_PUSH: the version the gradient was computed on; 0 = unknown */
    double scale;
} ts__msg_ps_push_fixed;
void ts__msg_ps_push_fixed_encode(uint8_t out[TS_MSG_PS_PUSH_FIXED],
                                  const ts__msg_ps_push_fixed *m);
void ts__msg_ps_push_fixed_decode(const uint8_t in[TS_MSG_PS_PUSH_FIXED], ts__msg_ps_push_fixed *m);
void ts__msg_emb_push_fixed_encode(uint8_t out[TS_MSG_EMB_PUSH_FIXED], double scale);
double ts__msg_emb_push_fixed_decode(const uint8_t in[TS_MSG_EMB_PUSH_FIXED]);

#endif /* TS_MSG_PS_H */
