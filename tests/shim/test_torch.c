/*
 * The libtorch shim from plain C: loading (file, bytes, devices), conversions of tensors, maps
 * and lists, errors raised by a model, state dicts, and TorchScript models in the batcher.
 * The models come from make_models (run first by ctest); TS_MODELS_DIR names their directory.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "tensorshare/batcher.h"
#include "tensorshare/torch.h"

static char g_dir[512];

static const char *model_path(const char *name)
{
    static _Thread_local char path[600];
    snprintf(path, sizeof(path), "%s/%s", g_dir, name);
    return path;
}

static ts_torch_model_t *load(const char *name)
{
    ts_torch_model_t *m = NULL;
    int rc = ts_torch_load_file(&m, model_path(name), "cpu");
    if (rc != 0)
        print_error("load %s: %s: %s\n", name, ts_strerror(rc), ts_last_error());
    assert_int_equal(rc, 0);
    return m;
}

/* A [rows, cols] float32 tensor value with deterministic contents from seed. */
static ts_value_t *ftensor(int64_t rows, int64_t cols, int seed)
{
    int64_t shape[2] = {rows, cols};
    ts_value_t *v = ts_tensor_alloc(TS_FLOAT32, 2, shape);
    assert_non_null(v);
    float *d = ts_value_tensor(v)->data;
    for (int64_t i = 0; i < rows * cols; i++)
        d[i] = (float)sin(0.37 * (double)(i + 1) + 1.7 * seed);
    return v;
}

static const float *fdata(const ts_value_t *v)
{
    const ts_tensor_t *t = ts_value_tensor(v);
    assert_non_null(t);
    assert_int_equal(t->dtype, TS_FLOAT32);
    return t->data;
}

/* The MLP computed in C from its exported state dict (the reference for the shim's answer). */
static void mlp_reference(const ts_value_t *sd, const float *x, int64_t rows, float *y)
{
    const float *w1 = ts_map_get_tensor(sd, "fc1.weight")->data;
    const float *b1 = ts_map_get_tensor(sd, "fc1.bias")->data;
    const float *w2 = ts_map_get_tensor(sd, "fc2.weight")->data;
    const float *b2 = ts_map_get_tensor(sd, "fc2.bias")->data;
    const float *s = ts_map_get_tensor(sd, "out_scale")->data;
    for (int64_t r = 0; r < rows; r++) {
        double h[32];
        for (int j = 0; j < 32; j++) {
            double acc = b1[j];
            for (int k = 0; k < 8; k++)
                acc += (double)w1[j * 8 + k] * x[r * 8 + k];
            h[j] = acc > 0 ? acc : 0;
        }
        for (int o = 0; o < 4; o++) {
            double acc = b2[o];
            for (int j = 0; j < 32; j++)
                acc += (double)w2[o * 32 + j] * h[j];
            y[r * 4 + o] = (float)(acc * s[o]);
        }
    }
}

static int close_enough(const float *a, const float *b, size_t n)
{
    for (size_t i = 0; i < n; i++)
        if (fabsf(a[i] - b[i]) > 1e-5f + 1e-4f * fabsf(b[i]))
            return 0;
    return 1;
}

static void test_mlp_forward(void **state)
{
    (void)state;
    ts_torch_model_t *m = load("mlp.pt");
    assert_string_equal(ts_torch_model_device(m), "cpu");
    ts_value_t *sd = NULL;
    assert_int_equal(ts_torch_state_dict(m, &sd), 0);
    assert_int_equal(ts_value_len(sd), 5);
    assert_int_equal(ts_map_get_tensor(sd, "fc1.weight")->shape[0], 32);
    assert_int_equal(ts_map_get_tensor(sd, "fc1.weight")->shape[1], 8);

    ts_value_t *x = ftensor(5, 8, 1), *y = NULL;
    assert_int_equal(ts_torch_forward(m, x, &y), 0);
    const ts_tensor_t *yt = ts_value_tensor(y);
    assert_int_equal(yt->ndim, 2);
    assert_int_equal(yt->shape[0], 5);
    assert_int_equal(yt->shape[1], 4);
    float want[20];
    mlp_reference(sd, fdata(x), 5, want);
    assert_true(close_enough(fdata(y), want, 20));
    ts_value_free(y);

    /* The same model from bytes (as it would come out of a bin). */
    FILE *f = fopen(model_path("mlp.pt"), "rb");
    assert_non_null(f);
    static char buf[1 << 20];
    size_t n = fread(buf, 1, sizeof(buf), f);
    fclose(f);
    assert_true(n > 0 && n < sizeof(buf));
    ts_torch_model_t *m2 = NULL;
    assert_int_equal(ts_torch_load_bytes(&m2, buf, n, NULL), 0);
    assert_int_equal(ts_torch_forward(m2, x, &y), 0);
    assert_true(close_enough(fdata(y), want, 20));
    ts_value_free(y);
    ts_torch_model_free(m2);

    /* Garbage bytes are a libtorch error, with a message. */
    assert_int_equal(ts_torch_load_bytes(&m2, "not a model", 11, "cpu"), TS_ETORCH);
    assert_true(strlen(ts_last_error()) > 0);
    assert_int_equal(ts_torch_load_file(&m2, model_path("missing.pt"), "cpu"), TS_ENOENT);

    ts_value_free(x);
    ts_value_free(sd);
    ts_torch_model_free(m);
}

