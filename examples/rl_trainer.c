/*
 * RL trainer example: a small linear network (10 inputs, 2 outputs) trained on rollouts that
 * rl_worker processes send. Each iteration aggregates a batch of observations, takes one
 * gradient step on the mean output and publishes the new parameters.
 *
 *   tensord --port 8000 &
 *   rl_trainer --address 127.0.0.1:8000 --iterations 20 &
 *   rl_worker --address 127.0.0.1:8000 --id 1 --rollouts 200 &
 *   rl_worker --address 127.0.0.1:8000 --id 2 --rollouts 200
 *
 * Plain C math, no libtorch: the point is the data flow, not the model.
 */
#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "tensorshare/rl.h"
#include "tensorshare/tensorshare.h"

#define N_IN      10
#define N_OUT     2
#define MAX_BATCH 4096 /* rows; the batch buffer is static */

typedef struct {
    const char *address;
    const char *prefix;
    long iterations;
    long batch;
    long tolerance;
    long wait_s;
    double lr;
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
    fprintf(f, "usage: rl_trainer [--address HOST:PORT|unix:PATH] [--iterations N] "
               "[--batch N] [--prefix P] [--tolerance K|-1] [--wait-s S]\n");
}

/* The options parse_args knows, each followed by a value. */
static const char *const options[] = {"--address", "--prefix",    "--iterations",
                                      "--batch",   "--tolerance", "--wait-s"};

/* Read the command line into a. Returns -1 to go on, else the exit status (0 after --help). */
static int parse_args(int argc, char **argv, args_t *a)
{
    a->address = "127.0.0.1:8000";
    a->prefix = NULL;
    a->iterations = 10;
    a->batch = 16;
    a->tolerance = TS_RL_NO_FILTER; /* the original example trains on off-policy samples too */
    a->wait_s = 30;
    a->lr = 0.001;
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
        else if (strcmp(opt, "--iterations") == 0 && val != NULL)
            bad = parse_long(val, 1, 1000000, &a->iterations) != 0;
        else if (strcmp(opt, "--batch") == 0 && val != NULL)
            bad = parse_long(val, 1, MAX_BATCH, &a->batch) != 0;
        else if (strcmp(opt, "--tolerance") == 0 && val != NULL)
            bad = parse_long(val, -1, INT_MAX, &a->tolerance) != 0;
        else if (strcmp(opt, "--wait-s") == 0 && val != NULL)
            bad = parse_long(val, 1, 86400, &a->wait_s) != 0;
        if (bad || unknown) {
            if (unknown)
                fprintf(stderr, "rl_trainer: unknown argument '%s'\n", opt);
            else if (val == NULL)
                fprintf(stderr, "rl_trainer: option '%s' needs a value\n", opt);
            else
                fprintf(stderr, "rl_trainer: bad value '%s' for %s\n", val, opt);
            usage(stderr);
            return 2;
        }
        i++;
    }
    return -1;
}

