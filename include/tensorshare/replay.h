/*
 * tensorshare replay tables: prioritized experience replay kept by tensord.
 *
 * A replay table is a kind of bin that holds up to capacity items. An item is a record (a
 * ts_value_t) with a priority (a finite double >= 0) and a 64-bit key the server gives it at
 * insertion (1, 2, 3, ... per table: keys grow with insertion order). Samples are drawn with
 * replacement by the table's sampler: uniform, prioritized (item i with probability
 * p_i^exponent / sum_j p_j^exponent), FIFO (always the oldest) or LIFO (always the newest). A
 * full table evicts one item per insert with its remover (the oldest, the newest, or the lowest
 * priority); an item drawn max_times_sampled times is removed after that draw.
 *
 * Rate limiter (Reverb's): with spi = samples_per_insert and the band
 * [min_size_to_sample * spi - error_buffer, min_size_to_sample * spi + error_buffer], an insert
 * waits while (inserts + 1) * spi - samples would pass the band's top (unless the table holds
 * at most min_size_to_sample items after it: a full table keeps its size), and a draw waits while
 * the table holds fewer than min_size_to_sample items or inserts * spi - (samples + 1) would fall
 * under the band's bottom. error_buffer 0 turns the ratio off. The waits happen on the server: a
 * blocked insert or sample costs no polling, and is released by the other side's progress or ends
 * with TS_ETIMEDOUT at its timeout.
 *
 * The wire form is docs/PROTOCOL.md 8.33 to 8.38; the RL side is docs/RL.md "Replay tables".
 *
 * Conventions are those of tensorshare.h: 0 or a negative TS_E* code with its reason in
 * ts_last_error(), out-parameters written only on success (they may be NULL where a comment
 * says so), borrowed pointer parameters, _free(NULL) is a no-op. Every call is blocking, bounded
 * by the client's request timeout plus its own wait, any thread, and returns TS_EDEADLK from a
 * client callback. Waits take 0 or more ms or TS_TIMEOUT_DEFAULT (the request timeout);
 * TS_TIMEOUT_INFINITE is TS_EINVAL. Names are NUL-terminated, 1 to 255 bytes. Errors from the
 * server: TS_ENOENT (no such table), TS_EINVAL (a value the server refuses, or a name that is
 * another kind of bin; nothing changed), TS_ETIMEDOUT (the rate limiter held the call back until
 * its timeout), TS_EOOM, TS_ESAVEFAIL. Added in 0.4.0.
 */
#ifndef TENSORSHARE_REPLAY_H
#define TENSORSHARE_REPLAY_H

#include <stddef.h>
#include <stdint.h>

#include "tensorshare/tensorshare.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The most items a table may hold, and one sample may draw. Added in 0.4.0. */
#define TS_TABLE_CAPACITY_MAX (1u << 24)
#define TS_TABLE_SAMPLE_MAX   1024

/* Samplers and removers. Added in 0.4.0. */
typedef enum {
    TS_TABLE_UNIFORM = 0,
    TS_TABLE_PRIORITIZED = 1,
    TS_TABLE_FIFO = 2,
    TS_TABLE_LIFO = 3
} ts_table_sampler_t;
typedef enum {
    TS_TABLE_REMOVE_FIFO = 0,
    TS_TABLE_REMOVE_LIFO = 1,
    TS_TABLE_REMOVE_LOWEST_PRIORITY = 2
} ts_table_remover_t;

/* A table's settings; fill with ts_table_config_init. Added in 0.4.0. */
typedef struct ts_table_config_s {
    uint64_t capacity;           /* 1..TS_TABLE_CAPACITY_MAX; default 100000 */
    ts_table_sampler_t sampler;  /* default TS_TABLE_UNIFORM */
    ts_table_remover_t remover;  /* default TS_TABLE_REMOVE_FIFO */
    double priority_exponent;    /* >= 0; default 1 (prioritized sampler only) */
    uint32_t max_times_sampled;  /* 0 (default): unlimited */
    uint64_t min_size_to_sample; /* 1..capacity; default 1 */
    double samples_per_insert;   /* > 0; default 1 */
    double error_buffer;         /* 0 (default): no ratio; else >= max(1, samples_per_insert) */
} ts_table_config_t;