/* On a GPU build with a GPU: the MLP on cuda:0 (pinned staging) answers like on the CPU. */
static void check_cuda_forward(void)
{
    ts_torch_model_t *cpu = load("mlp.pt"), *gpu = NULL;
    int rc = ts_torch_load_file(&gpu, model_path("mlp.pt"), "cuda:0");
    if (rc != 0)
        print_error("cuda:0: %s\n", ts_last_error());
    assert_int_equal(rc, 0);
    assert_string_equal(ts_torch_model_device(gpu), "cuda:0");
    ts_value_t *x = ftensor(5, 8, 3), *a = NULL, *b = NULL;
    assert_int_equal(ts_torch_forward(cpu, x, &a), 0);
    assert_int_equal(ts_torch_forward(gpu, x, &b), 0);
    assert_true(close_enough(fdata(b), fdata(a), 20));
    /* State dicts travel both ways. */
    ts_value_t *sd = NULL;
    assert_int_equal(ts_torch_state_dict(gpu, &sd), 0);
    assert_int_equal(ts_torch_load_state_dict(gpu, sd, 0), 0);
    ts_value_free(sd);
    ts_value_free(a);
    ts_value_free(b);
    ts_value_free(x);
    ts_torch_model_free(gpu);
    ts_torch_model_free(cpu);
}

static void test_devices(void **state)
{
    (void)state;
    ts_torch_model_t *m = NULL;
    int gpus = ts_torch_cuda_device_count();
    print_message("    %d CUDA device(s)\n", gpus);
    if (gpus == 0) {
        /* Debian's libtorch is CPU-only: a CUDA device is a clear error. */
        assert_int_equal(ts_torch_load_file(&m, model_path("mlp.pt"), "cuda:0"), TS_ENOTSUP);
        assert_non_null(strstr(ts_last_error(), "CUDA is not available"));
        assert_non_null(strstr(ts_last_error(), "cuda:0"));
        assert_int_equal(ts_torch_load_file(&m, model_path("mlp.pt"), "cuda"), TS_ENOTSUP);
    } else {
        check_cuda_forward();
        char past[32];
        snprintf(past, sizeof(past), "cuda:%d", gpus);
        assert_int_equal(ts_torch_load_file(&m, model_path("mlp.pt"), past), TS_EINVAL);
    }
    assert_int_equal(ts_torch_load_file(&m, model_path("mlp.pt"), "tpu:0"), TS_EINVAL);
    assert_int_equal(ts_torch_load_file(&m, model_path("mlp.pt"), "bogus"), TS_EINVAL);
    ts_torch_model_t *cpu = load("mlp.pt");
    assert_int_equal(ts_torch_clone(&m, cpu, "cuda:99"), gpus == 0 ? TS_ENOTSUP : TS_EINVAL);
    assert_int_equal(ts_torch_clone(&m, cpu, NULL), 0);
    assert_string_equal(ts_torch_model_device(m), "cpu");
    ts_torch_model_free(m);
    ts_torch_model_free(cpu);
    ts_torch_model_free(NULL);
}

static void test_dict_model(void **state)
{
    (void)state;
    ts_torch_model_t *m = load("dict.pt");
    ts_value_t *in = ts_map_new();
    assert_int_equal(ts_map_set(in, "x", ftensor(8, 16, 1)), 0);
    assert_int_equal(ts_map_set(in, "y", ftensor(8, 16, 2)), 0);
    ts_value_t *out = NULL;
    assert_int_equal(ts_torch_forward(m, in, &out), 0);
    assert_int_equal(ts_value_type(out), TS_TYPE_MAP);
    const ts_tensor_t *o = ts_map_get_tensor(out, "output");
    const ts_tensor_t *s = ts_map_get_tensor(out, "sum");
    assert_non_null(o);
    assert_non_null(s);
    assert_int_equal(o->shape[0], 8);
    assert_int_equal(o->shape[1], 1);
    const float *x = ts_map_get_tensor(in, "x")->data, *y = ts_map_get_tensor(in, "y")->data;
    for (int i = 0; i < 8 * 16; i++)
        assert_true(((const float *)s->data)[i] == x[i] + y[i]);
    ts_value_free(out);
    /* A missing key is the model's error, not a crash. */
    ts_value_t *bad = ts_map_new();
    assert_int_equal(ts_map_set(bad, "x", ftensor(8, 16, 1)), 0);
    assert_int_equal(ts_torch_forward(m, bad, &out), TS_ETORCH);
    ts_value_free(bad);
    /* A list where a dict is expected: TorchScript's argument check reports it. */
    bad = ts_list_new();
    assert_int_equal(ts_list_push(bad, ftensor(1, 16, 1)), 0);
    assert_int_equal(ts_torch_forward(m, bad, &out), TS_ETORCH);
    assert_true(strlen(ts_last_error()) > 0);
    ts_value_free(bad);
    ts_value_free(in);
    ts_torch_model_free(m);
}

