/*
 * Batched inference quick start: many small workers ask one TorchScript network for answers,
 * and the batcher runs their rows together.
 *
 *   batch_quickstart MODEL.pt [HOST:PORT]
 *
 * MODEL.pt takes {x: [N,16], y: [N,16]} and returns {output: [N,1], sum: [N,16]}, like this
 * TorchScript module (tests/shim/make_models.cpp builds one, dict.pt):
 *
 *   def forward(self, inp: Dict[str, Tensor]) -> Dict[str, Tensor]:
 *       x, y = inp["x"], inp["y"]
 *       return {"output": self.linear(x), "sum": x + y}
 *
 * Without HOST:PORT, four worker threads predict in process. With it, the batcher also serves
 * the model through that tensord as "small", and a remote predictor (what a worker on another
 * machine would run) asks it too.
 */
#include <pthread.h>
#include <stdio.h>
#include <string.h>

#include "tensorshare/batcher.h"
#include "tensorshare/tensorshare.h"
#include "tensorshare/torch.h"

#define BATCH 8 /* rows each worker sends at once */

/* The buffers' shapes and dtypes, per row (without the batch dimension). */
static const ts_field_t input_schema[] = {
    {"x", TS_FLOAT32, 1, {16}},
    {"y", TS_FLOAT32, 1, {16}},
};
static const ts_field_t output_schema[] = {
    {"output", TS_FLOAT32, 1, {1}},
    {"sum", TS_FLOAT32, 1, {16}},
};

/* {x, y}: BATCH rows of 16 values, filled from seed. */
static ts_value_t *make_input(int seed)
{
    static const int64_t shape[2] = {BATCH, 16};
    ts_value_t *in = ts_map_new();
    ts_value_t *x = ts_tensor_alloc(TS_FLOAT32, 2, shape);
    ts_value_t *y = ts_tensor_alloc(TS_FLOAT32, 2, shape);
    if (x != NULL && y != NULL) {
        float *xs = ts_value_tensor(x)->data, *ys = ts_value_tensor(y)->data;
        for (int i = 0; i < BATCH * 16; i++) {
            xs[i] = (float)((seed * 31 + i) % 17) / 17.0f;
            ys[i] = 1.0f;
        }
    }
    if (ts_map_set(in, "x", x) != 0 || ts_map_set(in, "y", y) != 0) {
        ts_value_free(in);
        return NULL;
    }
    return in;
}

static void print_output(const char *who, const ts_value_t *out, int64_t version)
{
    const ts_tensor_t *o = ts_map_get_tensor(out, "output");
    const ts_tensor_t *s = ts_map_get_tensor(out, "sum");
    printf("%s: weights v%lld, output[0..3] = %.4f %.4f %.4f %.4f, sum[0][0] = %.4f\n", who,
           (long long)version, ((const float *)o->data)[0], ((const float *)o->data)[1],
           ((const float *)o->data)[2], ((const float *)o->data)[3], ((const float *)s->data)[0]);
}

typedef struct worker {
    ts_batcher_t *b;
    int id;
    int rc; /* the prediction's status */
} worker;

static void *worker_main(void *arg)
{
    worker *w = arg;
    ts_value_t *in = make_input(w->id);
    ts_value_t *out = NULL;
    int64_t version = 0;
    int rc = ts_batcher_predict(w->b, in, TS_TIMEOUT_DEFAULT, &out, &version);
    w->rc = rc;
    if (rc == 0) {
        char who[32];
        snprintf(who, sizeof(who), "worker %d", w->id);
        print_output(who, out, version);
    } else {
        fprintf(stderr, "worker %d: %s (%s)\n", w->id, ts_strerror(rc), ts_last_error());
    }
    ts_value_free(out);
    ts_value_free(in);
    return NULL;
}

