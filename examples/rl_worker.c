/*
 * RL worker example: runs the trainer's newest linear network (10 inputs, 2 outputs) on random
 * observations and sends each rollout back as experience. See rl_trainer.c for how to run both.
 *
 * The worker never asks the daemon for parameters in its loop: ts_rl_worker_params answers
 * from the copy the library keeps fresh in the background.
 */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "tensorshare/rl.h"
#include "tensorshare/tensorshare.h"

#define N_IN  10
#define N_OUT 2

typedef struct {
    const char *address;
    const char *prefix;
    long id;
    long rollouts;
    long delay_ms;
    long wait_s;
} args_t;

static int parse_long(const char *s, long lo, long hi, long *out)
{
    char *end = NULL;
    errno = 0;
    long v = strtol(s, &end, 10);
    if (errno != 0 || end == s || *end != '\0' || v < lo || v > hi)
        return -1;
    *out = v;
    return 0;
}

static void usage(FILE *f)
{
    fprintf(f, "usage: rl_worker [--address HOST:PORT|unix:PATH] [--id N] [--rollouts N] "
               "[--delay-ms MS] [--prefix P] [--wait-s S]\n");
}

/* The options parse_args knows, each followed by a value. */
static const char *const options[] = {"--address",  "--prefix",   "--id",
                                      "--rollouts", "--delay-ms", "--wait-s"};

/* Read the command line into a. Returns -1 to go on, else the exit status (0 after --help). */
static int parse_args(int argc, char **argv, args_t *a)
{
    a->address = "127.0.0.1:8000";
    a->prefix = NULL;
    a->id = 0;
    a->rollouts = 300;
    a->delay_ms = 20;
    a->wait_s = 30;
    for (int i = 1; i < argc; i++) {
        const char *opt = argv[i];
        const char *val = i + 1 < argc ? argv[i + 1] : NULL;
        if (strcmp(opt, "--help") == 0 || strcmp(opt, "-h") == 0) {
            usage(stdout);
            return 0;
        }
        int unknown = 1;
        for (size_t k = 0; k < sizeof(options) / sizeof(options[0]); k++)
            unknown &= strcmp(opt, options[k]) != 0;
        int bad = val == NULL;
        if (strcmp(opt, "--address") == 0 && val != NULL)
            a->address = val;
        else if (strcmp(opt, "--prefix") == 0 && val != NULL)
            a->prefix = val;
        else if (strcmp(opt, "--id") == 0 && val != NULL)
            bad = parse_long(val, 0, 1000000, &a->id) != 0;
        else if (strcmp(opt, "--rollouts") == 0 && val != NULL)
            bad = parse_long(val, 0, 100000000, &a->rollouts) != 0;
        else if (strcmp(opt, "--delay-ms") == 0 && val != NULL)
            bad = parse_long(val, 0, 60000, &a->delay_ms) != 0;
        else if (strcmp(opt, "--wait-s") == 0 && val != NULL)
            bad = parse_long(val, 1, 86400, &a->wait_s) != 0;
        if (bad || unknown) {
            if (unknown)
                fprintf(stderr, "rl_worker: unknown argument '%s'\n", opt);
            else if (val == NULL)
                fprintf(stderr, "rl_worker: option '%s' needs a value\n", opt);
            else
                fprintf(stderr, "rl_worker: bad value '%s' for %s\n", val, opt);
            usage(stderr);
            return 2;
        }
        i++;
    }
    return -1;
}

/* A small xorshift generator and Box-Muller: standard normal observations, seeded per worker. */
static unsigned long long rng_state;

static double uniform01(void)
{
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return ((double)(rng_state >> 11) + 0.5) / 9007199254740992.0;
}

static float randn(void)
{
    double u1 = uniform01(), u2 = uniform01();
    return (float)(sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2));
}

/*
 * out = weight * x + bias with the published state dict. Returns 0, or -1 when the parameters
 * do not have the expected shapes.
 */
static int forward(const ts_value_t *sd, const float *x, float *out)
{
    const ts_tensor_t *w = ts_map_get_tensor(sd, "weight");
    const ts_tensor_t *b = ts_map_get_tensor(sd, "bias");
    if (w == NULL || b == NULL || w->dtype != TS_FLOAT32 || b->dtype != TS_FLOAT32 ||
        ts_tensor_numel(w) != N_OUT * N_IN || ts_tensor_numel(b) != N_OUT)
        return -1;
    const float *wd = w->data, *bd = b->data;
    for (int j = 0; j < N_OUT; j++) {
        float y = bd[j];
        for (int k = 0; k < N_IN; k++)
            y += wd[j * N_IN + k] * x[k];
        out[j] = y;
    }
    return 0;
}