static void test_raising(void **state)
{
    (void)state;
    ts_torch_model_t *m = load("raising.pt");
    ts_value_t *x = ftensor(2, 3, 0), *y = NULL;
    float *d = (float *)fdata(x);
    for (int i = 0; i < 6; i++)
        d[i] = (float)i;
    assert_int_equal(ts_torch_forward(m, x, &y), 0);
    assert_true(fdata(y)[5] == 10.0f);
    ts_value_free(y);
    d[2] = -1.0f;
    y = NULL;
    assert_int_equal(ts_torch_forward(m, x, &y), TS_ETORCH);
    assert_null(y);
    assert_non_null(strstr(ts_last_error(), "negative input"));
    /* The model keeps working after the exception. */
    d[2] = 2.0f;
    assert_int_equal(ts_torch_forward(m, x, &y), 0);
    ts_value_free(y);
    ts_value_free(x);
    ts_torch_model_free(m);
}

/* Every dtype goes through unchanged (the identity model returns its input dict). */
static void test_dtypes(void **state)
{
    (void)state;
    ts_torch_model_t *m = load("identity.pt");
    ts_value_t *in = ts_map_new();
    const ts_dtype_t dts[] = {TS_BOOL,    TS_UINT8,   TS_INT8,      TS_INT16,
                              TS_INT32,   TS_INT64,   TS_FLOAT16,   TS_BFLOAT16,
                              TS_FLOAT32, TS_FLOAT64, TS_COMPLEX64, TS_COMPLEX128};
    for (size_t i = 0; i < sizeof(dts) / sizeof(dts[0]); i++) {
        int64_t shape[3] = {2, 3, 1};
        ts_value_t *t = ts_tensor_alloc(dts[i], 3, shape);
        uint8_t *p = ts_value_tensor(t)->data;
        for (size_t b = 0; b < ts_tensor_nbytes(ts_value_tensor(t)); b++)
            p[b] = dts[i] == TS_BOOL ? (uint8_t)(b % 2) : (uint8_t)(b * 7 + i);
        assert_int_equal(ts_map_set(in, ts_dtype_name(dts[i]), t), 0);
    }
    int64_t empty_shape[2] = {0, 5};
    assert_int_equal(ts_map_set(in, "empty", ts_tensor_alloc(TS_FLOAT32, 2, empty_shape)), 0);
    assert_int_equal(ts_map_set(in, "scalar", ts_tensor_alloc(TS_INT64, 0, NULL)), 0);
    ts_value_t *out = NULL;
    assert_int_equal(ts_torch_forward(m, in, &out), 0);
    assert_int_equal(ts_value_len(out), ts_value_len(in));
    for (size_t i = 0; i < ts_value_len(in); i++) {
        const char *key = ts_map_key_at(in, i);
        const ts_tensor_t *a = ts_value_tensor(ts_map_value_at(in, i));
        const ts_tensor_t *b = ts_map_get_tensor(out, key);
        assert_non_null(b);
        assert_int_equal(a->dtype, b->dtype);
        assert_int_equal(a->ndim, b->ndim);
        for (int d = 0; d < a->ndim; d++)
            assert_int_equal(a->shape[d], b->shape[d]);
        /* Copied out: the output owns its memory. */
        if (ts_tensor_nbytes(a) > 0) {
            assert_ptr_not_equal(a->data, b->data);
            assert_memory_equal(a->data, b->data, ts_tensor_nbytes(a));
        }
    }
    ts_value_free(out);
    ts_value_free(in);
    ts_torch_model_free(m);
}

