/*
 * kvd's CPU post-process kernel: permute the head_dim rows of listed KV-cache blocks in place.
 *
 * Every block of every tensor gets the same row permutation (new row i = old row perm[i]).
 * Each worker thread gathers one block into a private scratch buffer that stays in cache, then
 * copies it back, so every byte of the block is read once and written once in main memory.
 * The permutation arrives as runs (dst_row, src_row, n_rows) of rows that move together, which
 * turns merges (HND -> HND) into a few long copies. The write-back uses ordinary stores: the
 * gather has just pulled every line of the block into cache, so they hit there. (Non-temporal
 * stores, which skip the cache, made the kernel 1.2 to 1.4 times slower on a 2-core VM.)
 *
 * The Python wrapper (kvd/kernels/cpu.py) checks every address against the tensors' bounds;
 * this file trusts its arguments. No Python object is touched while the GIL is released.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    const uint64_t *bases;   /* one base address per tensor part */
    int64_t n_bases;
    const int64_t *block_ids;
    int64_t n_blocks;
    const int64_t *runs;     /* (dst_row, src_row, n_rows) triples */
    int64_t n_runs;
    int64_t block_stride;    /* bytes between consecutive blocks of a part */
    int64_t row_bytes;
    int64_t rows_per_block;
    int64_t first, last;     /* this worker's slice of the (part, block) items */
    int failed;
} work_t;

/* Constant sizes let the compiler inline the copy as a few vector moves: single rows of the
 * common head_dim sizes are far too short to amortise a call into libc's memcpy. */
static inline void copy_bytes(char *dst, const char *src, size_t n) {
    switch (n) {
    case 64: memcpy(dst, src, 64); break;
    case 128: memcpy(dst, src, 128); break;
    case 256: memcpy(dst, src, 256); break;
    case 512: memcpy(dst, src, 512); break;
    default: memcpy(dst, src, n);
    }
}

static void *run_slice(void *arg) {
    work_t *w = (work_t *)arg;
    size_t block_bytes = (size_t)(w->rows_per_block * w->row_bytes);
    /* Cache-line aligned: the write-back reads it line by line. */
    char *scratch = aligned_alloc(64, (block_bytes + 63) / 64 * 64);
    if (scratch == NULL) {
        w->failed = 1;
        return NULL;
    }
    for (int64_t item = w->first; item < w->last; item++) {
        char *block = (char *)(uintptr_t)w->bases[item / w->n_blocks] +
                      w->block_ids[item % w->n_blocks] * w->block_stride;
        for (int64_t r = 0; r < w->n_runs; r++) {
            const int64_t *run = w->runs + 3 * r;
            copy_bytes(scratch + run[0] * w->row_bytes, block + run[1] * w->row_bytes,
                       (size_t)(run[2] * w->row_bytes));
        }
        memcpy(block, scratch, block_bytes);
    }
    free(scratch);
    return NULL;
}

#define MAX_THREADS 64

static PyObject *permute_blocks(PyObject *self, PyObject *args) {
    (void)self;
    unsigned long long bases, ids, runs;
    long long n_bases, n_ids, n_runs, block_stride, row_bytes, rows_per_block;
    int threads;
    if (!PyArg_ParseTuple(args, "KLKLKLLLLi", &bases, &n_bases, &ids, &n_ids, &runs, &n_runs,
                          &block_stride, &row_bytes, &rows_per_block, &threads)) {
        return NULL;
    }
    if (row_bytes <= 0 || rows_per_block <= 0 || block_stride < row_bytes * rows_per_block ||
        n_bases < 0 || n_ids < 0 || n_runs < 0) {
        PyErr_SetString(PyExc_ValueError, "permute_blocks: bad geometry or counts");
        return NULL;
    }
    int64_t items = n_bases * n_ids;
    if (threads < 1) threads = 1;
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    if (items < threads) threads = items > 0 ? (int)items : 1;

    work_t work[MAX_THREADS];
    pthread_t tids[MAX_THREADS];
    int started[MAX_THREADS] = {0};
    for (int t = 0; t < threads; t++) {
        work[t] = (work_t){
            .bases = (const uint64_t *)(uintptr_t)bases, .n_bases = n_bases,
            .block_ids = (const int64_t *)(uintptr_t)ids, .n_blocks = n_ids,
            .runs = (const int64_t *)(uintptr_t)runs, .n_runs = n_runs,
            .block_stride = block_stride, .row_bytes = row_bytes,
            .rows_per_block = rows_per_block,
            .first = items * t / threads, .last = items * (t + 1) / threads, .failed = 0,
        };
    }
    int failed = 0;
    if (items > 0) {
        Py_BEGIN_ALLOW_THREADS
        for (int t = 1; t < threads; t++) {
            started[t] = pthread_create(&tids[t], NULL, run_slice, &work[t]) == 0;
            if (!started[t]) run_slice(&work[t]); /* no thread: do its share here */
        }
        run_slice(&work[0]);
        for (int t = 1; t < threads; t++) {
            if (started[t]) pthread_join(tids[t], NULL);
        }
        Py_END_ALLOW_THREADS
        for (int t = 0; t < threads; t++) failed |= work[t].failed;
    }
    if (failed) {
        return PyErr_NoMemory();
    }
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"permute_blocks", permute_blocks, METH_VARARGS,
     "permute_blocks(bases, n_bases, block_ids, n_ids, runs, n_runs, block_stride, row_bytes,\n"
     "               rows_per_block, threads)\n"
     "Apply a row permutation, given as int64 (dst_row, src_row, n_rows) runs, in place to every\n"
     "listed block of every base. bases, block_ids and runs are addresses of int64 arrays.\n"
     "The GIL is released while the rows move."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_rowperm", NULL, -1, methods};

PyMODINIT_FUNC PyInit__rowperm(void) { return PyModule_Create(&module); }