static void sleep_ms(long ms)
{
    struct timespec ts = {ms / 1000, (ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

int main(int argc, char **argv)
{
    args_t a;
    int exit_status = parse_args(argc, argv, &a);
    if (exit_status >= 0)
        return exit_status;
    rng_state = 0x9E3779B97F4A7C15ull ^ ((unsigned long long)a.id * 0x100000001B3ull);

    ts_client_t *c = NULL;
    int rc = ts_client_open(&c, a.address, NULL);
    if (rc != 0) {
        fprintf(stderr, "rl_worker: cannot connect to %s: %s\n", a.address, ts_strerror(rc));
        return 1;
    }
    ts_rl_options_t opts;
    ts_rl_options_init(&opts);
    opts.prefix = a.prefix;
    ts_rl_worker_t *w = NULL;
    rc = ts_rl_worker_new(&w, c, &opts);
    if (rc != 0) {
        fprintf(stderr, "rl_worker: %s\n", ts_strerror(rc));
        ts_client_free(c);
        return 1;
    }

    /* Load the latest published parameters, waiting for the first publish if needed. */
    ts_rl_params_t *p = NULL;
    rc = ts_rl_worker_params(w, &p);
    if (rc == TS_ENOENT)
        rc = ts_rl_worker_await(w, (int)a.wait_s * 1000, &p);
    if (rc != 0) {
        fprintf(stderr, "rl_worker %ld: no parameters: %s\n", a.id, ts_strerror(rc));
        ts_rl_worker_free(w);
        ts_client_free(c);
        return 1;
    }

    int exit_code = 0;
    const int64_t obs_shape[1] = {N_IN};
    const int64_t out_shape[1] = {N_OUT};
    for (long i = 0; i < a.rollouts; i++) {
        float x[N_IN], y[N_OUT];
        for (int k = 0; k < N_IN; k++)
            x[k] = randn();
        if (forward(ts_rl_params_value(p), x, y) != 0) {
            fprintf(stderr, "rl_worker %ld: unexpected parameters\n", a.id);
            exit_code = 1;
            break;
        }
        /* A rollout: the observation and what the network made of it, copied by the add. */
        ts_value_t *item = ts_map_new();
        if (ts_map_set(item, "obs", ts_tensor_new(TS_FLOAT32, 1, obs_shape, x, TS_BORROW)) != 0 ||
            ts_map_set(item, "out", ts_tensor_new(TS_FLOAT32, 1, out_shape, y, TS_BORROW)) != 0 ||
            ts_map_set(item, "worker", ts_int_new(a.id)) != 0) {
            ts_value_free(item);
            exit_code = 1;
            break;
        }
        rc = ts_rl_worker_add(w, item, TS_COPY);
        ts_value_free(item);
        if (rc != 0)
            fprintf(stderr, "rl_worker %ld: add: %s\n", a.id, ts_strerror(rc));
        if (a.delay_ms > 0)
            sleep_ms(a.delay_ms);

        /* Switch to the newest parameters: a local answer, no round trip. */
        ts_rl_params_t *newest = NULL;
        if (ts_rl_worker_params(w, &newest) == 0) {
            ts_rl_params_release(p);
            p = newest;
        }
    }
    rc = ts_rl_worker_flush(w, (int)a.wait_s * 1000);
    if (rc != 0) {
        fprintf(stderr, "rl_worker %ld: some experience was not stored: %s\n", a.id,
                ts_strerror(rc));
        exit_code = 1;
    }

    ts_rl_worker_stats_t st;
    ts_rl_worker_stats(w, &st);
    printf("worker %ld: parameter version %lld, %llu rollouts stored, %llu failed, "
           "%llu parameter updates, %llu reconnects\n",
           a.id, (long long)ts_rl_params_version(p), (unsigned long long)st.added,
           (unsigned long long)st.add_failed, (unsigned long long)st.updates,
           (unsigned long long)st.resubscribes);
    ts_rl_params_release(p);
    ts_rl_worker_free(w);
    ts_client_free(c);
    return exit_code;
}