static void test_lists_and_scalars(void **state)
{
    (void)state;
    ts_torch_model_t *m = load("listy.pt");
    ts_value_t *in = ts_list_new();
    assert_int_equal(ts_list_push(in, ftensor(2, 2, 1)), 0);
    assert_int_equal(ts_list_push(in, ftensor(2, 2, 2)), 0);
    assert_int_equal(ts_list_push(in, ftensor(2, 2, 3)), 0);
    ts_value_t *out = NULL;
    assert_int_equal(ts_torch_forward(m, in, &out), 0);
    assert_int_equal(ts_value_type(out), TS_TYPE_LIST);
    assert_int_equal(ts_value_len(out), 6);
    const float *a = fdata(ts_list_at(in, 0)), *b = fdata(ts_list_at(in, 1));
    const float *sum = fdata(ts_list_at(out, 0));
    for (int i = 0; i < 4; i++)
        assert_true(sum[i] == a[i] + b[i]);
    const ts_value_t *l = ts_list_at(out, 1);
    assert_int_equal(ts_value_type(l), TS_TYPE_LIST);
    assert_true(fdata(ts_list_at(l, 0))[3] == a[3] * 2);
    int64_t n;
    double f;
    const char *s;
    size_t len;
    assert_int_equal(ts_value_int(ts_list_at(out, 2), &n), 0);
    assert_int_equal(n, 3);
    assert_int_equal(ts_value_float(ts_list_at(out, 3), &f), 0);
    assert_true(f == 1.5);
    assert_int_equal(ts_value_string(ts_list_at(out, 4), &s, &len), 0);
    assert_string_equal(s, "ok");
    assert_int_equal(ts_value_int(ts_list_at(out, 5), &n), 0);
    assert_int_equal(n, 1);
    ts_value_free(out);
    ts_value_free(in);
    ts_torch_model_free(m);
}

/* Inputs are wrapped without copying; the release callback tells when libtorch let go. */
static atomic_int g_release;

static void on_release(void *arg)
{
    (void)arg;
    atomic_fetch_add(&g_release, 1);
}

static void test_retained(void **state)
{
    (void)state;
    ts_torch_model_t *m = load("mlp.pt");
    ts_value_t *x = ftensor(2, 8, 0), *y = NULL;
    atomic_store(&g_release, 0);
    assert_int_equal(ts_torch_forward_retained(m, x, on_release, NULL, &y), 0);
    assert_int_equal(atomic_load(&g_release), 1); /* the MLP keeps nothing */
    ts_value_free(y);
    /* Failing calls release too, exactly once. */
    assert_int_equal(ts_torch_forward_retained(m, NULL, on_release, NULL, &y), TS_EINVAL);
    assert_int_equal(atomic_load(&g_release), 2);
    ts_value_t *bad = ftensor(2, 7, 0);
    assert_int_equal(ts_torch_forward_retained(m, bad, on_release, NULL, &y), TS_ETORCH);
    assert_int_equal(atomic_load(&g_release), 3);
    ts_value_free(bad);
    ts_torch_model_free(m);

    /* A model that keeps its input: released only when it lets go of it. */
    m = load("keeper.pt");
    atomic_store(&g_release, 0);
    ts_value_t *x2 = ftensor(2, 8, 1);
    assert_int_equal(ts_torch_forward_retained(m, x, on_release, NULL, &y), 0);
    assert_int_equal(atomic_load(&g_release), 0);
    assert_true(fdata(y)[0] == fdata(x)[0] + 1);
    ts_value_free(y);
    assert_int_equal(ts_torch_forward_retained(m, x2, on_release, NULL, &y), 0);
    assert_int_equal(atomic_load(&g_release), 1); /* x dropped, x2 kept */
    ts_value_free(y);
    ts_torch_model_free(m);
    assert_int_equal(atomic_load(&g_release), 2);
    ts_value_free(x2);
    ts_value_free(x);
}

