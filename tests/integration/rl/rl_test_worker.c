/*
 * A worker process for the RL integration tests.
 *
 *   rl_test_worker ADDRESS ID N_ITEMS DELAY_MS MIN_VERSION [PREFIX]
 *
 * Adds N_ITEMS experience items {wid: ID, seq: 0..N-1, payload: int32[64] filled with seq},
 * sleeping DELAY_MS between them, and checks on the way that the parameter versions it sees
 * never go backwards. The first parameters it acts on must have at least MIN_VERSION (-1: any).
 * Exit codes: 0 all stored, 1 setup failed, 3 a version went backwards, 4 an add failed,
 * 5 the first parameters were older than MIN_VERSION, 6 bad parameters.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "tensorshare/rl.h"
#include "tensorshare/tensorshare.h"

#define PAYLOAD_N 64 /* int32 elements per item */

static int parse_ll(const char *s, long long *out)
{
    char *end = NULL;
    errno = 0;
    long long v = strtoll(s, &end, 10);
    if (errno != 0 || end == s || *end != '\0')
        return -1;
    *out = v;
    return 0;
}

static void sleep_ms(long long ms)
{
    struct timespec ts = {(time_t)(ms / 1000), (long)(ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

/* The parameters the tests publish: {w: float32[...], version_copy: int} (version_copy = v). */
static int check_params(const ts_rl_params_t *p)
{
    int64_t copy;
    if (ts_map_get_int(ts_rl_params_value(p), "version_copy", &copy) != 0)
        return 0; /* not every test writes the copy */
    return copy == ts_rl_params_version(p);
}

int main(int argc, char **argv)
{
    long long id, n, delay, min_version;
    if ((argc != 6 && argc != 7) || parse_ll(argv[2], &id) != 0 || parse_ll(argv[3], &n) != 0 ||
        parse_ll(argv[4], &delay) != 0 || parse_ll(argv[5], &min_version) != 0) {
        fprintf(stderr, "usage: rl_test_worker ADDRESS ID N DELAY_MS MIN_VERSION [PREFIX]\n");
        return 1;
    }
    ts_client_t *c = NULL;
    int rc = ts_client_open(&c, argv[1], NULL);
    if (rc != 0) {
        fprintf(stderr, "worker %lld: connect: %s\n", id, ts_strerror(rc));
        return 1;
    }
    ts_rl_options_t opts;
    ts_rl_options_init(&opts);
    opts.prefix = argc == 7 ? argv[6] : NULL;
    opts.max_in_flight = 8;
    ts_rl_worker_t *w = NULL;
    rc = ts_rl_worker_new(&w, c, &opts);
    if (rc != 0) {
        fprintf(stderr, "worker %lld: %s\n", id, ts_strerror(rc));
        ts_client_free(c);
        return 1;
    }
    ts_rl_params_t *p = NULL;
    rc = ts_rl_worker_params(w, &p);
    if (rc == TS_ENOENT)
        rc = ts_rl_worker_await(w, 20000, &p);
    if (rc != 0) {
        fprintf(stderr, "worker %lld: no parameters: %s\n", id, ts_strerror(rc));
        ts_rl_worker_free(w);
        ts_client_free(c);
        return 1;
    }
    int exit_code = 0;
    if (min_version >= 0 && ts_rl_params_version(p) < min_version) {
        fprintf(stderr, "worker %lld: first version %lld < %lld\n", id,
                (long long)ts_rl_params_version(p), min_version);
        exit_code = 5;
    }
    int64_t prev = ts_rl_params_version(p);
    const int64_t shape[1] = {PAYLOAD_N};
    int32_t payload[PAYLOAD_N];
    for (long long seq = 0; exit_code == 0 && seq < n; seq++) {
        if (!check_params(p)) {
            exit_code = 6;
            break;
        }
        for (int i = 0; i < PAYLOAD_N; i++)
            payload[i] = (int32_t)seq;
        ts_value_t *item = ts_map_new();
        if (ts_map_set(item, "wid", ts_int_new(id)) != 0 ||
            ts_map_set(item, "seq", ts_int_new(seq)) != 0 ||
            ts_map_set(item, "payload", ts_tensor_new(TS_INT32, 1, shape, payload, TS_BORROW)) !=
                0) {
            ts_value_free(item);
            exit_code = 1;
            break;
        }
        rc = ts_rl_worker_add(w, item, TS_COPY);
        ts_value_free(item);
        if (rc != 0) {
            fprintf(stderr, "worker %lld: add %lld: %s\n", id, seq, ts_strerror(rc));
            exit_code = 4;
            break;
        }
        /* Alternate the two ways of getting parameters: a local read and a zero wait. */
        ts_rl_params_t *q = NULL;
        rc = seq % 2 == 0 ? ts_rl_worker_params(w, &q) : ts_rl_worker_await(w, 0, &q);
        if (rc == 0) {
            if (ts_rl_params_version(q) < prev) {
                fprintf(stderr, "worker %lld: version went back from %lld to %lld\n", id,
                        (long long)prev, (long long)ts_rl_params_version(q));
                exit_code = 3;
            }
            prev = ts_rl_params_version(q);
            ts_rl_params_release(p);
            p = q;
        }
        if (delay > 0)
            sleep_ms(delay);
    }
    rc = ts_rl_worker_flush(w, 30000);
    if (rc != 0 && exit_code == 0) {
        fprintf(stderr, "worker %lld: flush: %s\n", id, ts_strerror(rc));
        exit_code = 4;
    }
    ts_rl_params_release(p);
    ts_rl_worker_free(w);
    ts_client_free(c);
    return exit_code;
}