/* What the server says after a create, insert, update or remove. Added in 0.4.0. */
typedef struct ts_table_state_s {
    uint64_t key;     /* the inserted item's (insert), else 0 */
    uint64_t size;    /* items held now */
    uint64_t inserts; /* since the table was created */
    uint64_t samples; /* draws since the table was created */
    uint32_t done;    /* items inserted, updated or removed by the call */
    uint32_t skipped; /* keys the call named that the table does not hold */
} ts_table_state_t;

/* The items of one sample (opaque). Added in 0.4.0. */
typedef struct ts_table_sample_s ts_table_sample_t;

/* Defaults as listed above. Added in 0.4.0. */
TS_EXTERN void ts_table_config_init(ts_table_config_t *cfg);
/*
 * Create table name with cfg (NULL: the defaults). TS_EINVAL when the name is taken (by a table
 * or any other bin) or a value is out of range. st may be NULL.
 * Added in 0.4.0.
 */
TS_EXTERN int ts_table_create(ts_client_t *c, const char *name, const ts_table_config_t *cfg,
                              ts_table_state_t *st);
/*
 * Insert item with priority, waiting at most timeout_ms for the rate limiter. 0 with *key (may
 * be NULL) the key the server gave it. item is borrowed (sent from its memory).
 * Added in 0.4.0.
 */
TS_EXTERN int ts_table_insert(ts_client_t *c, const char *name, const ts_value_t *item,
                              double priority, int timeout_ms, uint64_t *key);
/*
 * Draw up to n (1..TS_TABLE_SAMPLE_MAX) items, waiting at most timeout_ms until the rate limiter
 * allows one: the server draws as many as the limiter allows then, at least one. *out is yours
 * (ts_table_sample_free).
 * Added in 0.4.0.
 */
TS_EXTERN int ts_table_sample(ts_client_t *c, const char *name, size_t n, int timeout_ms,
                              ts_table_sample_t **out);
/*
 * The draws of s, and draw i's record (borrowed from s), key, probability, draw count and age.
 * Added in 0.4.0.
 */
TS_EXTERN size_t ts_table_sample_count(const ts_table_sample_t *s);
TS_EXTERN const ts_value_t *ts_table_sample_value(const ts_table_sample_t *s, size_t i);
TS_EXTERN uint64_t ts_table_sample_key(const ts_table_sample_t *s, size_t i);
TS_EXTERN double ts_table_sample_probability(const ts_table_sample_t *s, size_t i);
TS_EXTERN uint32_t ts_table_sample_times_sampled(const ts_table_sample_t *s, size_t i);
TS_EXTERN uint64_t ts_table_sample_age_ms(const ts_table_sample_t *s, size_t i);
/* The table's size after the draw. Added in 0.4.0. */
TS_EXTERN uint64_t ts_table_sample_table_size(const ts_table_sample_t *s);
TS_EXTERN void ts_table_sample_free(ts_table_sample_t *s);
/*
 * Set the priorities of n items by key (sent in batches of 200). Keys the table does not hold
 * are skipped and counted. A bad priority (NaN, negative, infinite) is TS_EINVAL before anything
 * is sent. st (may be NULL) sums the batches' done and skipped; its other fields are the last
 * batch's.
 * Added in 0.4.0.
 */
TS_EXTERN int ts_table_update(ts_client_t *c, const char *name, size_t n, const uint64_t *keys,
                              const double *priorities, ts_table_state_t *st);
/* Remove n items by key (in batches), as ts_table_update. Added in 0.4.0. */
TS_EXTERN int ts_table_remove(ts_client_t *c, const char *name, size_t n, const uint64_t *keys,
                              ts_table_state_t *st);
/*
 * Settings, counters and the rate limiter's state as a map (size, capacity, inserts, samples,
 * deletes, min_diff, max_diff, diff, can_insert, can_sample, waiting_inserts, waiting_samples,
 * ...). *out is yours (ts_value_free).
 * Added in 0.4.0.
 */
TS_EXTERN int ts_table_info(ts_client_t *c, const char *name, ts_value_t **out);

#ifdef __cplusplus
}
#endif

#endif /* TENSORSHARE_REPLAY_H */