static void test_state_dict(void **state)
{
    (void)state;
    ts_torch_model_t *m = load("mlp.pt");
    ts_value_t *sd = NULL, *x = ftensor(3, 8, 4), *y = NULL;
    assert_int_equal(ts_torch_state_dict(m, &sd), 0);
    /* Double out_scale, nested form for fc1 ({fc1: {weight, bias}}), and load. */
    ts_value_t *nested = ts_map_new(), *fc1 = ts_map_new();
    assert_int_equal(ts_map_set(fc1, "weight", ts_value_clone(ts_map_get(sd, "fc1.weight"))), 0);
    assert_int_equal(ts_map_set(fc1, "bias", ts_value_clone(ts_map_get(sd, "fc1.bias"))), 0);
    assert_int_equal(ts_map_set(nested, "fc1", fc1), 0);
    assert_int_equal(ts_map_set(nested, "fc2.weight", ts_value_clone(ts_map_get(sd, "fc2.weight"))),
                     0);
    assert_int_equal(ts_map_set(nested, "fc2.bias", ts_value_clone(ts_map_get(sd, "fc2.bias"))), 0);
    float two[4] = {2, 2, 2, 2};
    int64_t four = 4;
    assert_int_equal(
        ts_map_set(nested, "out_scale", ts_tensor_new(TS_FLOAT32, 1, &four, two, TS_COPY)), 0);
    assert_int_equal(ts_torch_load_state_dict(m, nested, 0), 0);
    float want[12];
    mlp_reference(sd, fdata(x), 3, want);
    for (int i = 0; i < 12; i++)
        want[i] *= 2;
    assert_int_equal(ts_torch_forward(m, x, &y), 0);
    assert_true(close_enough(fdata(y), want, 12));
    ts_value_free(y);

    /* Mismatches are reported by name, and nothing is loaded. */
    ts_value_t *bad = ts_value_clone(sd);
    float eights[4] = {8, 8, 8, 8};
    assert_int_equal(
        ts_map_set(bad, "out_scale", ts_tensor_new(TS_FLOAT32, 1, &four, eights, TS_COPY)), 0);
    assert_int_equal(ts_map_set(bad, "fc3.weight", ts_value_clone(ts_map_get(sd, "fc2.bias"))), 0);
    int64_t wrong[2] = {8, 32};
    assert_int_equal(ts_map_set(bad, "fc1.weight", ts_tensor_alloc(TS_FLOAT32, 2, wrong)), 0);
    ts_value_t *fewer = ts_map_new();
    for (size_t i = 0; i < ts_value_len(bad); i++)
        if (strcmp(ts_map_key_at(bad, i), "fc2.bias") != 0)
            assert_int_equal(
                ts_map_set(fewer, ts_map_key_at(bad, i), ts_value_clone(ts_map_value_at(bad, i))),
                0);
    assert_int_equal(ts_torch_load_state_dict(m, fewer, 0), TS_EINVAL);
    const char *msg = ts_last_error();
    print_message("    %s\n", msg);
    assert_non_null(strstr(msg, "missing: fc2.bias"));
    assert_non_null(strstr(msg, "unexpected: fc3.weight"));
    assert_non_null(strstr(msg, "fc1.weight [8,32] (model [32,8])"));
    assert_int_equal(ts_torch_forward(m, x, &y), 0);
    assert_true(close_enough(fdata(y), want, 12)); /* still the doubled model */
    ts_value_free(y);
    /* Non-strict ignores the names but not the shapes. */
    assert_int_equal(ts_torch_load_state_dict(m, fewer, TS_TORCH_NONSTRICT), TS_EINVAL);
    assert_null(strstr(ts_last_error(), "missing"));
    assert_int_equal(ts_map_set(fewer, "fc1.weight", ts_value_clone(ts_map_get(sd, "fc1.weight"))),
                     0);
    assert_int_equal(ts_torch_load_state_dict(m, fewer, TS_TORCH_NONSTRICT), 0);
    assert_int_equal(ts_torch_forward(m, x, &y), 0);
    for (int i = 0; i < 12; i++)
        want[i] *= 4; /* out_scale 8 now */
    assert_true(close_enough(fdata(y), want, 12));
    ts_value_free(y);
    /* A leaf that is not a tensor. */
    ts_value_t *notensor = ts_map_new();
    assert_int_equal(ts_map_set(notensor, "fc1.weight", ts_int_new(3)), 0);
    assert_int_equal(ts_torch_load_state_dict(m, notensor, TS_TORCH_NONSTRICT), TS_EINVAL);
    assert_non_null(strstr(ts_last_error(), "fc1.weight"));
    /* float64 weights convert. */
    ts_value_t *f64 = ts_map_new();
    double d2[4] = {1, 1, 1, 1};
    assert_int_equal(ts_map_set(f64, "out_scale", ts_tensor_new(TS_FLOAT64, 1, &four, d2, TS_COPY)),
                     0);
    assert_int_equal(ts_torch_load_state_dict(m, f64, TS_TORCH_NONSTRICT), 0);
    ts_value_free(f64);
    ts_value_free(notensor);
    ts_value_free(fewer);
    ts_value_free(bad);
    ts_value_free(nested);
    ts_value_free(sd);
    ts_value_free(x);
    ts_torch_model_free(m);
}

/* ---------------------------------------------------------------------------------------------
 * TorchScript in the batcher
 */
static const ts_field_t mlp_in[] = {{"", TS_FLOAT32, 1, {8}}};
static const ts_field_t mlp_out[] = {{"", TS_FLOAT32, 1, {4}}};

static ts_batcher_t *mlp_batcher(ts_torch_model_t *proto, const char *placement, int max_batch,
                                 int64_t delay_us, int *rc_out)
{
    ts_batcher_options_t cfg;
    ts_batcher_options_init(&cfg);
    cfg.inputs = mlp_in;
    cfg.n_inputs = 1;
    cfg.outputs = mlp_out;
    cfg.n_outputs = 1;
    cfg.max_batch = max_batch;
    cfg.max_delay_us = delay_us;
    cfg.placement = placement;
    cfg.cuda_devices = ts_torch_cuda_device_count();
    cfg.create = ts_torch_model_create;
    cfg.create_arg = proto;
    ts_batcher_t *b = NULL;
    *rc_out = ts_batcher_new(&b, &cfg);
    return b;
}

typedef struct tsub {
    ts_batcher_t *b;
    ts_torch_model_t *ref;
    pthread_mutex_t *ref_mu;
    int index;
    int ok;
} tsub;