int main(int argc, char **argv)
{
    static const char usage[] =
        "usage: batch_quickstart MODEL.pt [HOST:PORT]\n"
        "  MODEL.pt   a TorchScript module taking {x: [N,16], y: [N,16]} (see the top of\n"
        "             batch_quickstart.c; tests/shim/make_models.cpp builds one, dict.pt)\n"
        "  HOST:PORT  also serve the model through this tensord, and ask it remotely\n";
    if (argc > 1 && (strcmp(argv[1], "--help") == 0 || strcmp(argv[1], "-h") == 0)) {
        fputs(usage, stdout);
        return 0;
    }
    if (argc < 2 || argc > 3 || argv[1][0] == '-' || (argc == 3 && argv[2][0] == '-')) {
        if (argc < 2)
            fprintf(stderr, "batch_quickstart: MODEL.pt missing\n");
        else
            fprintf(stderr, "batch_quickstart: unexpected argument '%s'\n",
                    argc > 3            ? argv[3]
                    : argv[1][0] == '-' ? argv[1]
                                        : argv[2]);
        fputs(usage, stderr);
        return 2;
    }
    ts_torch_model_t *model = NULL;
    int rc = ts_torch_load_file(&model, argv[1], "cpu");
    if (rc != 0) {
        fprintf(stderr, "loading %s: %s\n", argv[1], ts_last_error());
        return 1;
    }

    ts_batcher_options_t cfg;
    ts_batcher_options_init(&cfg);
    cfg.inputs = input_schema;
    cfg.n_inputs = 2;
    cfg.outputs = output_schema;
    cfg.n_outputs = 2;
    cfg.max_batch = 4 * BATCH; /* rows per forward */
    cfg.max_delay_us = 1000;   /* wait up to 1 ms for more rows */
    /* One replica on the GPU when there is one, else on a CPU thread. */
    cfg.cuda_devices = ts_torch_cuda_device_count();
    cfg.placement = cfg.cuda_devices > 0 ? "cuda:0" : "cpu";
    cfg.create = ts_torch_model_create;
    cfg.create_arg = model;
    ts_batcher_t *b = NULL;
    rc = ts_batcher_new(&b, &cfg);
    if (rc != 0) {
        fprintf(stderr, "batcher: %s\n", ts_last_error());
        ts_torch_model_free(model);
        return 1;
    }
    printf("batcher: 1 replica on %s, max batch %d rows\n", ts_batcher_device(b, 0), cfg.max_batch);

    /* In process: four workers at once; their rows share forwards. */
    pthread_t th[4];
    worker w[4];
    for (int i = 0; i < 4; i++) {
        w[i] = (worker){b, i, 0};
        pthread_create(&th[i], NULL, worker_main, &w[i]);
    }
    for (int i = 0; i < 4; i++) {
        pthread_join(th[i], NULL);
        if (w[i].rc != 0)
            rc = w[i].rc;
    }

    /* Through tensord: serve, then ask as a remote worker would. */
    if (rc == 0 && argc > 2) {
        ts_client_t *server_side = NULL, *worker_side = NULL;
        ts_predictor_t *p = NULL;
        rc = ts_client_open(&server_side, argv[2], NULL);
        if (rc == 0)
            rc = ts_batcher_serve(b, server_side, "small");
        if (rc == 0)
            rc = ts_client_open(&worker_side, argv[2], NULL);
        if (rc == 0)
            rc = ts_predictor_open(&p, worker_side, "small");
        if (rc == 0) {
            ts_value_t *in = make_input(42), *out = NULL;
            int64_t version = 0;
            rc = ts_predictor_predict(p, in, 10000, &out, &version);
            if (rc == 0)
                print_output("remote worker", out, version);
            ts_value_free(out);
            ts_value_free(in);
        }
        if (rc != 0)
            fprintf(stderr, "remote: %s (%s)\n", ts_strerror(rc), ts_last_error());
        ts_predictor_free(p);
        ts_batcher_stop_remote(b);
        ts_client_free(worker_side);
        ts_client_free(server_side);
    }

    ts_batcher_stats_t st;
    ts_batcher_stats(b, &st);
    printf("%llu requests in %llu forwards\n", (unsigned long long)st.requests,
           (unsigned long long)st.batches);
    ts_batcher_free(b);
    ts_torch_model_free(model);
    return rc == 0 ? 0 : 1;
}