static void sleep_ms(long ms)
{
    struct timespec ts = {ms / 1000, (ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

/* The network: out = weight * x + bias. */
typedef struct {
    float weight[N_OUT][N_IN];
    float bias[N_OUT];
} net_t;

static void net_init(net_t *net)
{
    /* A fixed, small initialisation keeps runs comparable. */
    for (int j = 0; j < N_OUT; j++) {
        for (int k = 0; k < N_IN; k++)
            net->weight[j][k] = 0.1f * (float)((j * N_IN + k) % 7 - 3);
        net->bias[j] = 0.0f;
    }
}

/* The state dict {weight, bias} over the network's memory (borrowed, not copied). */
static ts_value_t *net_state_dict(net_t *net)
{
    const int64_t wshape[2] = {N_OUT, N_IN};
    const int64_t bshape[1] = {N_OUT};
    ts_value_t *sd = ts_map_new();
    if (sd == NULL)
        return NULL;
    if (ts_map_set(sd, "weight", ts_tensor_new(TS_FLOAT32, 2, wshape, net->weight, TS_BORROW)) !=
            0 ||
        ts_map_set(sd, "bias", ts_tensor_new(TS_FLOAT32, 1, bshape, net->bias, TS_BORROW)) != 0) {
        ts_value_free(sd);
        return NULL;
    }
    return sd;
}

static int publish(ts_rl_trainer_t *t, net_t *net, int64_t *version)
{
    ts_value_t *sd = net_state_dict(net);
    if (sd == NULL)
        return TS_ENOMEM;
    int rc = ts_rl_trainer_publish(t, sd, version);
    ts_value_free(sd);
    return rc;
}

/*
 * Copy the observations of a batch into buf (rows of N_IN floats), at most cap rows.
 * Returns the rows taken; items without a float32 "obs" tensor of N_IN elements are skipped.
 */
static long take_rows(const ts_rl_batch_t *b, float (*buf)[N_IN], long cap)
{
    long rows = 0;
    for (size_t i = 0; i < ts_rl_batch_count(b) && rows < cap; i++) {
        const ts_tensor_t *obs = ts_map_get_tensor(ts_rl_batch_data(b, i), "obs");
        if (obs == NULL || obs->dtype != TS_FLOAT32 || ts_tensor_numel(obs) != N_IN)
            continue;
        memcpy(buf[rows], obs->data, sizeof(buf[rows]));
        rows++;
    }
    return rows;
}

/* One gradient step on loss = mean over the batch and outputs of (weight * x + bias). */
static double train_step(net_t *net, float (*buf)[N_IN], long rows, double lr)
{
    double loss = 0.0;
    double xsum[N_IN] = {0};
    for (long r = 0; r < rows; r++) {
        for (int j = 0; j < N_OUT; j++) {
            double y = net->bias[j];
            for (int k = 0; k < N_IN; k++)
                y += (double)net->weight[j][k] * buf[r][k];
            loss += y;
        }
        for (int k = 0; k < N_IN; k++)
            xsum[k] += buf[r][k];
    }
    double scale = 1.0 / ((double)rows * N_OUT);
    loss *= scale;
    /* d loss / d weight[j][k] = scale * sum_r x[r][k]; the original updates the weight only. */
    for (int j = 0; j < N_OUT; j++)
        for (int k = 0; k < N_IN; k++)
            net->weight[j][k] -= (float)(lr * scale * xsum[k]);
    return loss;
}

int main(int argc, char **argv)
{
    args_t a;
    int exit_status = parse_args(argc, argv, &a);
    if (exit_status >= 0)
        return exit_status;

    ts_client_t *c = NULL;
    int rc = ts_client_open(&c, a.address, NULL);
    if (rc != 0) {
        fprintf(stderr, "rl_trainer: cannot connect to %s: %s\n", a.address, ts_strerror(rc));
        return 1;
    }
    ts_rl_options_t opts;
    ts_rl_options_init(&opts);
    opts.prefix = a.prefix;
    opts.staleness_tolerance = (int)a.tolerance;
    ts_rl_trainer_t *t = NULL;
    rc = ts_rl_trainer_new(&t, c, &opts);
    if (rc != 0) {
        fprintf(stderr, "rl_trainer: %s\n", ts_strerror(rc));
        ts_client_free(c);
        return 1;
    }
    if (ts_rl_trainer_version(t) >= 0)
        printf("resuming after parameter version %lld\n", (long long)ts_rl_trainer_version(t));

    net_t net;
    net_init(&net);
    static float buf[MAX_BATCH][N_IN];
    int64_t version = -1;
    int exit_code = 0;
    rc = publish(t, &net, &version);
    if (rc != 0) {
        fprintf(stderr, "rl_trainer: publish: %s\n", ts_strerror(rc));
        exit_code = 1;
    }

    for (long it = 0; exit_code == 0 && it < a.iterations; it++) {
        /* Aggregate a batch: block on the daemon until workers deliver, no polling sleep. */
        long rows = 0, retries = 0;
        while (rows < a.batch) {
            ts_rl_batch_t *b = NULL;
            rc = ts_rl_trainer_collect(t, (size_t)(a.batch - rows), (int)a.wait_s * 1000, &b);
            if ((rc == TS_ECONNRESET || rc == TS_ENOTCONN) && retries++ < a.wait_s * 10) {
                /* The daemon restarts; the client reconnects on its own meanwhile. */
                fprintf(stderr, "rl_trainer: %s, retrying\n", ts_strerror(rc));
                sleep_ms(100);
                continue;
            }
            if (rc != 0) {
                fprintf(stderr, "rl_trainer: no experience for %ld s: %s\n", a.wait_s,
                        ts_strerror(rc));
                exit_code = 1;
                break;
            }
            rows += take_rows(b, buf + rows, a.batch - rows);
            ts_rl_batch_free(b);
        }
        if (exit_code != 0)
            break;

        double loss = train_step(&net, buf, rows, a.lr);
        rc = publish(t, &net, &version);
        if (rc != 0) {
            fprintf(stderr, "rl_trainer: publish: %s\n", ts_strerror(rc));
            exit_code = 1;
            break;
        }
        printf("iteration %ld loss %.6f published version %lld\n", it, loss, (long long)version);
        fflush(stdout);
    }

    ts_rl_trainer_stats_t st;
    ts_rl_trainer_stats(t, &st);
    printf("trainer: version %lld, %llu items received, %llu stale and %llu malformed dropped\n",
           (long long)st.version, (unsigned long long)st.received,
           (unsigned long long)st.dropped_stale, (unsigned long long)st.dropped_malformed);
    ts_rl_trainer_free(t);
    ts_client_free(c);
    return exit_code;
}