static void *tsub_main(void *arg)
{
    tsub *s = arg;
    s->ok = 1;
    for (int i = 0; i < 20 && s->ok; i++) {
        int64_t rows = 1 + (s->index + i) % 3;
        ts_value_t *x = ftensor(rows, 8, s->index * 100 + i), *y = NULL, *want = NULL;
        int rc = ts_batcher_predict(s->b, x, 30000, &y, NULL);
        pthread_mutex_lock(s->ref_mu);
        int rc2 = ts_torch_forward(s->ref, x, &want);
        pthread_mutex_unlock(s->ref_mu);
        if (rc != 0 || rc2 != 0 || ts_value_tensor(y)->shape[0] != rows ||
            !close_enough(fdata(y), fdata(want), (size_t)rows * 4))
            s->ok = 0;
        ts_value_free(y);
        ts_value_free(want);
        ts_value_free(x);
    }
    return NULL;
}

/* Batched answers equal unbatched forwards, for many threads with mixed row counts. */
static void test_batcher_torch(void **state)
{
    (void)state;
    ts_torch_model_t *proto = load("mlp.pt");
    ts_torch_model_t *ref = load("mlp.pt");
    pthread_mutex_t ref_mu = PTHREAD_MUTEX_INITIALIZER;
    int rc;
    ts_batcher_t *b = mlp_batcher(proto, "cpu:2", 16, 2000, &rc);
    assert_int_equal(rc, 0);
    enum { T = 16 };
    tsub s[T];
    pthread_t th[T];
    for (int i = 0; i < T; i++) {
        s[i] = (tsub){b, ref, &ref_mu, i, 0};
        assert_int_equal(pthread_create(&th[i], NULL, tsub_main, &s[i]), 0);
    }
    for (int i = 0; i < T; i++) {
        pthread_join(th[i], NULL);
        assert_true(s[i].ok);
    }
    ts_batcher_stats_t st;
    ts_batcher_stats(b, &st);
    assert_int_equal(st.requests, T * 20);
    assert_true(st.batches < st.requests);
    print_message("    %llu requests in %llu batches (%.1f rows per batch)\n",
                  (unsigned long long)st.requests, (unsigned long long)st.batches,
                  (double)st.rows / (double)st.batches);

    /* New weights reach every replica; answers carry the version. */
    ts_value_t *sd = NULL;
    assert_int_equal(ts_torch_state_dict(ref, &sd), 0);
    float three[4] = {3, 3, 3, 3};
    int64_t four = 4;
    assert_int_equal(
        ts_map_set(sd, "out_scale", ts_tensor_new(TS_FLOAT32, 1, &four, three, TS_COPY)), 0);
    assert_int_equal(ts_batcher_load_weights(b, sd, 7, 30000), 0);
    ts_value_t *x = ftensor(2, 8, 9), *y = NULL, *want = NULL;
    int64_t version = 0;
    assert_int_equal(ts_batcher_predict(b, x, TS_TIMEOUT_DEFAULT, &y, &version), 0);
    assert_int_equal(version, 7);
    assert_int_equal(ts_torch_forward(ref, x, &want), 0);
    float w3[8];
    for (int i = 0; i < 8; i++)
        w3[i] = fdata(want)[i] * 3;
    assert_true(close_enough(fdata(y), w3, 8));
    ts_value_free(y);
    ts_value_free(want);
    /* A state dict that does not fit is refused by name; the replicas keep version 7. */
    ts_value_t *bad = ts_map_new();
    assert_int_equal(ts_map_set(bad, "fc9.weight", ftensor(1, 1, 0)), 0);
    assert_int_equal(ts_batcher_load_weights(b, bad, 8, 30000), TS_EINVAL);
    assert_non_null(strstr(ts_last_error(), "fc9.weight"));
    int64_t lo, hi;
    ts_batcher_versions(b, &lo, &hi);
    assert_int_equal(lo, 7);
    assert_int_equal(hi, 7);
    ts_value_free(bad);
    ts_value_free(sd);
    ts_value_free(x);
    ts_batcher_free(b);
    ts_torch_model_free(ref);
    ts_torch_model_free(proto);
}

/* A model that raises fails its batch with TS_EMODEL; the replica keeps serving. */
static void test_batcher_model_error(void **state)
{
    (void)state;
    ts_torch_model_t *proto = load("raising.pt");
    const ts_field_t f[] = {{"", TS_FLOAT32, 1, {3}}};
    ts_batcher_options_t cfg;
    ts_batcher_options_init(&cfg);
    cfg.inputs = f;
    cfg.n_inputs = 1;
    cfg.max_batch = 4;
    cfg.max_delay_us = 0;
    cfg.create = ts_torch_model_create;
    cfg.create_arg = proto;
    ts_batcher_t *b = NULL;
    assert_int_equal(ts_batcher_new(&b, &cfg), 0);
    ts_value_t *x = ftensor(1, 3, 0), *y = NULL;
    float *d = (float *)fdata(x);
    d[0] = d[1] = d[2] = -1.0f;
    assert_int_equal(ts_batcher_predict(b, x, TS_TIMEOUT_DEFAULT, &y, NULL), TS_EMODEL);
    assert_non_null(strstr(ts_last_error(), "negative input"));
    d[0] = d[1] = d[2] = 1.0f;
    assert_int_equal(ts_batcher_predict(b, x, TS_TIMEOUT_DEFAULT, &y, NULL), 0);
    assert_true(fdata(y)[1] == 2.0f);
    ts_value_free(y);
    ts_value_free(x);
    ts_batcher_free(b);
    ts_torch_model_free(proto);
}

/* A CUDA placement on this CPU-only build fails clearly at creation. */
/* CUDA placements: a clear error on a CPU-only build, replicas on every GPU otherwise. */
static void test_batcher_cuda(void **state)
{
    (void)state;
    ts_torch_model_t *proto = load("mlp.pt");
    int rc;
    if (ts_torch_cuda_device_count() == 0) {
        ts_batcher_t *b = mlp_batcher(proto, "cuda:0", 8, 100, &rc);
        assert_null(b);
        assert_int_equal(rc, TS_ENOTSUP);
        print_message("    %s\n", ts_last_error());
        assert_non_null(strstr(ts_last_error(), "CUDA is not available"));
        b = mlp_batcher(proto, "cuda*2", 8, 100, &rc);
        assert_int_equal(rc, TS_ENOTSUP);
    } else {
        ts_batcher_t *b = mlp_batcher(proto, "cuda*2", 8, 1000, &rc);
        assert_int_equal(rc, 0);
        ts_value_t *x = ftensor(3, 8, 5), *y = NULL, *want = NULL;
        assert_int_equal(ts_batcher_predict(b, x, 30000, &y, NULL), 0);
        assert_int_equal(ts_torch_forward(proto, x, &want), 0);
        assert_true(close_enough(fdata(y), fdata(want), 12));
        ts_value_free(y);
        ts_value_free(want);
        /* A weight update reaches both GPU replicas: halved weights, answered as version 7. */
        ts_value_t *sd = NULL;
        assert_int_equal(ts_torch_state_dict(proto, &sd), 0);
        for (size_t i = 0; i < ts_value_len(sd); i++) {
            const ts_tensor_t *t = ts_value_tensor(ts_map_value_at(sd, i));
            for (int64_t k = 0; t->dtype == TS_FLOAT32 && k < ts_tensor_numel(t); k++)
                ((float *)t->data)[k] *= 0.5f;
        }
        assert_int_equal(ts_batcher_load_weights(b, sd, 7, 30000), 0);
        int64_t lo = 0, hi = 0;
        ts_batcher_versions(b, &lo, &hi);
        assert_int_equal(lo, 7);
        assert_int_equal(hi, 7);
        ts_torch_model_t *ref = NULL;
        assert_int_equal(ts_torch_clone(&ref, proto, "cpu"), 0);
        assert_int_equal(ts_torch_load_state_dict(ref, sd, 0), 0);
        assert_int_equal(ts_torch_forward(ref, x, &want), 0);
        for (int i = 0; i < 4; i++) {
            int64_t v = -1;
            assert_int_equal(ts_batcher_predict(b, x, 30000, &y, &v), 0);
            assert_int_equal(v, 7);
            assert_true(close_enough(fdata(y), fdata(want), 12));
            ts_value_free(y);
        }
        ts_value_free(want);
        ts_torch_model_free(ref);
        ts_value_free(sd);
        ts_value_free(x);
        ts_batcher_free(b);
    }
    ts_torch_model_free(proto);
}

/* Largest |a - b| over n floats, and largest |b|. */
static void max_diff(const float *a, const float *b, size_t n, double *diff, double *scale)
{
    *diff = 0;
    *scale = 0;
    for (size_t i = 0; i < n; i++) {
        double d = fabs((double)a[i] - (double)b[i]);
        *diff = d > *diff ? d : *diff;
        *scale = fabs((double)b[i]) > *scale ? fabs((double)b[i]) : *scale;
    }
}

/*
 * The documented tolerance of autocast answers against float32 ones (torch.h): bfloat16 keeps
 * 8 bits of mantissa, about 1e-2 relative; it is applied to the largest output.
 */
#define AMP_TOL 3e-2

/*
 * Mixed precision: forwards under bfloat16 autocast on CPU (float16 on CUDA when there is a GPU)
 * answer in float32, close to the float32 answers but not equal to them (the autocast ran); the
 * batcher's replicas inherit the setting from the prototype, and batched answers equal unbatched
 * ones within the same tolerance.
 */
static void test_autocast(void **state)
{
    (void)state;
    ts_torch_model_t *f32 = load("plain.pt");
    ts_torch_model_t *amp = NULL;
    assert_int_equal(ts_torch_clone(&amp, f32, NULL), 0);
    assert_int_equal(ts_torch_set_autocast(amp, TS_INT32), TS_EINVAL);
    assert_int_equal(ts_torch_set_autocast(amp, TS_BFLOAT16), 0);
    ts_value_t *x = ftensor(16, 8, 3), *y = NULL, *want = NULL;
    assert_int_equal(ts_torch_forward(amp, x, &y), 0);
    assert_int_equal(ts_torch_forward(f32, x, &want), 0);
    assert_int_equal(ts_value_tensor(y)->dtype, TS_FLOAT32);
    double diff, scale;
    max_diff(fdata(y), fdata(want), 64, &diff, &scale);
    print_message("    bfloat16 autocast on cpu: largest difference %.3g (largest output %.3g)\n",
                  diff, scale);
    assert_true(diff > 0);
    assert_true(diff <= AMP_TOL * (scale > 1 ? scale : 1));
    ts_value_free(y);

    /* The batcher's replicas are copies of amp: they run under autocast too. */
    const ts_field_t in[] = {{"", TS_FLOAT32, 1, {8}}};
    const ts_field_t out[] = {{"", TS_FLOAT32, 1, {4}}};
    ts_batcher_options_t cfg;
    ts_batcher_options_init(&cfg);
    cfg.inputs = in;
    cfg.n_inputs = 1;
    cfg.outputs = out;
    cfg.n_outputs = 1;
    cfg.max_batch = 16;
    cfg.max_delay_us = 1000;
    cfg.placement = "cpu:2";
    cfg.create = ts_torch_model_create;
    cfg.create_arg = amp;
    ts_batcher_t *b = NULL;
    assert_int_equal(ts_batcher_new(&b, &cfg), 0);
    for (int r = 0; r < 16; r++) {
        int64_t shape[2] = {1, 8};
        ts_value_t *row = ts_tensor_new(TS_FLOAT32, 2, shape, (float *)fdata(x) + r * 8, TS_BORROW);
        assert_int_equal(ts_batcher_predict(b, row, 30000, &y, NULL), 0);
        max_diff(fdata(y), fdata(want) + r * 4, 4, &diff, &scale);
        assert_true(diff <= AMP_TOL * (scale > 1 ? scale : 1));
        ts_value_free(y);
        ts_value_free(row);
    }
    ts_batcher_free(b);

    /* float16 autocast is CUDA's: a CPU model refuses to run with it. */
    assert_int_equal(ts_torch_set_autocast(amp, TS_FLOAT16), 0);
    assert_int_equal(ts_torch_forward(amp, x, &y), TS_ENOTSUP);
    if (ts_torch_cuda_device_count() > 0) {
        ts_torch_model_t *gpu = NULL;
        assert_int_equal(ts_torch_clone(&gpu, amp, "cuda:0"), 0);
        assert_int_equal(ts_torch_forward(gpu, x, &y), 0);
        assert_int_equal(ts_value_tensor(y)->dtype, TS_FLOAT32);
        max_diff(fdata(y), fdata(want), 64, &diff, &scale);
        print_message("    float16 autocast on cuda:0: largest difference %.3g\n", diff);
        assert_true(diff <= AMP_TOL * (scale > 1 ? scale : 1));
        ts_value_free(y);
        ts_torch_model_free(gpu);
    }
    assert_int_equal(ts_torch_set_autocast(amp, TS_FLOAT32), 0);
    assert_int_equal(ts_torch_forward(amp, x, &y), 0);
    max_diff(fdata(y), fdata(want), 64, &diff, &scale);
    assert_true(diff <= 1e-5 * (scale > 1 ? scale : 1));
    ts_value_free(y);
    ts_value_free(want);
    ts_value_free(x);
    ts_torch_model_free(amp);
    ts_torch_model_free(f32);
}

int main(void)
{
    const char *dir = getenv("TS_MODELS_DIR");
    if (dir == NULL) {
        fprintf(stderr, "TS_MODELS_DIR is not set\n");
        return 1;
    }
    snprintf(g_dir, sizeof(g_dir), "%s", dir);
    ts_torch_set_num_threads(1);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_mlp_forward),   cmocka_unit_test(test_devices),
        cmocka_unit_test(test_dict_model),    cmocka_unit_test(test_raising),
        cmocka_unit_test(test_dtypes),        cmocka_unit_test(test_lists_and_scalars),
        cmocka_unit_test(test_retained),      cmocka_unit_test(test_state_dict),
        cmocka_unit_test(test_batcher_torch), cmocka_unit_test(test_batcher_model_error),
        cmocka_unit_test(test_batcher_cuda),  cmocka_unit_test(test_autocast),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
